// The Work that the sluice backend hands to torch: completes once, carries the exception of a
// failed operation, waits with the group timeout, and exposes a c10 Future of its outputs.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include <memory>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "progress_queue.hpp"
#include "trace.hpp"

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
  // wait() records its start and end there (trace.hpp), `peer` naming the op's peer rank.
  void set_trace(Trace* t, int peer) {
    trace_ = t;
    trace_peer_ = peer;
  }
  // A Work the mailbox completes (send, recv): wait() runs the mailbox's progress tasks while
  // it waits (ProgressQueue::drive_until), so its completion costs no hop through another
  // thread. Set before the op is handed to the mailbox.
  void drive_with(std::shared_ptr<ProgressQueue> q) { queue_ = std::move(q); }
  const std::shared_ptr<ProgressQueue>& progress_queue() const { return queue_; }

 private:
  std::vector<at::Tensor> outputs_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int source_ = -1;
  std::string peer_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<ProgressQueue> queue_;
  Trace* trace_ = nullptr;
  int trace_peer_ = -1;
};

// The Work of an op queued on the caller's CUDA stream (the low-latency all_gather,
// ll_allgather.hpp), with NCCL's semantics for such work: nothing waits on the host.
//  * wait() / synchronize(): the caller's current stream waits for the op (an event wait, none
//    when that is the op's own stream); returns at once.
//  * isCompleted(): whether the GPU has finished it (the event, queried; a Work made during a
//    graph capture reads as completed, since its work runs at each replay instead).
//  * getFuture(): completed with the outputs, as a CUDA future (its devices set): a then()
//    callback runs at once on the host, and its value() and wait() make the current stream wait
//    for the op, as c10's Future does for CUDA values. Made on the first getFuture() (a
//    synchronous collective never asks for it, and completing a CUDA future records an event),
//    then completed with the op's stream current, so its event follows the op; made at once for
//    a Work made inside a capture, whose stream is the capture's only then.
class StreamWork final : public c10d::Work {
 public:
  // `done` was recorded on `stream` after the op's last work there.
  StreamWork(c10d::OpType type, std::vector<at::Tensor> outputs, c10::Stream stream, std::shared_ptr<c10::Event> done,
             bool captured, int rank);

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void make_future();  // with future_mu_ held
  std::vector<at::Tensor> outputs_;
  c10::Stream stream_;
  std::shared_ptr<c10::Event> done_;
  bool captured_;
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made by getFuture() (above)
};

}  // namespace sluice::torch_backend
