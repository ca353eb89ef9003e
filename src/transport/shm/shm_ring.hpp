// The layout of an eager ring (shm_eager.cpp; docs/wire-protocol.md, "The eager ring"): one
// memfd that the receiver allocates and hands its proven peer alone.
//   [data: `data` bytes, the messages][slots x RingDesc: the descriptor queue][RingControl]
// The sender writes messages and descriptors; the receiver writes only RingControl. Each side
// treats what the other writes as untrusted: the receiver reads a descriptor's fields once and
// checks them as it checks a SEND_RING frame; the sender only loses its own messages' speed
// if the receiver's words are wrong.
#pragma once

#include <cstdint>

namespace sluice::detail::shm {

// One message in the queue: valid once `stamp` = its index + 1 (stored last, with release),
// so a slot reused D messages later never looks like the newer message before it is one.
struct RingDesc {
  uint64_t stamp;
  uint64_t seq;     // the SEND's sequence number
  uint64_t length;  // 1 to shm.eager_max
  uint64_t pos;     // its position in the data area (positions only grow; see ring_place)
};
static_assert(sizeof(RingDesc) == 32);

// Written by the receiver: whether it will look at the queue again without being told
// (`awake`; the sender rings with a RING_BELL frame when it finds 0 and turns it to 1), and
// how many descriptors it has taken (the sender reuses a slot only after that).
struct RingControl {
  alignas(64) uint64_t awake;
  alignas(64) uint64_t consumed;
};
static_assert(sizeof(RingControl) == 128);

constexpr uint64_t kRingAlign = 64;
// The data area for a grant plus one message, rounded so that the descriptors are aligned.
inline uint64_t ring_data_bytes(uint64_t credit, uint64_t eager_max) {
  return (credit + eager_max + kRingAlign - 1) / kRingAlign * kRingAlign;
}
inline uint64_t ring_total_bytes(uint64_t data, uint64_t slots) {
  return data + slots * sizeof(RingDesc) + sizeof(RingControl);
}

}  // namespace sluice::detail::shm
