#include "plan_sim.hpp"

#include <algorithm>
#include <tuple>

namespace sluice::test {

using detail::HierAllGatherPlan;
using detail::Step;
using detail::StepKind;
using detail::Topology;

std::string SimResult::report() const {
  std::string s;
  for (size_t i = 0; i < problems.size() && i < 20; ++i) s += problems[i] + "\n";
  if (problems.size() > 20) s += "... and " + std::to_string(problems.size() - 20) + " more\n";
  return s;
}

bool SimResult::mentions(const std::string& needle) const {
  return std::any_of(problems.begin(), problems.end(), [&](const std::string& p) { return p.find(needle) != p.npos; });
}

std::vector<HierAllGatherPlan> plan_all(const Topology& topo, uint64_t shard_bytes) {
  std::vector<HierAllGatherPlan> plans;
  for (int r = 0; r < topo.world_size(); ++r) plans.push_back(detail::plan_hier_allgather(topo, r, shard_bytes));
  return plans;
}

namespace {

// A receive a rank expects: (phase, kind, sender, shard). Matched at most once by a send.
using RecvKey = std::tuple<int, StepKind, int, int>;

std::string where(int rank, const Step& s) {
  return "rank " + std::to_string(rank) + " phase " + std::to_string(s.phase) + " " + std::string(to_string(s.kind)) +
         " peer " + std::to_string(s.peer) + " shard " + std::to_string(s.shard);
}

}  // namespace

SimResult simulate(const Topology& topo, const std::vector<HierAllGatherPlan>& plans, uint64_t S) {
  SimResult res;
  auto bad = [&](std::string p) { res.problems.push_back(std::move(p)); };
  const int w = topo.world_size(), k = topo.ranks_per_node();
  if (static_cast<int>(plans.size()) != w) {
    bad("expected " + std::to_string(w) + " plans, got " + std::to_string(plans.size()));
    return res;
  }
  std::vector<std::vector<uint8_t>> out(w, std::vector<uint8_t>(w * S, 0));
  std::vector<std::vector<int>> filled(w, std::vector<int>(w, 0));  // times each slot was written
  std::map<std::pair<int, int>, int> shard_to_node;                  // (shard, node) -> network arrivals
  int last_phase = 0;
  for (int r = 0; r < w; ++r) {
    const auto& p = plans[r];
    if (p.rank != r || p.world_size != w || p.shard_bytes != S) bad("plan " + std::to_string(r) + " has the wrong header");
    for (size_t i = 0; i < p.steps.size(); ++i) {
      const Step& s = p.steps[i];
      if (i && s.phase < p.steps[i - 1].phase) bad(where(r, s) + ": phases out of order");
      if (s.peer < 0 || s.peer >= w || s.shard < 0 || s.shard >= w) {
        bad(where(r, s) + ": peer or shard outside the world");
        return res;  // nothing below could index safely
      }
      if (s.offset != static_cast<uint64_t>(s.shard) * S || s.bytes != S)
        bad(where(r, s) + ": offset/bytes " + std::to_string(s.offset) + "/" + std::to_string(s.bytes) +
            " is not slot " + std::to_string(s.shard) + " of the rank-major output");
      last_phase = std::max(last_phase, s.phase);
    }
  }

  for (int phase = 0; phase <= last_phase; ++phase) {
    const auto before = filled;  // what a step of this phase may read
    std::map<std::pair<int, RecvKey>, int> pending;  // (receiver, key) -> count still expected
    for (int r = 0; r < w; ++r)
      for (const Step& s : plans[r].steps)
        if (s.phase == phase && (s.kind == StepKind::kNetRecv || s.kind == StepKind::kNvlRecv)) {
          if (s.peer == r) bad(where(r, s) + ": receives from itself");
          ++pending[{r, RecvKey{phase, s.kind, s.peer, s.shard}}];
        }
    auto deliver = [&](int from, int to, const Step& s, StepKind recv_kind) {
      auto it = pending.find({to, RecvKey{phase, recv_kind, from, s.shard}});
      if (it == pending.end() || it->second == 0)
        bad(where(from, s) + ": no matching " + std::string(to_string(recv_kind)) + " on rank " + std::to_string(to));
      else
        --it->second;
      std::copy_n(out[from].begin() + s.offset, S, out[to].begin() + s.offset);
      ++filled[to][s.shard];
    };
    for (int r = 0; r < w; ++r) {
      const auto me = topo.place(r);
      for (const Step& s : plans[r].steps) {
        if (s.phase != phase) continue;
        const auto them = topo.place(s.peer);
        const bool src_ready = before[r][s.shard] > 0;
        switch (s.kind) {
          case StepKind::kCopyInput:
            if (s.peer != r || s.shard != r) bad(where(r, s) + ": copies an input that is not its own");
            for (uint64_t b = 0; b < S; ++b) out[r][s.shard * S + b] = input_byte(s.shard, b);
            ++filled[r][s.shard];
            break;
          case StepKind::kNetSend:
            if (!src_ready) bad(where(r, s) + ": reads slot " + std::to_string(s.shard) + " before it was filled");
            if (them.node == me.node) bad(where(r, s) + ": network send inside node " + std::to_string(me.node));
            if (them.local_rank != me.local_rank) bad(where(r, s) + ": leaves its rail (local rank " +
                                                      std::to_string(me.local_rank) + " -> " + std::to_string(them.local_rank) + ")");
            res.net_bytes[{me.node, them.node}] += S;
            ++shard_to_node[{s.shard, them.node}];
            deliver(r, s.peer, s, StepKind::kNetRecv);
            break;
          case StepKind::kNvlSend:
            if (!src_ready) bad(where(r, s) + ": reads slot " + std::to_string(s.shard) + " before it was filled");
            if (them.node != me.node || s.peer == r) bad(where(r, s) + ": NVLink send outside its node or to itself");
            ++res.nvl_shards[{r, s.peer}];
            deliver(r, s.peer, s, StepKind::kNvlRecv);
            break;
          case StepKind::kNetRecv:
          case StepKind::kNvlRecv:
            break;  // matched by the sends above
        }
      }
    }
    for (const auto& [key, left] : pending)
      if (left > 0)
        bad("rank " + std::to_string(key.first) + " phase " + std::to_string(phase) + " " +
            std::string(to_string(std::get<1>(key.second))) + " from " + std::to_string(std::get<2>(key.second)) +
            " shard " + std::to_string(std::get<3>(key.second)) + ": never sent");
  }

  for (int r = 0; r < w; ++r)
    for (int s = 0; s < w; ++s) {
      if (filled[r][s] != 1)
        bad("rank " + std::to_string(r) + " slot " + std::to_string(s) + " written " + std::to_string(filled[r][s]) +
            " times (want exactly once)");
      for (uint64_t b = 0; b < S; ++b)
        if (out[r][s * S + b] != input_byte(s, b)) {
          bad("rank " + std::to_string(r) + " slot " + std::to_string(s) + " byte " + std::to_string(b) + " is wrong");
          break;
        }
    }
  // Each shard reaches every other node over the network exactly once, and never its own node.
  for (int s = 0; s < w; ++s)
    for (int m = 0; m < topo.nodes(); ++m) {
      auto it = shard_to_node.find({s, m});
      const int got = it == shard_to_node.end() ? 0 : it->second;
      const int want = m == topo.place(s).node ? 0 : 1;
      if (got != want)
        bad("shard " + std::to_string(s) + " crossed the network to node " + std::to_string(m) + " " +
            std::to_string(got) + " times (want " + std::to_string(want) + ")");
    }
  for (const auto& [pair, bytes] : res.net_bytes)
    if (bytes != static_cast<uint64_t>(k) * S)
      bad("node " + std::to_string(pair.first) + " -> node " + std::to_string(pair.second) + ": " +
          std::to_string(bytes) + " network bytes (want ranks_per_node x shard = " + std::to_string(k * S) + ")");
  return res;
}

}  // namespace sluice::test
