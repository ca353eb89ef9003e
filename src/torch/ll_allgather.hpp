// The low-latency all_gather of CUDA tensors (docs/torch.md, "CUDA tensors"): dist.all_gather and
// dist.all_gather_into_tensor of up to SLUICE_TORCH_LL_ALLGATHER_BYTES per rank (default 1 MiB; 0 turns it off)
// run as one kernel of the engine's intra-node AllGather (include/sluice/allgather.hpp), which
// stores straight into the peers' GPU memory over NVLink, on the caller's current CUDA stream:
// no host synchronisation, ordered like NCCL, capturable in a CUDA graph.
//
// Every rank must take the same path for the same call, or a kernel would spin for a peer that
// never comes. So nothing that decides it is local to one rank:
//  * whether the group can take it at all is agreed through the Store when the group is made
//    (agree()): every rank has a device endpoint (nvlink, same host) to every other rank, the
//    group has 2..8 ranks, and every rank has the same threshold; otherwise no rank takes it;
//  * the AllGather itself is made on the first call that takes the path (ensure()): each rank
//    allocates its buffer and publishes its handle and its GPU's PCI bus id under keys unique
//    per group (the group's own Store) and per object; if any rank failed, or two ranks share
//    a GPU, or any connect() failed, every rank sees it in the Store and all of them fall back
//    to host staging for good; a rank that publishes nothing within the group timeout fails
//    the call on the others, naming it (never a hang);
//  * per call, what decides is what all ranks share by the collective's contract: CUDA tensors,
//    the byte count. Non-contiguous inputs and outputs go through contiguous copies on the
//    stream instead of changing the path.
// Torch-facing but CUDA-header-free: streams and events go through c10's DeviceGuardImplInterface
// (CUDA's is registered by the CUDA torch at run time), the kernel through libsluice.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace sluice::cuda {
class AllGather;
}

namespace sluice::torch_backend {

class LowLatencyAllGather {
 public:
  // On by default since run_cuda.sh's checks of it passed on 2 x H200 (2026-11-28, 757 CUDA
  // checks per rank, bit-equal to NCCL; 1.14-1.44x NCCL's speed from 8 B to 512 KiB, docs/torch.md).
  static constexpr uint64_t kDefaultMaxBytes = uint64_t(1) << 20;
  static constexpr int kMaxWorld = 8;  // the AllGather's limit

  // Agrees with the other ranks through `store`, before `deadline`, whether the group takes the
  // path. `local_off` is "" when this rank could (a device endpoint to every peer, ...),
  // otherwise why not. `publish`: this rank takes part in the agreement at all (it runs the
  // nvlink transport; a rank that does not cannot have device endpoints, so no rank that could
  // take the path waits for it). Throws on a Store timeout, naming the missing ranks.
  LowLatencyAllGather(c10::intrusive_ptr<c10d::Store> store, int rank, int size, uint64_t max_bytes,
                      const std::string& local_off, bool publish, std::chrono::steady_clock::time_point deadline);
  ~LowLatencyAllGather();

  // The group takes the path for calls of at most max_bytes() per rank (until a failed set-up
  // turns it off on every rank).
  bool on() const;
  uint64_t max_bytes() const { return max_bytes_; }

  // Sets the AllGather up on `device` if it is not yet (a Store round trip with every rank, all
  // ranks at the same call). False when the group falls back to host staging (set up failed
  // somewhere: every rank returns false for the same call). Throws for a call on another
  // device than the first one's, during a CUDA graph capture of the first call, and when a
  // rank does not answer within `timeout`.
  bool ensure(c10::Device device, std::chrono::milliseconds timeout);

  // out[j * bytes ...] = rank j's `in` (bytes each), on `stream` (ensure() returned true). The
  // launch is ordered after the previous one even on another stream (an event wait), except
  // across the start or end of a graph capture (torch.cuda.graph synchronises the device
  // before capturing).
  void launch(const void* in, void* out, uint64_t bytes, const c10::Stream& stream, bool capturing);
  // The event recorded after the call's last work on `stream` (the Work's, and the next launch
  // on another stream waits for it).
  void note_done(std::shared_ptr<c10::Event> done, const c10::Stream& stream, bool capturing);

  // Leaks the AllGather (its destructor waits for this rank's kernels): abort() must not wait
  // for a kernel that spins for a peer that is gone.
  void abandon();

  // Calls that ran the kernel (0-byte calls run none), for tests and tools.
  uint64_t calls() const { return calls_.load(); }
  void count() { calls_.fetch_add(1); }
  // "on (not set up yet)", "on: cuda:1, up to N bytes per rank" or "off: why".
  std::string state() const;

 private:
  // Waits for `keys` (one per rank) at most `timeout` and returns their values.
  std::vector<std::string> gather(const std::string& prefix, std::chrono::milliseconds timeout, const char* what);
  void turn_off(std::string why);

  c10::intrusive_ptr<c10d::Store> store_;
  const int rank_, size_;
  const uint64_t max_bytes_;
  mutable std::mutex mu_;
  std::string off_;  // why the group does not take the path ("" = it does)
  std::unique_ptr<cuda::AllGather> ag_;
  std::optional<c10::Device> device_;
  uint64_t objects_ = 0;  // AllGathers set up (key names)
  std::shared_ptr<c10::Event> last_;
  std::optional<c10::Stream> last_stream_;
  bool last_captured_ = false;
  std::atomic<uint64_t> calls_{0};
};

// The PCI bus id of CUDA device `ordinal` as the driver names it ("" if unknown), through
// libcuda loaded at run time (no CUDA headers here).
std::string gpu_bus_id(int ordinal);

}  // namespace sluice::torch_backend
