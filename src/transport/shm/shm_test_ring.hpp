// Test seam: how many eager SENDs this process took through its eager rings (shm_eager.cpp),
// so that a test of the ring can tell that its messages did not all go in their frames.
#pragma once

#include <cstdint>

namespace sluice::detail::shm {

uint64_t test_ring_messages_served();
// Of those, how many landed before their recv and stayed in the ring until one took them.
uint64_t test_ring_messages_held();
// How many SENDs this process copied into recvs its peers offered (shm_offer.cpp).
uint64_t test_offered_sends();
// Test only: a receiver's offer() hands each slot it just wrote (for message `seq`) to `f`,
// which may rewrite it as a hostile receiver would (recv_offer_test.cpp); nullptr: none.
struct RecvOfferSlot;
using OfferTamper = void (*)(RecvOfferSlot& slot, uint64_t seq);
void set_test_offer_tamper(OfferTamper f);

}  // namespace sluice::detail::shm
