#include "port_channel/shared_block.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#ifdef SLUICE_HAVE_CUDA
#include "cuda/cuda_util.hpp"
#endif

namespace sluice::detail {
namespace {

void* host_zeroed(size_t bytes) {
  // 64-byte alignment: FIFO slots and channel states are cache lines.
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw Error(ErrorCode::kSystem, "port channel: cannot allocate " + std::to_string(bytes) + " bytes");
  std::memset(p, 0, rounded);
  return p;
}

#ifndef SLUICE_HAVE_CUDA
[[noreturn]] void no_cuda() {
  throw Error(ErrorCode::kNoDevice,
              "port channel: ProducerKind::kCuda needs libsluice built with CUDA (this build has none)");
}
#endif

}  // namespace

SharedBlock::SharedBlock(size_t bytes, ProducerKind kind, int device) : kind_(kind) {
  if (kind == ProducerKind::kHost) {
    host_ = producer_ = host_zeroed(bytes);
    return;
  }
#ifdef SLUICE_HAVE_CUDA
  cuda::require_device(device, "port channel FIFO");
  cuda::check(cudaSetDevice(device), "cudaSetDevice (port channel)");
  cuda::check(cudaHostAlloc(&host_, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc (port channel FIFO)");
  std::memset(host_, 0, bytes);
  cudaError_t err = cudaHostGetDevicePointer(&producer_, host_, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host_);
    cuda::check(err, "cudaHostGetDevicePointer (port channel FIFO)");
  }
#else
  (void)device;
  no_cuda();
#endif
}

SharedBlock::~SharedBlock() {
  if (kind_ == ProducerKind::kHost) {
    std::free(host_);
    return;
  }
#ifdef SLUICE_HAVE_CUDA
  if (host_) cudaFreeHost(host_);
#endif
}

ProducerBlock::ProducerBlock(size_t bytes, ProducerKind kind, int device) : kind_(kind) {
  if (kind == ProducerKind::kHost) {
    ptr_ = host_zeroed(bytes);
    return;
  }
#ifdef SLUICE_HAVE_CUDA
  cuda::require_device(device, "port channel counters");
  cuda::check(cudaSetDevice(device), "cudaSetDevice (port channel)");
  cuda::check(cudaMalloc(&ptr_, bytes), "cudaMalloc (port channel counters)");
  cudaError_t err = cudaMemset(ptr_, 0, bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(ptr_);
    cuda::check(err, "cudaMemset (port channel counters)");
  }
#else
  (void)device;
  no_cuda();
#endif
}

ProducerBlock::~ProducerBlock() {
  if (kind_ == ProducerKind::kHost) {
    std::free(ptr_);
    return;
  }
#ifdef SLUICE_HAVE_CUDA
  if (ptr_) cudaFree(ptr_);
#endif
}

}  // namespace sluice::detail
