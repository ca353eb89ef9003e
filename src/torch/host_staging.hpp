// CUDA tensors on the sluice backend, through host memory. The backend's messages move host
// memory (the engine's shm and tcp paths). A CUDA tensor an operation reads is copied to the
// host on the calling thread: a blocking copy, so it comes after the work already queued on
// the caller's current stream, as gloo stages CUDA tensors. The operation then runs, unchanged,
// on host copies; what it wrote is copied back (blocking) before its Work completes, so
// anything the caller launches after wait() (on any stream) sees the result. Correct first:
// the device-to-device path (nvlink, GPU memory registered with the engine) is later work.
#pragma once

#include <chrono>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace sluice::torch_backend {

bool any_cuda(const std::vector<at::Tensor>& ts);
bool any_cuda(const std::vector<std::vector<at::Tensor>>& ts);

class HostStaging {
 public:
  // Host tensors standing in for `t` (CPU tensors stand for themselves): one the operation
  // only reads, one it reads and writes, one it only writes.
  at::Tensor input(const at::Tensor& t);
  at::Tensor inout(const at::Tensor& t);
  at::Tensor output(const at::Tensor& t);
  std::vector<at::Tensor> inputs(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> inouts(const std::vector<at::Tensor>& ts);
  std::vector<at::Tensor> outputs(const std::vector<at::Tensor>& ts);
  std::vector<std::vector<at::Tensor>> inputs(const std::vector<std::vector<at::Tensor>>& ts);
  std::vector<std::vector<at::Tensor>> outputs(const std::vector<std::vector<at::Tensor>>& ts);

  // The Work handed to torch for `inner`, the operation on the host copies: it completes once
  // `inner` did and the written copies are back in the CUDA tensors; its result is `result`
  // (the caller's tensors). `recv`: report the sender's rank (sourceRank()).
  c10::intrusive_ptr<c10d::Work> wrap(const c10::intrusive_ptr<c10d::Work>& inner, c10d::OpType type,
                                      std::vector<at::Tensor> result, std::chrono::milliseconds timeout, int rank,
                                      bool recv = false);

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (CUDA tensor, host copy to copy in)
};

}  // namespace sluice::torch_backend
