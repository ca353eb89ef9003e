// Small things many transport tests share: size units and an owned file descriptor. One
// definition, so the tests also build as a unity build (CI batches sources to save compile time).
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstddef>
#include <cstdint>

namespace sluice_test {

inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kPage = 4096;

// Sets an environment variable for the scope (test-only knobs, ParamScope::kTest, are read
// when an endpoint is created).
struct EnvScope {
  const char* name;
  EnvScope(const char* n, const char* v) : name(n) { ::setenv(n, v, 1); }
  ~EnvScope() { ::unsetenv(name); }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;
};

// Closes the descriptor it holds when it goes out of scope.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Sends all of buf, without SIGPIPE; false once the peer has closed the connection.
inline bool send_all(int fd, const void* buf, size_t n) {
  auto* p = static_cast<const char*>(buf);
  while (n) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace sluice_test
