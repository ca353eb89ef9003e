// Helpers for hostile-peer tests that speak the bootstrap wire format by hand: forged
// headers, waiting for the engine to hang up, and counting the process's threads and fds.
#pragma once

#include <dirent.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdint>

#include "sluice/version.hpp"

namespace sluice_test {

// The bootstrap header as src/bootstrap/messages.cpp lays it out (to forge broken ones).
struct BootHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;
  uint32_t length;
  uint32_t check;
};
inline uint32_t boot_check(const BootHeader& h) {
  uint64_t x = (uint64_t(h.magic) << 32) ^ (uint64_t(h.version) << 16) ^ h.kind ^ (uint64_t(h.length) << 24);
  x *= 0x9e3779b97f4a7c15ull;
  return static_cast<uint32_t>(x >> 32);
}
inline BootHeader boot_header(uint16_t kind, uint32_t length, uint16_t version = sluice::kWireVersion) {
  BootHeader h{0x42434c53, version, kind, length, 0};
  h.check = boot_check(h);
  return h;
}

// Reads exactly n bytes from `fd`, waiting at most 5 s for each part; false on EOF, an
// error or that wait.
inline bool recv_all(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n) {
    pollfd pf{fd, POLLIN, 0};
    if (::poll(&pf, 1, 5000) <= 0) return false;
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Waits until the peer closes `fd` (EOF or reset); drains whatever it sends first.
inline bool closed_by_peer(int fd, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    ssize_t r = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
}

inline int count_dir(const char* path) {
  int n = 0;
  if (DIR* d = ::opendir(path)) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}
inline int thread_count() { return count_dir("/proc/self/task"); }
inline int fd_count() { return count_dir("/proc/self/fd"); }

}  // namespace sluice_test
