// The torch.distributed backend "sluice" (CPU tensors; CUDA tensors through host copies, see
// host_staging.hpp, except large send/recv between GPUs of a host and small all_gathers, see
// ll_allgather.hpp): a c10d::Backend whose point-to-point
// operations go through a Mailbox over one engine endpoint per peer, and whose collectives
// are direct algorithms over those messages, run in call order on one worker thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cuda_registrations.hpp"
#include "event_pool.hpp"
#include "ll_allgather.hpp"
#include "stream_p2p_link.hpp"
#include "mailbox.hpp"
#include "trace.hpp"
#include "sluice/engine.hpp"

namespace sluice::torch_backend {

class SluiceWork;

class SluiceBackend final : public c10d::Backend {
 public:
  // Bootstraps through `store`: publishes this rank's engine info there and opens one
  // endpoint to every other rank. The transport comes from EngineConfig (SLUICE_TRANSPORTS)
  // or SLUICE_TORCH_TRANSPORT ("shm", "tcp"), which forces it for every endpoint.
  SluiceBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout);
  ~SluiceBackend() override;

  const std::string getBackendName() const override { return "sluice"; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  // Like shutdown(), but never waits for the GPU: a low-latency all_gather kernel may be
  // spinning for a peer that is gone, so its buffer is left to the process's end.
  void abort() override;
  // The transport the endpoints run ("" for a world of one).
  std::string transport() const;
  // How large CUDA tensors move between ranks: "nvlink" (directly between GPUs, to the peers
  // a device endpoint reaches) or "host" (through host memory).
  std::string cuda_path() const;
  // The stream path of CUDA send/recv (SLUICE_TORCH_CUDA_PATH=stream, stream_p2p_link.hpp):
  // its state and the calls that took it.
  std::string stream_p2p_state() const;
  uint64_t stream_p2p_calls() const;
  // The low-latency all_gather of CUDA tensors (ll_allgather.hpp): the calls that took it, and
  // its state ("on ...", "off: why").
  uint64_t ll_allgather_calls() const;
  // all_reduce calls on CUDA tensors that ran through the low-latency AllGather.
  uint64_t ll_allreduce_calls() const { return ll_allreduce_calls_.load(std::memory_order_relaxed); }
  // Collective calls on CUDA tensors that took the device path (exchange_device).
  uint64_t device_collective_calls() const { return device_calls_.load(std::memory_order_relaxed); }
  // Ready-to-receive counts of this rank's mailbox (mailbox.hpp): offered, used, voided.
  Mailbox::RtrStats recv_ready_stats() const { return mailbox_->rtr_stats(); }
  std::string ll_allgather_state() const;

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;

  // Used by the collectives (collectives.cpp): blocking exchange of contiguous CPU buffers
  // with an internal tag, bounded by the group timeout.
  struct Xfer {
    bool is_send;
    int peer;
    void* ptr;
    uint64_t n;
    // CUDA memory the caller registered (the device path; n >= the mailbox's rndv_bytes and a
    // device endpoint to `peer`): its registration and ptr's offset in it.
    bool device = false;
    MemoryHandle handle{};
    uint64_t offset = 0;
  };
  void exchange(uint64_t tag, const std::vector<Xfer>& xfers);
  // A byte buffer of at least `bytes` for the collectives' received parts, kept across calls
  // and grown on demand (a fresh tensor per peer per call meant, for large tensors, a fresh
  // mmap each time: page faults and zeroing). Worker thread only; valid until the next call.
  at::Tensor scratch(uint64_t bytes);
  int rank() const { return getRank(); }
  int size() const { return getSize(); }

 private:
  using Body = std::function<void(uint64_t tag)>;
  // Queues a collective: `body` runs on the worker thread with the collective's tag base;
  // the Work completes (with `outputs` as its result) when it returns or throws.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, Body body);
  void worker();
  // The device path of send / recv: null when this tensor or peer cannot take it (the caller
  // then stages the tensor through host memory).
  c10::intrusive_ptr<c10d::Work> send_device(const at::Tensor& t, int dst, int tag);
  // The stream path (stream_p2p_link.hpp): null when it is off or does not reach the peer.
  c10::intrusive_ptr<c10d::Work> send_stream(const at::Tensor& t, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv_stream(const at::Tensor& t, int src, int tag);
  c10::intrusive_ptr<c10d::Work> recv_device(const at::Tensor& t, int src, int tag);
  void say_goodbye();  // shutdown(): quiesce every endpoint before closing it
  // all_gather (`into_one` false: one output per rank) or all_gather_into_tensor (`outs` is the
  // one output) of CUDA tensors through the low-latency AllGather on the current stream; null
  // when the call does not take that path (the caller then stages through host memory).
  c10::intrusive_ptr<c10d::Work> allgather_ll(c10d::OpType type, const at::Tensor& in, const std::vector<at::Tensor>& outs,
                                              bool into_one);
  // all_reduce of one CUDA tensor of up to the low-latency threshold, on the caller's stream:
  // the low-latency AllGather of every rank's tensor, then the rank-ordered reduction there
  // (device_reductions.cpp). Null when the call does not take that path.
  c10::intrusive_ptr<c10d::Work> allreduce_ll(const at::Tensor& t, c10d::ReduceOp::RedOpType op);
  // The low-latency calls' pieces: the caller's current stream on `device` and whether it is
  // being captured; ensure() with its errors as the op's (false: every rank falls back at this
  // call); the Work, an event on the stream (`launched`: the next launch orders after it).
  struct LlStream {
    c10::Stream stream;
    bool capturing;
  };
  LlStream ll_stream(c10::Device device) const;
  bool ll_ready(c10::Device device, c10d::OpType type);
  c10::intrusive_ptr<c10d::Work> ll_finish(c10d::OpType type, const std::vector<at::Tensor>& outs, const LlStream& ls,
                                           bool launched = true);
  // all_gather_into_tensor of CUDA tensors by the device path (SLUICE_TORCH_DEVICE_COLLECTIVES=1):
  // every part goes GPU to GPU over the device endpoints, by rendezvous; null when the call
  // cannot take it (the caller then stages through host memory).
  c10::intrusive_ptr<c10d::Work> allgather_device(const at::Tensor& output, const at::Tensor& input);
  // The device path's collective step (SLUICE_TORCH_DEVICE_COLLECTIVES=1): `sends` from `in`,
  // `recvs` into `out` (contiguous CUDA tensors of one device, possibly the same one; offsets in
  // bytes), every message empty or of at least the rendezvous size to a peer with a device
  // endpoint. `local` (may be empty) moves this rank's own part on the caller's stream first.
  // The Work's result is `out`. Null when the call cannot take the path (the caller stages).
  struct DevMsg {
    int peer;
    uint64_t offset;
    uint64_t bytes;
  };
  c10::intrusive_ptr<c10d::Work> exchange_device(c10d::OpType type, const at::Tensor& in, const at::Tensor& out,
                                                 const std::vector<DevMsg>& sends,
                                                 const std::vector<DevMsg>& recvs, const std::function<void()>& local);
  // Whether every non-empty message can go GPU to GPU (at least the rendezvous size, to a peer
  // with a device endpoint): what both ranks of each message see alike.
  bool device_messages(const std::vector<DevMsg>& msgs) const;
  static bool moves_bytes(const std::vector<DevMsg>& msgs);
  // all_reduce (one tensor, in place) and reduce_scatter_tensor of CUDA tensors by the device
  // path (device_reductions.cpp): the host algorithms' messages, GPU to GPU, and their
  // rank-ordered reduction on the GPU. Null when the call cannot take it (the caller stages).
  c10::intrusive_ptr<c10d::Work> allreduce_device(const at::Tensor& t, c10d::ReduceOp::RedOpType op);
  c10::intrusive_ptr<c10d::Work> reduce_scatter_device(const at::Tensor& output, const at::Tensor& input,
                                                       c10d::ReduceOp::RedOpType op);
  // Device-path registrations of `a` and `b`, both held until `hold` goes; nullopt (nothing
  // held) after logging why the call goes through host memory instead.
  struct HeldLeases {
    CudaRegistrations::Lease a, b;
    std::shared_ptr<void> hold;
  };
  std::optional<HeldLeases> device_leases(const at::Tensor& a, const at::Tensor& b);

  std::chrono::milliseconds timeout_;
  std::unique_ptr<Trace> trace_;  // SLUICE_TORCH_TRACE (trace.hpp); outlives the mailbox and the engine
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Mailbox> mailbox_;
  std::string transport_;
  std::string cuda_path_ = "host";
  std::unique_ptr<CudaRegistrations> cuda_regs_;  // the device path's registrations
  bool device_collectives_ = false;               // SLUICE_TORCH_DEVICE_COLLECTIVES
  std::atomic<uint64_t> device_calls_{0};
  std::atomic<uint64_t> ll_allreduce_calls_{0};
  std::unique_ptr<LowLatencyAllGather> ll_;       // null for a world of one
  std::unique_ptr<StreamP2pLink> stream_p2p_;     // SLUICE_TORCH_CUDA_PATH=stream, else null
  EventPool events_;                              // the stream-ordered Works' events
  uint64_t seq_ = 0;  // collectives issued (same order on every rank)
  at::Tensor scratch_;  // see scratch()

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

// Waits for the caller's current stream on t's device: the device path's copies run on the
// engine's own streams, so what the caller queued before the op must be done first (the
// stream, not the device, as gloo's blocking copies do).
void sync_current_stream(const at::Tensor& t);

}  // namespace sluice::torch_backend
