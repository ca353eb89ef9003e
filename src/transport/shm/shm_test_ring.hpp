// Test seam: how many eager SENDs this process took through its eager rings (shm_eager.cpp),
// so that a test of the ring can tell that its messages did not all go in their frames.
#pragma once

#include <cstdint>

namespace sluice::detail::shm {

uint64_t test_ring_messages_served();
// How many SENDs this process copied into recvs its peers offered (shm_offer.cpp).
uint64_t test_offered_sends();

}  // namespace sluice::detail::shm
