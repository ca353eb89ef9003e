// What same-host peers (shm, nvlink) exchange beyond the common frames (docs/wire-protocol.md,
// section 3.1).
#pragma once

#include <cstdint>

namespace sluice::detail::same_host {

// One piece of a PULL_WRITE: the owner of `dst_region` copies `length` bytes from the
// requester's address `src_addr` into its own region. The requester names its own memory (the
// frame comes over the authenticated control channel, so this is the proven process speaking
// about itself): `src_region` and `src_slot` are its region holding those bytes and that
// region's slot in its lease table (0 and ~0: a staging buffer outside any region). The owner
// copies inside that lease and keeps the bytes only if it still holds after the copy.
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

// Payload of SEND_RTS: the sender's region holding the message and its lease slot, so that the
// receiver holds the sender's lease while it copies (and discards the copy if the sender
// withdrew the region meanwhile).
struct RtsSource {
  uint64_t region;
  uint32_t slot;
  uint32_t pad;
};
static_assert(sizeof(RtsSource) == 16);

}  // namespace sluice::detail::same_host
