// The hierarchical AllGather's plan for one rank (issue 14): which shard goes where, in which
// phase. Host-side and pure, so that CI (no GPU) checks the forwarding logic by simulating every
// rank's plan (tests/collective/hier_allgather_plan_test.cpp). The GPU implementation
// (src/cuda/hier_allgather.cu, wired by hier_allgather_wiring.hpp) follows this scheme with the
// intra-node phase as the LL AllGather of each rail block (docs/gpu.md).
//
// Layout: the output is all_gather_into_tensor's, rank-major: shard s (rank s's input) lives at
// byte offset s * shard_bytes of every rank's output. A shard therefore has the same offset on
// the sender and on the receiver, so a step needs one offset.
//
// Scheme (rail-aligned), rank g = (node n, local rank i), N nodes of K ranks:
//   phase 0  copy_input: the input into the own slot g.
//   phase 1  net_send the own shard to (m, i) for every other node m, net_recv shard (m, i) from
//            (m, i); nvl_send the own shard to every local peer (n, j), nvl_recv theirs. Both only
//            read the own slot, so the NVLink part overlaps the network part.
//   phase 2  nvl_send (forward) every shard that arrived over the network to every local peer,
//            nvl_recv the shards the local peers got on their rails.
// Each shard crosses the network once per remote node (K shards per ordered node pair), every
// NIC (rail) carries the same (N-1) shards each way, and rail i stays on rail i, which is what
// rail-optimised fabrics (GPU/NIC i of every node on one leaf switch) are built for. Phase 2 is
// an AllGather among the K local ranks of their rails' N shards each: the LL AllGather over a
// strided layout (shard (m, j) at slot rank_of(m, j)), or per-shard forwarding as shards land.
//
// Step order within a phase is a suggestion (destinations rotate so that nodes do not all send
// to node 0 first); correctness only needs the phase order: a step reads slots filled in earlier
// phases, never one filled in its own.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "collective/topology.hpp"

namespace sluice::detail {

enum class StepKind : uint8_t {
  kCopyInput,  // input[0, bytes) -> own output at offset (peer = shard = own rank)
  kNetSend,    // own output at offset -> peer's output at offset, through a port channel
  kNetRecv,    // wait for peer's kNetSend of this slot
  kNvlSend,    // own output at offset -> peer's output at offset, NVLink (peer on this node)
  kNvlRecv,    // wait for peer's kNvlSend of this slot
};

std::string_view to_string(StepKind kind);

struct Step {
  int phase = 0;
  StepKind kind = StepKind::kCopyInput;
  int peer = 0;   // global rank at the other end (own rank for kCopyInput)
  int shard = 0;  // whose input this is: the output slot
  uint64_t offset = 0;  // shard * shard_bytes, in both outputs
  uint64_t bytes = 0;   // shard_bytes

  bool operator==(const Step&) const = default;
};

struct HierAllGatherPlan {
  int rank = 0;
  int world_size = 0;
  int nodes = 0;
  int ranks_per_node = 0;
  uint64_t shard_bytes = 0;
  std::vector<Step> steps;  // by phase, ascending

  int phases() const { return steps.empty() ? 0 : steps.back().phase + 1; }
  uint64_t net_bytes_sent() const;  // what this rank's NIC sends per call

  // Text, one step per line, so that a plan can be logged, diffed and checked on another machine:
  //   sluice-hier-allgather 1 rank=R world=W nodes=N per_node=K shard_bytes=S steps=C
  //   <phase> <kind> <peer> <shard> <offset> <bytes>      (C lines)
  std::string serialize() const;
  // The inverse; throws kInvalidArgument naming the line that is malformed.
  static HierAllGatherPlan parse(std::string_view text);

  bool operator==(const HierAllGatherPlan&) const = default;
};

// Built once at setup (it allocates); a call then walks `steps`. Throws kOutOfRange for a rank
// outside the topology, kInvalidArgument for shard_bytes 0 or an output above 2^64 bytes.
HierAllGatherPlan plan_hier_allgather(const Topology& topo, int rank, uint64_t shard_bytes);

}  // namespace sluice::detail
