// Executes every rank's hierarchical AllGather plan on host buffers and reports every way the
// plans break the contract, as text (so the mutation tests can check that a broken plan is
// caught, and for what). Phases run in order, as barriers: a step may only read a slot that was
// filled before its phase began.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collective/hier_allgather_plan.hpp"

namespace sluice::test {

struct SimResult {
  std::vector<std::string> problems;
  std::map<std::pair<int, int>, uint64_t> net_bytes;  // (from node, to node) -> bytes
  std::map<std::pair<int, int>, int> nvl_shards;      // (from rank, to rank) -> shards over NVLink

  bool ok() const { return problems.empty(); }
  // All problems, one per line (capped), for a failure message.
  std::string report() const;
  bool mentions(const std::string& needle) const;
};

// Rank r's input byte b: distinct per rank (131 is odd, so r * 131 mod 256 differs for r < 256).
inline uint8_t input_byte(int rank, uint64_t b) { return static_cast<uint8_t>(rank * 131 + b * 7 + 1); }

SimResult simulate(const detail::Topology& topo, const std::vector<detail::HierAllGatherPlan>& plans,
                   uint64_t shard_bytes);

std::vector<detail::HierAllGatherPlan> plan_all(const detail::Topology& topo, uint64_t shard_bytes);

}  // namespace sluice::test
