// Single-copy reads from a peer process on the same host (process_vm_readv), many pieces per
// system call.
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

// Copies every span from the peer into this process (process_vm_readv). There is deliberately
// no write: no peer's memory is ever written by address (an owner copies into its own regions,
// see docs/security.md). Errors name the cause: kPeerLost (process gone), kRemoteError (peer
// address not mapped), kUnsupported (denied).
Status read(pid_t pid, const std::vector<Span>& spans);

// Reads 8 bytes at `addr` in `pid`; sets *errno_out on failure.
bool probe(pid_t pid, uint64_t addr, uint64_t* value, int* errno_out);

}  // namespace sluice::detail::cma
