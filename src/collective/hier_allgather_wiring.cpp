#include "collective/hier_allgather_wiring.hpp"

#include <charconv>
#include <limits>

#include "sluice/error.hpp"

namespace sluice::detail {

namespace {

constexpr std::string_view kMagic = "sluice-hier-allgather";
constexpr uint64_t kMaxHandleText = 4u << 20;  // an engine info is a few KiB; refuse anything absurd

[[noreturn]] void bad(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "HierAllGather handle: " + what);
}

std::string to_hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) {
    out.push_back(d[c >> 4]);
    out.push_back(d[c & 15]);
  }
  return out;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string from_hex(std::string_view h, const char* field) {
  if (h.size() % 2) bad(std::string(field) + " has an odd number of hex digits");
  std::string out(h.size() / 2, '\0');
  for (size_t i = 0; i < out.size(); ++i) {
    int a = hex_digit(h[2 * i]), b = hex_digit(h[2 * i + 1]);
    if (a < 0 || b < 0) bad(std::string(field) + " is not hex");
    out[i] = static_cast<char>(a << 4 | b);
  }
  return out;
}

template <typename T>
T number(std::string_view v, const char* field, T lo, T hi) {
  T x{};
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (v.empty() || ec != std::errc() || p != v.data() + v.size() || x < lo || x > hi)
    bad(std::string(field) + "='" + std::string(v.substr(0, 32)) + "' is not a number in range");
  return x;
}

std::string_view value_of(std::string_view token, std::string_view key) {
  if (token.size() <= key.size() || token.substr(0, key.size()) != key || token[key.size()] != '=')
    bad("expected " + std::string(key) + "=..., got '" + std::string(token.substr(0, 32)) + "'");
  return token.substr(key.size() + 1);
}

}  // namespace

std::string HierHandle::encode() const {
  return std::string(kMagic) + " 1 world=" + std::to_string(world) + " rank=" + std::to_string(rank) +
         " node=" + std::to_string(node) + " local=" + std::to_string(local_rank) +
         " max_bytes=" + std::to_string(max_bytes) + " rail_bytes=" + std::to_string(rail_bytes) +
         " info=" + to_hex(engine_info) + " ag=" + (ag_handle.empty() ? std::string("-") : to_hex(ag_handle));
}

HierHandle HierHandle::parse(std::string_view text) {
  if (text.size() > kMaxHandleText) bad("longer than " + std::to_string(kMaxHandleText) + " bytes");
  std::vector<std::string_view> tok;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = text.find(' ', i);
    if (j == std::string_view::npos) j = text.size();
    tok.push_back(text.substr(i, j - i));
    i = j + 1;
  }
  if (tok.size() != 10) bad("expected 10 fields, got " + std::to_string(tok.size()));
  if (tok[0] != kMagic) bad("not a HierAllGather handle");
  if (tok[1] != "1") bad("version '" + std::string(tok[1].substr(0, 8)) + "' (this library reads 1)");
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  HierHandle h;
  h.world = number<int>(value_of(tok[2], "world"), "world", 1, kMaxInt);
  h.rank = number<int>(value_of(tok[3], "rank"), "rank", 0, h.world - 1);
  h.node = number<int>(value_of(tok[4], "node"), "node", 0, h.world - 1);
  h.local_rank = number<int>(value_of(tok[5], "local"), "local", 0, kMaxRanksPerNode - 1);
  h.max_bytes = number<uint64_t>(value_of(tok[6], "max_bytes"), "max_bytes", 1, uint64_t(1) << 62);
  h.rail_bytes = number<uint64_t>(value_of(tok[7], "rail_bytes"), "rail_bytes", 1, uint64_t(1) << 62);
  h.engine_info = from_hex(value_of(tok[8], "info"), "info");
  std::string_view ag = value_of(tok[9], "ag");
  if (ag != "-") h.ag_handle = from_hex(ag, "ag");
  return h;
}

RailLayout rail_layout(int nodes, uint64_t max_bytes) {
  if (nodes < 1) throw Error(ErrorCode::kInvalidArgument, "HierAllGather: no nodes");
  if (max_bytes == 0) throw Error(ErrorCode::kInvalidArgument, "HierAllGather: max_bytes is 0");
  constexpr uint64_t kLimit = uint64_t(1) << 62;
  if (max_bytes > kLimit / uint64_t(nodes))
    throw Error(ErrorCode::kInvalidArgument, "HierAllGather: " + std::to_string(nodes) + " x " +
                                                 std::to_string(max_bytes) + " bytes of rail buffer is too large");
  RailLayout l;
  l.nodes = nodes;
  l.max_bytes = max_bytes;
  l.sem_base = (uint64_t(nodes) * max_bytes + 63) / 64 * 64;
  l.bytes = (l.sem_base + 16ull * uint64_t(nodes) + 4095) / 4096 * 4096;
  return l;
}

HierWiring hier_wiring(const Topology& topo, int rank, uint64_t max_bytes) {
  HierWiring w;
  RankPlace me = topo.place(rank);  // throws kOutOfRange
  w.rank = rank;
  w.node = me.node;
  w.local_rank = me.local_rank;
  w.nodes = topo.nodes();
  w.ranks_per_node = topo.ranks_per_node();
  w.rail = rail_layout(w.nodes, max_bytes);
  for (int m = 0; m < w.nodes; ++m) {
    if (m == w.node) continue;
    RailPeer p;
    p.node = m;
    p.rank = topo.rank_of(m, w.local_rank);
    p.remote_data_sem = w.rail.data_sem(w.node);
    p.remote_credit_sem = w.rail.credit_sem(w.node);
    p.local_data_sem = w.rail.data_sem(m);
    p.local_credit_sem = w.rail.credit_sem(m);
    w.peers.push_back(p);
  }
  w.out_slot.resize(size_t(w.ranks_per_node) * size_t(w.nodes));
  for (int j = 0; j < w.ranks_per_node; ++j)
    for (int m = 0; m < w.nodes; ++m) w.out_slot[size_t(j) * w.nodes + m] = topo.rank_of(m, j);
  return w;
}

std::vector<HierHandle> check_hier_handles(const std::vector<std::string>& handles, const Topology& topo, int rank,
                                           uint64_t max_bytes) {
  const int world = topo.world_size();
  if (static_cast<int>(handles.size()) != world)
    throw Error(ErrorCode::kInvalidArgument, "HierAllGather::connect: need " + std::to_string(world) +
                                                 " handles, got " + std::to_string(handles.size()));
  const HierWiring w = hier_wiring(topo, rank, max_bytes);
  std::vector<HierHandle> out(world);
  for (int r = 0; r < world; ++r) {
    const std::string who = "rank " + std::to_string(r) + "'s handle: ";
    try {
      out[r] = HierHandle::parse(handles[r]);
    } catch (const Error& e) {
      throw Error(e.code(), who + e.what());
    }
    const HierHandle& h = out[r];
    auto mismatch = [&](const std::string& field, const std::string& got, const std::string& want) {
      throw Error(ErrorCode::kProtocol, "HierAllGather::connect: " + who + field + "=" + got + ", expected " + want);
    };
    if (h.world != world) mismatch("world", std::to_string(h.world), std::to_string(world));
    if (h.rank != r) mismatch("rank", std::to_string(h.rank), std::to_string(r));
    RankPlace p = topo.place(r);
    if (h.node != p.node) mismatch("node", std::to_string(h.node), std::to_string(p.node));
    if (h.local_rank != p.local_rank) mismatch("local", std::to_string(h.local_rank), std::to_string(p.local_rank));
    if (h.max_bytes != max_bytes) mismatch("max_bytes", std::to_string(h.max_bytes), std::to_string(max_bytes));
    if (h.rail_bytes != w.rail.bytes) mismatch("rail_bytes", std::to_string(h.rail_bytes), std::to_string(w.rail.bytes));
    const bool rail_peer = p.local_rank == w.local_rank && p.node != w.node;
    const bool local_peer = p.node == w.node && r != rank;
    if (rail_peer && h.engine_info.empty()) mismatch("info", "(empty)", "its engine's info");
    if (local_peer && topo.ranks_per_node() > 1 && h.ag_handle.empty())
      mismatch("ag", "-", "an AllGather handle (" + std::to_string(topo.ranks_per_node()) + " ranks per node)");
  }
  return out;
}

}  // namespace sluice::detail
