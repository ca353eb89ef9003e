// Single-copy moves between this process and a peer process on the same host
// (process_vm_readv / process_vm_writev), many pieces per system call.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <vector>

#include "sluice/error.hpp"

namespace sluice::detail::cma {

struct Span {
  uint8_t* local;
  uint64_t remote;  // peer virtual address
  uint64_t length;
};

// Moves every span (read: peer -> local; write: local -> peer). Errors name the cause:
// kPeerLost (process gone), kRemoteError (peer address not mapped), kUnsupported (denied).
Status move(pid_t pid, const std::vector<Span>& spans, bool write);

// Reads 8 bytes at `addr` in `pid`; sets *errno_out on failure.
bool probe(pid_t pid, uint64_t addr, uint64_t* value, int* errno_out);

}  // namespace sluice::detail::cma
