#include "collective/topology.hpp"

#include <map>

#include "sluice/error.hpp"

namespace sluice::detail {

namespace {

[[noreturn]] void fail(ErrorCode code, const std::string& what) { throw Error(code, "topology: " + what); }

}  // namespace

Topology Topology::from_node_ids(std::span<const int> node_of_rank) {
  if (node_of_rank.empty()) fail(ErrorCode::kInvalidArgument, "no ranks (world size 0)");
  Topology t;
  std::map<int, int> index;  // label -> node number, in order of first appearance
  t.places_.resize(node_of_rank.size());
  for (size_t r = 0; r < node_of_rank.size(); ++r) {
    const int label = node_of_rank[r];
    if (label < 0)
      fail(ErrorCode::kInvalidArgument, "rank " + std::to_string(r) + " has a negative node id " + std::to_string(label));
    auto [it, fresh] = index.emplace(label, static_cast<int>(t.ranks_of_node_.size()));
    if (fresh) t.ranks_of_node_.emplace_back();
    auto& members = t.ranks_of_node_[it->second];
    t.places_[r] = {it->second, static_cast<int>(members.size())};
    members.push_back(static_cast<int>(r));
  }
  const size_t k = t.ranks_of_node_[0].size();
  for (size_t n = 0; n < t.ranks_of_node_.size(); ++n) {
    const size_t kn = t.ranks_of_node_[n].size();
    if (kn > kMaxRanksPerNode)
      fail(ErrorCode::kUnsupported, "node " + std::to_string(n) + " (id " + std::to_string(node_of_rank[t.ranks_of_node_[n][0]]) +
                                        ") has " + std::to_string(kn) + " ranks; at most " +
                                        std::to_string(kMaxRanksPerNode) + " per node (one NVLink domain)");
    if (kn != k)
      fail(ErrorCode::kUnsupported,
           "uneven nodes: node 0 has " + std::to_string(k) + " ranks, node " + std::to_string(n) + " (id " +
               std::to_string(node_of_rank[t.ranks_of_node_[n][0]]) + ") has " + std::to_string(kn) +
               "; the rail-aligned plan needs the same ranks per node");
  }
  return t;
}

Topology Topology::blocks(int world_size, int ranks_per_node) {
  if (world_size <= 0) fail(ErrorCode::kInvalidArgument, "world size " + std::to_string(world_size) + " is not positive");
  if (ranks_per_node <= 0)
    fail(ErrorCode::kInvalidArgument, "ranks per node " + std::to_string(ranks_per_node) + " is not positive");
  if (world_size % ranks_per_node != 0)
    fail(ErrorCode::kUnsupported, "world size " + std::to_string(world_size) + " is not a multiple of " +
                                      std::to_string(ranks_per_node) + " ranks per node (uneven nodes)");
  std::vector<int> ids(world_size);
  for (int r = 0; r < world_size; ++r) ids[r] = r / ranks_per_node;
  return from_node_ids(ids);
}

Topology Topology::force_inter(int world_size) { return blocks(world_size, 1); }

Topology Topology::from_torchrun(int rank, int world_size, int local_rank, int local_world_size,
                                 int fake_ranks_per_node) {
  auto v = [](const char* name, int x) { return std::string(name) + "=" + std::to_string(x); };
  const std::string env = v("RANK", rank) + " " + v("WORLD_SIZE", world_size) + " " + v("LOCAL_RANK", local_rank) +
                          " " + v("LOCAL_WORLD_SIZE", local_world_size);
  if (world_size <= 0 || local_world_size <= 0 || rank < 0 || rank >= world_size || local_rank < 0 ||
      local_rank >= local_world_size)
    fail(ErrorCode::kInvalidArgument, "inconsistent torchrun environment: " + env);
  if (world_size % local_world_size != 0)
    fail(ErrorCode::kUnsupported, "WORLD_SIZE is not a multiple of LOCAL_WORLD_SIZE (hosts with different GPU counts): " + env);
  if (rank % local_world_size != local_rank)
    fail(ErrorCode::kUnsupported,
         "ranks are not numbered host by host (RANK % LOCAL_WORLD_SIZE != LOCAL_RANK), so the other ranks' "
         "hosts cannot be inferred; pass node ids explicitly: " + env);
  if (fake_ranks_per_node < 0)
    fail(ErrorCode::kInvalidArgument, "ranks per node override " + std::to_string(fake_ranks_per_node) + " is negative");
  if (fake_ranks_per_node == 0) return blocks(world_size, local_world_size);
  if (local_world_size % fake_ranks_per_node != 0)
    fail(ErrorCode::kUnsupported, "ranks per node override " + std::to_string(fake_ranks_per_node) +
                                      " does not divide LOCAL_WORLD_SIZE, so a node would span two hosts: " + env);
  return blocks(world_size, fake_ranks_per_node);
}

RankPlace Topology::place(int rank) const {
  if (rank < 0 || rank >= world_size())
    fail(ErrorCode::kOutOfRange, "rank " + std::to_string(rank) + " outside world size " + std::to_string(world_size()));
  return places_[rank];
}

int Topology::rank_of(int node, int local_rank) const {
  if (node < 0 || node >= nodes() || local_rank < 0 || local_rank >= ranks_per_node())
    fail(ErrorCode::kOutOfRange, "(node " + std::to_string(node) + ", local rank " + std::to_string(local_rank) +
                                     ") outside " + std::to_string(nodes()) + " nodes x " +
                                     std::to_string(ranks_per_node()));
  return ranks_of_node_[node][local_rank];
}

std::string Topology::describe() const {
  std::string s = std::to_string(world_size()) + " ranks, " + std::to_string(nodes()) + " nodes x " +
                  std::to_string(ranks_per_node());
  // The membership only while it stays short: a 128-rank list helps nobody in a log line.
  if (world_size() > 32) return s;
  for (int n = 0; n < nodes(); ++n) {
    s += n ? ", node " : ": node ";
    s += std::to_string(n) + " = {";
    for (size_t i = 0; i < ranks_of_node_[n].size(); ++i) s += (i ? "," : "") + std::to_string(ranks_of_node_[n][i]);
    s += "}";
  }
  return s;
}

}  // namespace sluice::detail
