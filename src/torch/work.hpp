// The Work that the sluice backend hands to torch: completes once, carries the exception of a
// failed operation, waits with the group timeout, and exposes a c10 Future of its outputs.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace sluice::torch_backend {

// A DistBackendError carrying `message` (what torch.distributed raises for backend failures).
std::exception_ptr backend_error(const std::string& message);

class SluiceWork final : public c10d::Work {
 public:
  SluiceWork(c10d::OpType type, std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout, int rank);

  // Called once, from the thread that finished the operation. `source` is the sender of a
  // received message (recv from any source).
  void complete(std::exception_ptr error, int source = -1);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  // Named in the error of a wait() that times out, e.g. "peer rank 2" for a point-to-point op.
  void set_peer(std::string peer) { peer_ = std::move(peer); }

 private:
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int source_ = -1;
  std::string peer_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace sluice::torch_backend
