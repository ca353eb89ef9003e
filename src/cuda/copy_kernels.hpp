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

// Loads the kernels above into the current device's context now. Under CUDA's lazy loading
// (the default since 12.x) the first launch of a kernel loads it, and loading waits for the
// kernels already running on the device: a user kernel spinning on a semaphore that our
// signal kernel would raise (a port channel's wait()) then deadlocks until it times out.
// Called where device memory is registered or allocated (load_kernels_on: once per device,
// before the user's kernels run there) and where a stream that launches them is created.
cudaError_t load_kernels();
cudaError_t load_kernels_on(int device);

}  // namespace sluice::detail::cuda
