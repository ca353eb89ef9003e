#include "collective/hier_allgather_plan.hpp"

#include <array>
#include <charconv>
#include <limits>

#include "sluice/error.hpp"

namespace sluice::detail {

namespace {

constexpr std::array<std::string_view, 5> kKindNames = {"copy_input", "net_send", "net_recv", "nvl_send", "nvl_recv"};

}  // namespace

std::string_view to_string(StepKind kind) { return kKindNames.at(static_cast<size_t>(kind)); }

HierAllGatherPlan plan_hier_allgather(const Topology& topo, int rank, uint64_t shard_bytes) {
  const RankPlace me = topo.place(rank);  // throws kOutOfRange
  const int n_nodes = topo.nodes(), k = topo.ranks_per_node(), w = topo.world_size();
  if (shard_bytes == 0) throw Error(ErrorCode::kInvalidArgument, "hierarchical AllGather plan: shard_bytes is 0");
  if (shard_bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(w))
    throw Error(ErrorCode::kInvalidArgument, "hierarchical AllGather plan: " + std::to_string(w) + " shards of " +
                                                 std::to_string(shard_bytes) + " bytes overflow a 64-bit offset");

  HierAllGatherPlan p{rank, w, n_nodes, k, shard_bytes, {}};
  p.steps.reserve(1 + 2 * (n_nodes - 1) + 2 * (k - 1) * n_nodes);
  auto add = [&](int phase, StepKind kind, int peer, int shard) {
    p.steps.push_back({phase, kind, peer, shard, static_cast<uint64_t>(shard) * shard_bytes, shard_bytes});
  };
  // Rotations: the d-th network send goes to node n+d and the d-th receive comes from node n-d,
  // so that at every step each node sends to a different node (no incast on node 0) and the
  // receive order matches the order in which the shards are likely to land.
  auto node_ahead = [&](int d) { return (me.node + d) % n_nodes; };
  auto node_behind = [&](int d) { return (me.node - d + n_nodes) % n_nodes; };
  auto local_ahead = [&](int d) { return (me.local_rank + d) % k; };

  add(0, StepKind::kCopyInput, rank, rank);

  for (int d = 1; d < n_nodes; ++d) {
    add(1, StepKind::kNetSend, topo.rank_of(node_ahead(d), me.local_rank), rank);
    const int from = topo.rank_of(node_behind(d), me.local_rank);
    add(1, StepKind::kNetRecv, from, from);
  }
  for (int d = 1; d < k; ++d) {
    const int peer = topo.rank_of(me.node, local_ahead(d));
    add(1, StepKind::kNvlSend, peer, rank);
    add(1, StepKind::kNvlRecv, peer, peer);
  }

  // Forward what came over the network on this rank's rail; receive what the local peers got on
  // theirs. Node by node in arrival order, so a GPU implementation can forward each shard as soon
  // as it lands instead of waiting for the whole phase.
  for (int d = 1; d < n_nodes; ++d) {
    const int m = node_behind(d);
    const int shard = topo.rank_of(m, me.local_rank);
    for (int e = 1; e < k; ++e) {
      const int peer = topo.rank_of(me.node, local_ahead(e));
      add(2, StepKind::kNvlSend, peer, shard);
      add(2, StepKind::kNvlRecv, peer, topo.rank_of(m, topo.place(peer).local_rank));
    }
  }
  return p;
}

uint64_t HierAllGatherPlan::net_bytes_sent() const {
  uint64_t total = 0;
  for (const auto& s : steps)
    if (s.kind == StepKind::kNetSend) total += s.bytes;
  return total;
}

std::string HierAllGatherPlan::serialize() const {
  std::string out = "sluice-hier-allgather 1 rank=" + std::to_string(rank) + " world=" + std::to_string(world_size) +
                    " nodes=" + std::to_string(nodes) + " per_node=" + std::to_string(ranks_per_node) +
                    " shard_bytes=" + std::to_string(shard_bytes) + " steps=" + std::to_string(steps.size()) + "\n";
  for (const auto& s : steps) {
    out += std::to_string(s.phase) + " " + std::string(to_string(s.kind)) + " " + std::to_string(s.peer) + " " +
           std::to_string(s.shard) + " " + std::to_string(s.offset) + " " + std::to_string(s.bytes) + "\n";
  }
  return out;
}

namespace {

// Reads whitespace-separated fields of one line; every failure names the line.
struct LineReader {
  std::string_view rest;
  int line_no;

  [[noreturn]] void bad(const std::string& what) const {
    throw Error(ErrorCode::kInvalidArgument,
                "hierarchical AllGather plan, line " + std::to_string(line_no) + ": " + what);
  }
  std::string_view word(const char* name) {
    size_t b = rest.find_first_not_of(' ');
    if (b == std::string_view::npos) bad(std::string("missing ") + name);
    size_t e = rest.find(' ', b);
    std::string_view w = rest.substr(b, e == std::string_view::npos ? std::string_view::npos : e - b);
    rest = e == std::string_view::npos ? std::string_view{} : rest.substr(e);
    return w;
  }
  template <typename T>
  T number(const char* name, std::string_view prefix = {}) {
    std::string_view w = word(name);
    if (w.substr(0, prefix.size()) != prefix) bad(std::string("expected ") + std::string(prefix) + "<" + name + ">");
    w.remove_prefix(prefix.size());
    T v{};
    auto [ptr, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
    if (ec != std::errc() || ptr != w.data() + w.size() || w.empty())
      bad(std::string(name) + " '" + std::string(w) + "' is not a number");
    return v;
  }
  void end() {
    if (rest.find_first_not_of(' ') != std::string_view::npos) bad("trailing '" + std::string(rest) + "'");
  }
};

}  // namespace

HierAllGatherPlan HierAllGatherPlan::parse(std::string_view text) {
  int line_no = 0;
  auto next_line = [&]() -> std::string_view {
    ++line_no;
    size_t e = text.find('\n');
    std::string_view l = text.substr(0, e);
    text = e == std::string_view::npos ? std::string_view{} : text.substr(e + 1);
    return l;
  };
  LineReader head{next_line(), line_no};
  if (head.word("header") != "sluice-hier-allgather") head.bad("not a sluice-hier-allgather plan");
  if (head.number<int>("version") != 1) head.bad("unknown version");
  HierAllGatherPlan p;
  p.rank = head.number<int>("rank", "rank=");
  p.world_size = head.number<int>("world", "world=");
  p.nodes = head.number<int>("nodes", "nodes=");
  p.ranks_per_node = head.number<int>("per_node", "per_node=");
  p.shard_bytes = head.number<uint64_t>("shard_bytes", "shard_bytes=");
  const size_t count = head.number<size_t>("steps", "steps=");
  head.end();
  if (p.world_size <= 0 || p.rank < 0 || p.rank >= p.world_size || p.nodes <= 0 || p.ranks_per_node <= 0 ||
      static_cast<int64_t>(p.nodes) * p.ranks_per_node != p.world_size || p.shard_bytes == 0)
    head.bad("inconsistent header (rank, world, nodes x per_node, shard_bytes)");
  if (count > static_cast<size_t>(4) * p.world_size + 4) head.bad("more steps than any plan of this world has");
  p.steps.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    if (text.empty()) LineReader{{}, line_no + 1}.bad("missing (expected " + std::to_string(count) + " steps)");
    LineReader r{next_line(), line_no};
    Step s;
    s.phase = r.number<int>("phase");
    std::string_view kind = r.word("kind");
    size_t k = 0;
    while (k < kKindNames.size() && kKindNames[k] != kind) ++k;
    if (k == kKindNames.size()) r.bad("unknown step kind '" + std::string(kind) + "'");
    s.kind = static_cast<StepKind>(k);
    s.peer = r.number<int>("peer");
    s.shard = r.number<int>("shard");
    s.offset = r.number<uint64_t>("offset");
    s.bytes = r.number<uint64_t>("bytes");
    r.end();
    if (s.phase < 0) r.bad("negative phase");
    if (s.peer < 0 || s.peer >= p.world_size || s.shard < 0 || s.shard >= p.world_size)
      r.bad("peer or shard outside world size " + std::to_string(p.world_size));
    if (!p.steps.empty() && s.phase < p.steps.back().phase) r.bad("phases out of order");
    p.steps.push_back(s);
  }
  if (!text.empty() && text.find_first_not_of('\n') != std::string_view::npos)
    LineReader{{}, line_no + 1}.bad("text after the last step");
  return p;
}

}  // namespace sluice::detail
