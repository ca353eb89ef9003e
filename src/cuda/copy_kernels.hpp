// SM (kernel) copies: for small messages a kernel's NVLink stores finish sooner than a
// copy-engine job.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sluice::detail::cuda {

// dst and src are device-accessible (local or peer-mapped) addresses.
cudaError_t sm_copy(void* dst, const void* src, uint64_t n, cudaStream_t stream);

// One thread adds `add` to the 64-bit counter at `counter` (device-accessible, 8-byte aligned,
// possibly a peer's memory mapped here) with a system-scope atomic, after everything queued
// on `stream` before it: the thin post path's signal (nvlink post_signal).
cudaError_t signal_add(uint64_t* counter, uint64_t add, cudaStream_t stream);

}  // namespace sluice::detail::cuda
