// Stream-ordered send/recv of CUDA tensors (SLUICE_TORCH_CUDA_PATH=stream, docs/torch.md): a
// send or recv between GPUs of one host is a kernel on the caller's current stream
// (include/sluice/stream_p2p.hpp), as with NCCL: no host thread takes part once it is queued,
// the Work is complete when the stream gets there, and it can be captured into a CUDA graph.
//
// Set up on a rank's first CUDA send or recv with any peer: it allocates its regions for all
// of its device peers, publishes their handle under a key of the group's Store, and maps a
// peer's regions when it first exchanges with that peer (waiting for that peer's first call,
// at most the group timeout, then failing naming it). Every rank publishes before it waits, so
// ranks that reach their first calls in any order all get through.
//
// As NCCL does, the kernels run on streams of their own, one per peer and direction (from
// torch's stream pool), after the work the caller queued before the call (an event); the
// Work's wait() makes the caller's stream wait for the kernel. So a send and a recv that wait
// for each other across two ranks (both ranks sending first, more than the ring holds) run
// side by side instead of queueing behind one another, and a pair's messages in one direction
// keep their order on their stream, whatever stream each call came from.
//
// The contract is NCCL's: both ranks of a message pass CUDA tensors of the same size and tag,
// and a pair's messages in one direction are matched in the order they were queued. A message
// of another size or tag than its recv expects is not delivered: the group's stream path then
// refuses every further call with what was seen.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "event_pool.hpp"
#include "sluice/error.hpp"

namespace sluice::cuda {
class StreamP2p;
}

namespace sluice::torch_backend {

class StreamP2pLink {
 public:
  // `peers`: the ranks this one has a device endpoint to (the same host, GPUs that share memory).
  StreamP2pLink(c10::intrusive_ptr<c10d::Store> store, int rank, std::vector<int> peers,
                std::chrono::milliseconds timeout);
  ~StreamP2pLink();

  bool reaches(int peer) const;
  // Queue `t` (contiguous CUDA) to / from `peer` after what is queued on `current`; sets up as
  // above. For a recv, `after` (if any) runs next on the kernel's stream, current there (a copy
  // out of `t`). Returns that stream and the event recorded after the call's last work on it.
  // Throws with what went wrong (a failed earlier message, a peer that never came, another GPU).
  struct Queued {
    c10::Stream stream;
    std::shared_ptr<c10::Event> done;
  };
  Queued send(const at::Tensor& t, int peer, uint32_t tag, const c10::Stream& current, bool capturing);
  Queued recv(const at::Tensor& t, int peer, uint32_t tag, const c10::Stream& current, bool capturing,
              const std::function<void()>& after = {});
  void set_timeout(std::chrono::milliseconds timeout);
  // Stops the kernels that wait and leaks the regions (abort() must not wait for the GPU).
  void abandon();
  // Waits for this rank's kernels (each bounded by the timeout).
  void quiesce();
  // "not set up", "on: cuda:N, K peer(s) connected" or the failure.
  std::string state() const;
  uint64_t calls() const;

 private:
  cuda::StreamP2p& ready(int peer, const at::Tensor& t, bool capturing);  // mu_ held
  // The stream of `peer` and direction, waiting for what `current` has queued (mu_ held).
  c10::Stream fork(int peer, bool send, const at::Tensor& t, const c10::Stream& current, bool capturing);
  std::shared_ptr<c10::Event> join(const c10::Stream& s, bool capturing);

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const std::vector<int> peers_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::unique_ptr<cuda::StreamP2p> p2p_;
  std::optional<c10::Device> device_;
  std::map<std::pair<int, bool>, c10::Stream> streams_;
  EventPool events_;
  uint64_t calls_ = 0;
};

}  // namespace sluice::torch_backend
