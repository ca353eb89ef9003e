// The nvlink thin post path's batch kernel: a run of small writes (SM copies) and the
// signals after them in ONE launch, instead of a copy-engine job per write plus a signal
// kernel per signal (about 11 us a put+signal on H200, docs/port-channel.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sluice::detail::cuda {

struct BatchCopy {
  const void* src;  // device-accessible on the launching device
  void* dst;        // local or peer-mapped device memory
  uint64_t n;
};
struct BatchSignal {
  uint64_t* counter;  // 8-byte aligned, device-accessible (a peer's memory mapped here)
  uint64_t add;
};

// Passed by value (kernel parameters, under the 4 KiB limit): no staging copy, no allocation
// per launch. A run longer than this is launched as several kernels, in order.
constexpr uint32_t kBatchCopies = 96;
constexpr uint32_t kBatchSignals = 64;
struct BatchArgs {
  uint32_t copies = 0;
  uint32_t signals = 0;
  BatchCopy copy[kBatchCopies];
  BatchSignal signal[kBatchSignals];
};
static_assert(sizeof(BatchArgs) <= 4000, "kernel parameters are limited to 4 KiB");

// Every copy, then (once every copy of every block is visible system-wide) every signal.
// A signal is raised after ALL the launch's copies, never only those before it: later is
// allowed (the contract is "never before"), and it needs one grid-wide arrival only.
// `arrivals`: a zeroed device counter owned by `stream` (launches on one stream never
// overlap; the last block resets it; unused by a one-block launch). Copies and signals on
// `stream` before this launch are complete before it starts (stream order). `done` (may be
// null): a word the host reads (cuda_util's take_mapped_word); the launch's last act is to
// store `seq` there with release order, after every copy and signal is visible.
cudaError_t post_batch(const BatchArgs& args, unsigned* arrivals, uint64_t* done, uint64_t seq, cudaStream_t stream);

// The blocks post_batch launches for `copies` copies (the tests check the bound).
unsigned post_batch_blocks(uint32_t copies);

// For load_kernels(): the kernel's address.
const void* post_batch_kernel();

}  // namespace sluice::detail::cuda
