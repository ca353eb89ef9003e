// Small things many transport tests share: size units and an owned file descriptor. One
// definition, so the tests also build as a unity build (CI batches sources to save compile time).
#pragma once

#include <unistd.h>

#include <cstdint>

namespace sluice_test {

inline constexpr uint64_t kMiB = 1ull << 20;
inline constexpr uint64_t kPage = 4096;

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

}  // namespace sluice_test
