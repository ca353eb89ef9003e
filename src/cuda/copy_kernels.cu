#include "cuda/copy_kernels.hpp"

#include "cuda/post_batch_kernel.hpp"

#include <mutex>
#include <set>

namespace sluice::detail::cuda {
namespace {

__global__ void copy16(uint4* __restrict__ dst, const uint4* __restrict__ src, uint64_t n16) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n16; i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void copy1(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

__global__ void add_u64(unsigned long long* counter, unsigned long long add) {
  // Orders this thread's view of what ran before it on the stream (the copies ahead of the
  // signal are complete when the kernel starts) before the add, for any observer.
  __threadfence_system();
  atomicAdd_system(counter, add);
}

}  // namespace

cudaError_t signal_add(uint64_t* counter, uint64_t add, cudaStream_t stream) {
  add_u64<<<1, 1, 0, stream>>>(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(add));
  return cudaGetLastError();
}

cudaError_t load_kernels() {
  // cudaFuncGetAttributes loads a lazily loaded kernel (CUDA programming guide, Lazy Loading).
  cudaFuncAttributes a;
  for (const void* f : {reinterpret_cast<const void*>(&add_u64), reinterpret_cast<const void*>(&copy16),
                        reinterpret_cast<const void*>(&copy1), post_batch_kernel()})
    if (cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
  return cudaSuccess;
}

cudaError_t load_kernels_on(int device) {
  static std::mutex mu;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> lk(mu);
  if (loaded.count(device)) return cudaSuccess;
  int prev = -1;
  if (cudaError_t e = cudaGetDevice(&prev); e != cudaSuccess) return e;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = load_kernels();
  cudaSetDevice(prev);
  if (e == cudaSuccess) loaded.insert(device);
  return e;
}

cudaError_t sm_copy(void* dst, const void* src, uint64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int threads = 512;
  auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (((d | s) & 15) == 0) {
    uint64_t n16 = n / 16;
    if (n16) {
      unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n16 + threads - 1) / threads, 64));
      copy16<<<blocks, threads, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), n16);
    }
    uint64_t tail = n - n16 * 16;
    if (tail) copy1<<<1, 32, 0, stream>>>(static_cast<uint8_t*>(dst) + n16 * 16, static_cast<const uint8_t*>(src) + n16 * 16, tail);
  } else {
    unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + threads - 1) / threads, 64));
    copy1<<<blocks, threads, 0, stream>>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), n);
  }
  return cudaGetLastError();
}

}  // namespace sluice::detail::cuda
