// What shm peers exchange beyond the common frames (docs/wire-protocol.md, "shm").
#pragma once

#include <cstdint>

namespace sluice::detail::shm {

// One piece of a PULL_WRITE: the owner of `dst_region` copies `length` bytes from the
// requester's address `src_addr` (inside the requester's region `src_region`, lease slot
// `src_slot`, both 0 / ~0 when the bytes are not in a registered region) into its own region.
// Writes into a region are always executed by the region's owner: a stalled peer can then
// never land bytes in memory its owner already released.
struct PullPiece {
  uint64_t dst_region;
  uint64_t dst_offset;
  uint64_t length;
  uint64_t src_addr;
  uint64_t src_region;
  uint32_t src_slot;
  uint32_t pad;
};
static_assert(sizeof(PullPiece) == 48);
constexpr uint64_t kMaxPullPieces = 4096;  // per frame (a lane is at most this many pieces)

// Payload of SEND_RTS: where the message lives on the sender, so that the receiver can hold
// the sender's lease while it copies (and discard the copy if the sender withdrew it).
struct RtsSource {
  uint64_t region;
  uint32_t slot;
  uint32_t pad;
};
static_assert(sizeof(RtsSource) == 16);

}  // namespace sluice::detail::shm
