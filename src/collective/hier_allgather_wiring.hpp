// The hierarchical AllGather's host-side wiring (issue 14, GPU half): what one rank's handle
// says, how a peer's handle is checked, and which rail peers, semaphores, offsets and output
// slots the kernels of src/cuda/hier_allgather.cu use. Pure C++ (no CUDA, no sockets), so that
// CI checks it without a GPU (tests/collective/hier_allgather_wiring_test.cpp).
//
// Rank g = (node n, local rank i) of N nodes x K ranks. Its *rail region* (registered with its
// engine, pinned host memory mapped into the GPU) is
//   [slot 0 | slot 1 | ... | slot N-1]   N x max_bytes: during a call of S bytes per rank, slot m
//                                         holds rail peer (m, i)'s shard at offset m * S
//   [data_sem[0..N)]                      8 bytes each: raised by (m, i)'s put_with_signal
//   [credit_sem[0..N)]                    8 bytes each: raised by (m, i) once it has consumed
//                                         its rail slots of the previous call
// Packing slots at m * S (not m * max_bytes) keeps the N shards of a call contiguous, so the
// intra-node phase reads them as one block of N x S bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "collective/topology.hpp"

namespace sluice::detail {

// What handle() publishes: text, one line,
//   sluice-hier-allgather 1 world=W rank=R node=N local=L max_bytes=B rail_bytes=T info=<hex> ag=<hex|->
// `info` is the engine's local_info() (the peer connects to it and finds the rail region by
// name), `ag` the intra-node AllGather's handle ("-" when K = 1).
struct HierHandle {
  int world = 0;
  int rank = 0;
  int node = 0;
  int local_rank = 0;
  uint64_t max_bytes = 0;
  uint64_t rail_bytes = 0;
  std::string engine_info;
  std::string ag_handle;  // empty when there is no intra-node phase

  std::string encode() const;
  // Throws kInvalidArgument naming the field that is malformed (never reads past `text`).
  static HierHandle parse(std::string_view text);
};

// The rail region's layout for N nodes and a per-rank maximum.
struct RailLayout {
  int nodes = 0;
  uint64_t max_bytes = 0;
  uint64_t sem_base = 0;  // data_sem[0]
  uint64_t bytes = 0;     // the whole region (a multiple of 4096)

  uint64_t slot_offset(int node, uint64_t shard_bytes) const { return uint64_t(node) * shard_bytes; }
  uint64_t data_sem(int node) const { return sem_base + 8ull * uint64_t(node); }
  uint64_t credit_sem(int node) const { return sem_base + 8ull * (uint64_t(nodes) + uint64_t(node)); }
};
// Throws kInvalidArgument for max_bytes 0 or a region above 2^62 bytes.
RailLayout rail_layout(int nodes, uint64_t max_bytes);

// One remote rail peer (m, i) of this rank, m != n.
struct RailPeer {
  int node = 0;        // m
  int rank = 0;        // rank_of(m, i)
  // This rank's put goes to the peer's slot n; its signal raises the peer's data_sem[n]; the
  // peer's signals raise our data_sem[m] / credit_sem[m].
  uint64_t remote_data_sem = 0;    // in the peer's region: data_sem[n]
  uint64_t remote_credit_sem = 0;  // in the peer's region: credit_sem[n]
  uint64_t local_data_sem = 0;     // ours: data_sem[m]
  uint64_t local_credit_sem = 0;   // ours: credit_sem[m]
};

struct HierWiring {
  int rank = 0, node = 0, local_rank = 0, nodes = 0, ranks_per_node = 0;
  RailLayout rail;
  std::vector<RailPeer> peers;  // N - 1 of them, nodes ascending
  // The permutation of the last phase: the intra-node result is [K local ranks][N nodes] shards
  // (local rank j's rail block holds the shards of (0, j) .. (N-1, j)); block j * N + m goes to
  // output slot out_slot[j * N + m] = rank_of(m, j).
  std::vector<int> out_slot;
};
HierWiring hier_wiring(const Topology& topo, int rank, uint64_t max_bytes);

// Checks every handle against this rank's view before anything of them is used: count, format,
// world, each handle's rank equal to its index, node / local rank equal to the topology's,
// max_bytes and rail_bytes equal to ours, an engine info for every remote rail peer and an
// AllGather handle for every local peer when K > 1. Throws kInvalidArgument (malformed) or
// kProtocol (well formed but inconsistent), naming the rank and the field.
std::vector<HierHandle> check_hier_handles(const std::vector<std::string>& handles, const Topology& topo, int rank,
                                           uint64_t max_bytes);

}  // namespace sluice::detail
