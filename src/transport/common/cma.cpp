#include "transport/common/cma.hpp"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace sluice::detail::cma {
namespace {
constexpr size_t kIov = 1024;  // IOV_MAX
constexpr uint64_t kMaxCall = 1ull << 30;  // keep one call's length well inside ssize_t
}  // namespace

Status read(pid_t pid, const std::vector<Span>& spans) {
  size_t i = 0;
  uint64_t done_in_span = 0;
  while (i < spans.size()) {
    iovec local[kIov], remote[kIov];
    size_t n = 0;
    uint64_t total = 0;
    size_t j = i;
    uint64_t off = done_in_span;
    while (j < spans.size() && n < kIov && total < kMaxCall) {
      uint64_t len = std::min(spans[j].length - off, kMaxCall - total);
      local[n] = {spans[j].local + off, static_cast<size_t>(len)};
      remote[n] = {reinterpret_cast<void*>(spans[j].remote + off), static_cast<size_t>(len)};
      total += len;
      ++n;
      if (off + len < spans[j].length) break;
      ++j;
      off = 0;
    }
    ssize_t r = ::process_vm_readv(pid, local, n, remote, n, 0);
    if (r < 0) {
      int err = errno;
      if (err == EINTR) continue;
      std::string what = std::string("process_vm_readv: ") + std::strerror(err);
      if (err == ESRCH) return {ErrorCode::kPeerLost, "peer process " + std::to_string(pid) + " is gone (" + what + ")"};
      if (err == EPERM) return {ErrorCode::kUnsupported, what};
      if (err == EFAULT) return {ErrorCode::kRemoteError, "peer memory is not mapped (" + what + ")"};
      return {ErrorCode::kSystem, what};
    }
    if (r == 0) return {ErrorCode::kRemoteError, "peer memory is not mapped (zero-length transfer)"};
    // Advance by r bytes (partial transfers happen at unmapped pages or signals).
    uint64_t left = static_cast<uint64_t>(r);
    while (left > 0 && i < spans.size()) {
      uint64_t rest = spans[i].length - done_in_span;
      if (left >= rest) {
        left -= rest;
        ++i;
        done_in_span = 0;
      } else {
        done_in_span += left;
        left = 0;
      }
    }
  }
  return Status::Ok();
}

bool probe(pid_t pid, uint64_t addr, uint64_t* value, int* errno_out) {
  iovec l{value, sizeof(*value)};
  iovec r{reinterpret_cast<void*>(addr), sizeof(*value)};
  ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n == static_cast<ssize_t>(sizeof(*value))) return true;
  *errno_out = n < 0 ? errno : EFAULT;
  return false;
}

}  // namespace sluice::detail::cma
