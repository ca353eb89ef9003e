// Which rank lives on which node: the host-side half of the hierarchical AllGather (issue 14).
//
// A Topology maps every global rank to (node, local rank). It is pure data, built once at setup
// (no GPU, no I/O), so the planner in hier_allgather_plan.hpp and its tests run in CI.
//
// Rules, and why:
//   * Every node has the same number of ranks (K). The plan is rail-aligned: local rank i of one
//     node exchanges with local rank i of every other node, so every rail must exist on every
//     node. Uneven nodes would need a rail remapping and leave some NICs with more traffic than
//     others; they are refused (kUnsupported) rather than planned badly.
//   * K <= 8 (kMaxRanksPerNode): the intra-node phase is the NVLink LL AllGather, whose peers
//     must share one NVLink domain, which is at most 8 GPUs on the machines we target.
//   * Nodes need not be contiguous in rank order. The output is rank-major whatever the node
//     layout, so the planner only ever asks "which ranks are on node n, in which order"; a node's
//     local ranks are its ranks in ascending global-rank order.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace sluice::detail {

inline constexpr int kMaxRanksPerNode = 8;

struct RankPlace {
  int node = 0;
  int local_rank = 0;
};

class Topology {
 public:
  // node_of_rank[r] = any integer label of rank r's node (hostnames hashed, group ranks, ...).
  // Nodes are numbered 0.. in order of their first rank. Throws kInvalidArgument (empty, negative
  // labels) or kUnsupported (uneven nodes, more than kMaxRanksPerNode on a node).
  static Topology from_node_ids(std::span<const int> node_of_rank);

  // `nodes` x `ranks_per_node`, contiguous: rank r is on node r / ranks_per_node. This is
  // torchrun's layout, and also how tests split one host into several "nodes".
  static Topology blocks(int world_size, int ranks_per_node);

  // Every rank its own node: every byte takes the inter-node (port channel) path, even between
  // GPUs of one host. The mode switch that tests the network path on a single machine.
  static Topology force_inter(int world_size);

  // From torchrun's environment of *this* process (RANK, WORLD_SIZE, LOCAL_RANK,
  // LOCAL_WORLD_SIZE). torchrun numbers ranks node by node (rank = node * local_world_size +
  // local_rank), which is the only layout a process can infer without asking the others; the
  // values are checked against it. fake_ranks_per_node > 0 splits each host into "nodes" of that
  // many ranks (1 = force_inter); it must divide local_world_size, as a node cannot span hosts.
  static Topology from_torchrun(int rank, int world_size, int local_rank, int local_world_size,
                                int fake_ranks_per_node = 0);

  int world_size() const { return static_cast<int>(places_.size()); }
  int nodes() const { return static_cast<int>(ranks_of_node_.size()); }
  int ranks_per_node() const { return nodes() ? static_cast<int>(ranks_of_node_[0].size()) : 0; }
  RankPlace place(int rank) const;           // throws kOutOfRange for a rank outside the world
  int rank_of(int node, int local_rank) const;  // the inverse of place()
  // "4 ranks, 2 nodes x 2: node 0 = {0,1}, node 1 = {2,3}": for logs and error messages.
  std::string describe() const;

 private:
  std::vector<RankPlace> places_;              // by global rank
  std::vector<std::vector<int>> ranks_of_node_;  // node -> its global ranks, ascending
};

}  // namespace sluice::detail
