// Hierarchical AllGather across nodes (issue 14; CUDA builds; throws kNoDevice without a GPU
// or in a build without CUDA).
//
// World = N nodes x K ranks; rank g = (node n, local rank i); every rank contributes `bytes`;
// out is rank-major, as torch's all_gather_into_tensor. One object per rank, built with the
// largest per-rank message; construction allocates everything a call uses (no allocation per
// call). Exchange handle() strings (any bootstrap), pass all of them to connect(), then call
// all_gather_bytes() as often as needed, eagerly or captured into a CUDA graph. Every rank must
// issue the same sequence of calls with the same sizes, ordered on one stream (or by events).
//
// Per call, on the caller's stream:
//   1. credit  (1 warp)    from the second call on: wait for a credit from every remote rail
//                           peer (m, i): it has consumed what we put into its rail last call.
//   2. stage   (grid)      input -> own rail slot n (pinned host rail region, registered with
//                           this rank's engine) and -> own slot of `mine` (device, N x S).
//   3. exchange (1 warp)    for every remote node m: put_with_signal of the own shard into
//                           (m, i)'s rail slot n through a port channel (proxy -> rdma or tcp);
//                           then wait for (m, i)'s data signal, for every m.
//   4. collect (grid)      rail slots m != n -> mine; the last block to finish signals a
//                           credit to every rail peer (our rail is free for their next put).
//   5. intra-node           K > 1: the LL AllGather (allgather.hpp) among the K local ranks,
//                           N x S bytes each: mine -> scratch [K][N] shards.
//   6. permute (grid)      scratch block (j, m) -> out slot rank_of(m, j) (K = 1: mine).
// Each shard crosses the network once per remote node; local peers forward it over NVLink.
//
// Why the credit: a rail peer may start call k+1 while we still read our rail for call k. It
// puts only after our credit for call k, and we stage our own shard (the put's source) only
// after every peer's credit for call k, i.e. after each peer consumed call k's put. Waits keep
// their count in device memory (PortChannelDeviceHandle::wait), and "is this the first call"
// is a device counter, so graph replays need no host state.
//
// Failures never hang: every wait is bounded by options.timeout (and returns at once when the
// proxy finds the peer lost). A kernel that sees a failure writes it into a status word in
// mapped host memory and the later kernels skip the network steps; all_gather_bytes() throws
// the stored error on the next call, and check() / status() report it at any time (after a
// stream synchronize for a call just issued). After an error the object cannot be reused.
// The intra-node phase (K > 1) is the LL AllGather with its spins bounded by the same timeout
// (AllGather::set_timeout). A rank whose own steps all succeeded cannot tell that another rank
// failed in the same call: until it reports an error itself (its next wait for the failed
// rank's credit or data times out, within about two timeouts) its outputs may be incomplete.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sluice/error.hpp"
#include "sluice/export.hpp"

namespace sluice::cuda {

struct HierAllGatherOptions {
  // Inter-node transport: "tcp", "rdma", or "" (rdma if this host's engine runs it, else tcp).
  std::string transport;
  // Bound of every wait inside the kernels (credits, data signals, FIFO pushes).
  std::chrono::milliseconds timeout{10000};
  // Proxy worker threads (each owns a FIFO).
  int proxy_workers = 1;
};

class SLUICE_API HierAllGather {
 public:
  // node_of_rank[r]: any label of rank r's node (Topology::from_node_ids rules: equal-sized
  // nodes, at most 8 ranks each). All ranks one node each = the forced inter-node path.
  // One rank per GPU per process: a second live rank on `device` in this process is refused
  // (kInvalidArgument). Its kernels would wait for the other's, and CUDA does not promise that
  // kernels of two streams run at the same time (streams share the device's hardware queues):
  // two ranks on one GPU deadlocked until the timeout about once in 80 calls on 2 x H200, and
  // every time with CUDA_DEVICE_MAX_CONNECTIONS=1. NCCL refuses the same ("Duplicate GPU").
  HierAllGather(uint64_t max_bytes_per_rank, int world_size, int rank, int device, const std::vector<int>& node_of_rank,
                HierAllGatherOptions options = {});
  ~HierAllGather();
  HierAllGather(const HierAllGather&) = delete;
  HierAllGather& operator=(const HierAllGather&) = delete;

  std::string handle() const;
  // handles[r] = rank r's handle(). Checked before use (hier_allgather_wiring.hpp); connects to
  // every remote rail peer and opens the intra-node AllGather. Collective: every rank calls it.
  void connect(const std::vector<std::string>& handles);

  // out[r * bytes, (r + 1) * bytes) = rank r's in[0, bytes). `stream` is a cudaStream_t.
  // Throws the stored error of an earlier call first.
  void all_gather_bytes(const void* in, void* out, uint64_t bytes, void* stream);

  // Ok, or the first failure seen (a kernel's timeout / lost peer, a failed channel).
  Status status() const;
  void check() const;  // throws status() if not ok

  uint64_t max_bytes() const;
  int world_size() const;
  int rank() const;
  int nodes() const;
  int ranks_per_node() const;
  std::string transport() const;  // the inter-node transport in use ("" before connect)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sluice::cuda
