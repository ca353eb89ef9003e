// SM (kernel) copies: for small messages a kernel's NVLink stores finish sooner than a
// copy-engine job.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sluice::detail::cuda {

// dst and src are device-accessible (local or peer-mapped) addresses.
cudaError_t sm_copy(void* dst, const void* src, uint64_t n, cudaStream_t stream);

}  // namespace sluice::detail::cuda
