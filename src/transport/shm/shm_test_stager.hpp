// Test seam: shm endpoints behind the staging adapter with a fake stager, so that a CPU-only
// test can run a real shm endpoint behind a StagingEndpoint (tests/transport/shm_staging_test.cpp).
#pragma once

#include <memory>

#include "transport/common/staging_endpoint.hpp"

namespace sluice::detail::shm {

// Test only: endpoints created while this is set sit behind a StagingEndpoint with `stager`
// (in place of CUDA staging's, or of none); null restores the default.
void set_test_stager(std::shared_ptr<Stager> stager);

}  // namespace sluice::detail::shm
