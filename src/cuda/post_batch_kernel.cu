#include "cuda/post_batch_kernel.hpp"

#include <algorithm>

#include "cuda/device_sync.cuh"

namespace sluice::detail::cuda {
namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kMaxBlocks = 32;

// One copy by the whole block, in the widest word both ends are aligned to.
template <class W>
__device__ void copy_words(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const uint64_t words = n / sizeof(W);
  for (uint64_t i = threadIdx.x; i < words; i += blockDim.x)
    reinterpret_cast<W*>(dst)[i] = reinterpret_cast<const W*>(src)[i];
  for (uint64_t i = words * sizeof(W) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__device__ void copy_one(const BatchCopy& c) {
  auto* dst = static_cast<uint8_t*>(c.dst);
  auto* src = static_cast<const uint8_t*>(c.src);
  const auto align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  if ((align & 15) == 0)
    copy_words<uint4>(dst, src, c.n);
  else if ((align & 7) == 0)
    copy_words<uint64_t>(dst, src, c.n);
  else if ((align & 3) == 0)
    copy_words<uint32_t>(dst, src, c.n);
  else
    copy_words<uint8_t>(dst, src, c.n);
}

__global__ void __launch_bounds__(kThreads) batch_kernel(BatchArgs a, unsigned* arrivals, uint64_t* done, uint64_t seq) {
  for (uint32_t i = blockIdx.x; i < a.copies; i += gridDim.x) copy_one(a.copy[i]);
  // Every thread's stores are ordered before its block's arrival, for every observer (the
  // peer's GPU reading its own memory, the host): the barrier orders them before thread 0, and
  // thread 0's system-scope fence, being cumulative, orders them before the arrival. (A fence
  // by every thread costs far more: system-scope fences serialize across the GPU, about 17 us
  // per 512 threads measured on H200 in the hierarchical AllGather's copy kernels.)
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  if (gridDim.x > 1 && atomicAdd(arrivals, 1u) != gridDim.x - 1) return;
  // The last block to arrive has seen every block's arrival: after this fence, any observer
  // of a signal (or of `done`) also observes every copy of the launch.
  __threadfence_system();
  if (gridDim.x > 1) *arrivals = 0;  // for the next launch on this stream (launches on one stream never overlap)
  for (uint32_t i = 0; i < a.signals; ++i)
    atomicAdd_system(reinterpret_cast<unsigned long long*>(a.signal[i].counter),
                     static_cast<unsigned long long>(a.signal[i].add));
  // The launch is done: the host's poller completes its posts when it reads `seq` here,
  // without a CUDA call (release: after every copy and signal above).
  if (done) ::sluice::cuda::dev::st_release64(done, seq);
}

}  // namespace

unsigned post_batch_blocks(uint32_t copies) { return std::clamp<unsigned>(copies, 1, kMaxBlocks); }

cudaError_t post_batch(const BatchArgs& args, unsigned* arrivals, uint64_t* done, uint64_t seq, cudaStream_t stream) {
  if (args.copies == 0 && args.signals == 0) return cudaSuccess;
  batch_kernel<<<post_batch_blocks(args.copies), kThreads, 0, stream>>>(args, arrivals, done, seq);
  return cudaGetLastError();
}

const void* post_batch_kernel() { return reinterpret_cast<const void*>(&batch_kernel); }

}  // namespace sluice::detail::cuda
