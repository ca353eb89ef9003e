// The layout of an eager ring (shm_eager.cpp; docs/wire-protocol.md, "The eager ring"): one
// memfd that the receiver allocates and hands its proven peer alone.
//   [data: `data` bytes, the messages][slots x RingDesc: the descriptor queue][RingControl]
//   [offers x RecvOfferSlot: posted recvs offered to the sender (shm_offer.cpp)]
// The sender writes messages and descriptors; the receiver writes RingControl and the offers,
// whose words the sender turns from offered to taken. Each side treats what the other writes
// as untrusted: the receiver reads a descriptor's fields once and checks them as it checks a
// SEND_RING frame; the sender only loses its own messages' speed if the receiver's words are
// wrong, and copies into an offer only inside the receiver's region as it mapped it.
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

// A posted recv that waits for message `seq`, offered to the sender: its buffer is `capacity`
// bytes at `offset` in the receiver's region `region` (engine-allocated memory, which the
// sender maps). `word` = seq << 2 | state, so a slot reused for a later message never passes
// for an earlier one. The receiver writes the fields, then the word (release); the sender
// turns kOffered into kTaken before it copies, the receiver kOffered into kRevoked before its
// recv gives up: whoever turns it first decides.
struct RecvOfferSlot {
  uint64_t word;
  uint64_t region;
  uint64_t offset;
  uint64_t capacity;
};
static_assert(sizeof(RecvOfferSlot) == 32);
enum OfferState : uint64_t { kOfferEmpty = 0, kOffered = 1, kTaken = 2, kRevoked = 3 };
constexpr uint64_t offer_word(uint64_t seq, OfferState s) { return seq << 2 | s; }

constexpr uint64_t kRingAlign = 64;
// The data area for a grant plus one message, rounded so that the descriptors are aligned.
constexpr uint64_t ring_data_bytes(uint64_t credit, uint64_t eager_max) {
  return (credit + eager_max + kRingAlign - 1) / kRingAlign * kRingAlign;
}
constexpr uint64_t ring_total_bytes(uint64_t data, uint64_t slots, uint64_t offers = 0) {
  return data + slots * sizeof(RingDesc) + sizeof(RingControl) + offers * sizeof(RecvOfferSlot);
}
inline RecvOfferSlot* ring_offers(uint8_t* base, uint64_t data, uint64_t slots) {
  return reinterpret_cast<RecvOfferSlot*>(base + data + slots * sizeof(RingDesc) + sizeof(RingControl));
}

}  // namespace sluice::detail::shm
