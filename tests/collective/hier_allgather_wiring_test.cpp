// The hierarchical AllGather's host-side wiring (src/collective/hier_allgather_wiring.*): the
// handle format and its checks (a forged or malformed handle is refused before anything of it
// is used), the rail layout, and the rail peers / semaphores / permutation the kernels use,
// executed on host buffers for every rank of many shapes.
#include "collective/hier_allgather_wiring.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "sluice/error.hpp"

namespace hier_wiring_test {

using sluice::ErrorCode;
using sluice::detail::check_hier_handles;
using sluice::detail::HierHandle;
using sluice::detail::HierWiring;
using sluice::detail::hier_wiring;
using sluice::detail::rail_layout;
using sluice::detail::Topology;
using sluice::test::expect_error;

constexpr uint64_t kMax = 4096;

HierHandle handle_for(const Topology& t, int r, uint64_t max_bytes) {
  HierHandle h;
  h.world = t.world_size();
  h.rank = r;
  h.node = t.place(r).node;
  h.local_rank = t.place(r).local_rank;
  h.max_bytes = max_bytes;
  h.rail_bytes = rail_layout(t.nodes(), max_bytes).bytes;
  h.engine_info = "{\"engine\": " + std::to_string(r) + ", \"bytes\": \"\\u0000 \\n\"}";
  if (t.ranks_per_node() > 1) h.ag_handle = std::string("ag\0handle", 9) + std::to_string(r);
  return h;
}

std::vector<std::string> handles_for(const Topology& t, uint64_t max_bytes) {
  std::vector<std::string> out;
  for (int r = 0; r < t.world_size(); ++r) out.push_back(handle_for(t, r, max_bytes).encode());
  return out;
}

TEST(HierHandle, RoundTrips) {
  Topology t = Topology::blocks(8, 4);
  HierHandle h = handle_for(t, 5, kMax);
  std::string text = h.encode();
  EXPECT_EQ(text.find('\n'), std::string::npos);
  HierHandle back = HierHandle::parse(text);
  EXPECT_EQ(back.world, 8);
  EXPECT_EQ(back.rank, 5);
  EXPECT_EQ(back.node, 1);
  EXPECT_EQ(back.local_rank, 1);
  EXPECT_EQ(back.max_bytes, kMax);
  EXPECT_EQ(back.rail_bytes, h.rail_bytes);
  EXPECT_EQ(back.engine_info, h.engine_info);
  EXPECT_EQ(back.ag_handle, h.ag_handle);
  HierHandle none = handle_for(Topology::force_inter(2), 1, kMax);
  EXPECT_TRUE(none.ag_handle.empty());
  EXPECT_NE(none.encode().find(" ag=-"), std::string::npos);
  EXPECT_TRUE(HierHandle::parse(none.encode()).ag_handle.empty());
}

TEST(HierHandle, MalformedHandlesAreRefused) {
  const std::string good = handle_for(Topology::blocks(4, 2), 3, kMax).encode();
  auto replace = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  auto refused = [](const std::string& text, const std::string& needle) {
    expect_error([&] { HierHandle::parse(text); }, ErrorCode::kInvalidArgument, needle);
  };
  refused("", "expected 10 fields");
  refused(good.substr(0, good.size() / 2), "");
  refused(good + " extra=1", "expected 10 fields");
  refused(replace("sluice-hier-allgather", "sluice-allgather"), "not a HierAllGather handle");
  refused(replace("sluice-hier-allgather 1", "sluice-hier-allgather 2"), "version");
  refused(replace("world=4", "world=0"), "world");
  refused(replace("world=4", "world=-4"), "world");
  refused(replace("world=4", "world=4x"), "world");
  refused(replace("world=4", "world=99999999999999999999"), "world");
  refused(replace("rank=3", "rank=4"), "rank");  // outside its own world
  refused(replace("rank=3", "rnk=3"), "expected rank=");
  refused(replace("local=1", "local=8"), "local");
  refused(replace("max_bytes=4096", "max_bytes=0"), "max_bytes");
  refused(replace("max_bytes=4096", "max_bytes=18446744073709551615"), "max_bytes");
  refused(replace("info=", "info=zz"), "info");
  refused(replace("info=", "info=a"), "odd number");
  refused(replace(" ag=", " ag=q"), "ag");
  refused(std::string(5u << 20, 'x'), "longer than");
}

TEST(HierHandle, ForgedOrInconsistentHandlesAreRefused) {
  Topology t = Topology::blocks(4, 2);
  const int me = 0;
  auto hs = handles_for(t, kMax);
  EXPECT_EQ(check_hier_handles(hs, t, me, kMax).size(), 4u);

  expect_error([&] { check_hier_handles({hs[0], hs[1]}, t, me, kMax); }, ErrorCode::kInvalidArgument, "need 4 handles");
  auto with = [&](int r, const std::function<void(HierHandle&)>& edit) {
    auto v = hs;
    HierHandle h = handle_for(t, r, kMax);
    edit(h);
    v[r] = h.encode();
    return v;
  };
  auto refused = [&](const std::vector<std::string>& v, ErrorCode code, const std::string& needle) {
    expect_error([&] { check_hier_handles(v, t, me, kMax); }, code, needle);
  };
  refused(with(2, [](HierHandle& h) { h.rank = 3; }), ErrorCode::kProtocol, "rank 2's handle: rank=3");
  refused(with(2, [](HierHandle& h) { h.world = 8; }), ErrorCode::kProtocol, "world=8");
  refused(with(2, [](HierHandle& h) { h.node = 0; }), ErrorCode::kProtocol, "node=0, expected 1");
  refused(with(3, [](HierHandle& h) { h.local_rank = 0; }), ErrorCode::kProtocol, "local=0, expected 1");
  refused(with(1, [](HierHandle& h) { h.max_bytes = 2 * kMax; }), ErrorCode::kProtocol, "max_bytes");
  // A handle claiming a larger rail than ours: refused (our puts are sized by our layout, and
  // the transport checks them against the peer's registered region anyway).
  refused(with(2, [](HierHandle& h) { h.rail_bytes += 4096; }), ErrorCode::kProtocol, "rail_bytes");
  refused(with(2, [](HierHandle& h) { h.engine_info.clear(); }), ErrorCode::kProtocol, "info=(empty)");
  refused(with(1, [](HierHandle& h) { h.ag_handle.clear(); }), ErrorCode::kProtocol, "ag=-");
  auto v = hs;
  v[3] = "garbage";
  refused(v, ErrorCode::kInvalidArgument, "rank 3's handle");
  // Ranks this rank never talks to may lack what it would not use.
  EXPECT_NO_THROW(check_hier_handles(with(3, [](HierHandle& h) { h.engine_info.clear(); }), t, me, kMax));
}

TEST(HierWiring, RailLayout) {
  auto l = rail_layout(3, 1000);
  EXPECT_EQ(l.sem_base, 3008u);
  EXPECT_EQ(l.bytes % 4096, 0u);
  EXPECT_GE(l.bytes, l.sem_base + 6 * 8);
  EXPECT_EQ(l.data_sem(2), 3008u + 16);
  EXPECT_EQ(l.credit_sem(0), 3008u + 24);
  expect_error([] { rail_layout(2, 0); }, ErrorCode::kInvalidArgument, "max_bytes is 0");
  expect_error([] { rail_layout(4, 1ull << 61); }, ErrorCode::kInvalidArgument, "too large");
}

// Every rank of a topology executes the kernels' data movement on host buffers: stage, puts
// into the rail peers' slots (bounds and semaphore offsets checked), collect, the intra-node
// AllGather, the permutation. The result must be all_gather_into_tensor's on every rank.
void simulate(const Topology& t, uint64_t shard, uint64_t max_bytes) {
  const int W = t.world_size(), N = t.nodes(), K = t.ranks_per_node();
  std::vector<HierWiring> w;
  for (int r = 0; r < W; ++r) w.push_back(hier_wiring(t, r, max_bytes));
  std::vector<std::vector<uint8_t>> in(W), rail(W), mine(W), out(W);
  std::vector<std::vector<uint64_t>> sems(W);
  for (int r = 0; r < W; ++r) {
    in[r].resize(shard);
    for (uint64_t b = 0; b < shard; ++b) in[r][b] = uint8_t(r * 37 + b * 11 + 1);
    rail[r].assign(w[r].rail.bytes, 0);
    mine[r].assign(size_t(N) * shard, 0);
    out[r].assign(size_t(W) * shard, 0xee);
  }
  for (int r = 0; r < W; ++r) {
    const HierWiring& me = w[r];
    ASSERT_EQ(static_cast<int>(me.peers.size()), N - 1);
    std::set<uint64_t> sem_offsets;
    for (auto& p : me.peers) {
      EXPECT_NE(p.node, me.node);
      EXPECT_EQ(t.place(p.rank).local_rank, me.local_rank) << "rail peer off the rail";
      EXPECT_EQ(t.place(p.rank).node, p.node);
      // The peer's view of us must name the same semaphores from the other side.
      const auto& theirs = w[p.rank].peers;
      auto it = std::find_if(theirs.begin(), theirs.end(), [&](auto& q) { return q.rank == r; });
      ASSERT_NE(it, theirs.end()) << "rail peering not symmetric";
      EXPECT_EQ(it->local_data_sem, p.remote_data_sem);
      EXPECT_EQ(it->local_credit_sem, p.remote_credit_sem);
      EXPECT_EQ(it->remote_data_sem, p.local_data_sem);
      for (uint64_t o : {p.local_data_sem, p.local_credit_sem}) {
        EXPECT_GE(o, me.rail.sem_base);
        EXPECT_LE(o + 8, me.rail.bytes);
        EXPECT_EQ(o % 8, 0u);
        EXPECT_TRUE(sem_offsets.insert(o).second) << "semaphore shared by two channels";
      }
      // stage + put: own shard into the peer's slot n, then the signal.
      const uint64_t off = me.rail.slot_offset(me.node, shard);
      ASSERT_LE(off + shard, w[p.rank].rail.sem_base) << "put overlaps the semaphores";
      std::memcpy(rail[p.rank].data() + off, in[r].data(), shard);
      uint64_t v = 0;
      std::memcpy(&v, rail[p.rank].data() + p.remote_data_sem, 8);
      ++v;
      std::memcpy(rail[p.rank].data() + p.remote_data_sem, &v, 8);
    }
    std::memcpy(mine[r].data() + me.rail.slot_offset(me.node, shard), in[r].data(), shard);
  }
  // exchange's wait + collect.
  for (int r = 0; r < W; ++r) {
    for (auto& p : w[r].peers) {
      uint64_t v = 0;
      std::memcpy(&v, rail[r].data() + p.local_data_sem, 8);
      EXPECT_EQ(v, 1u) << "rank " << r << " got no signal from " << p.rank;
      const uint64_t off = w[r].rail.slot_offset(p.node, shard);
      std::memcpy(mine[r].data() + off, rail[r].data() + off, shard);
    }
  }
  // Intra-node AllGather of the rail blocks, then the permutation.
  for (int r = 0; r < W; ++r) {
    const HierWiring& me = w[r];
    std::vector<uint8_t> scratch;
    for (int j = 0; j < K; ++j) {
      auto& blk = mine[t.rank_of(me.node, j)];
      scratch.insert(scratch.end(), blk.begin(), blk.end());
    }
    ASSERT_EQ(me.out_slot.size(), size_t(K) * N);
    std::set<int> seen(me.out_slot.begin(), me.out_slot.end());
    EXPECT_EQ(seen.size(), size_t(W)) << "the permutation is not a bijection";
    for (size_t b = 0; b < me.out_slot.size(); ++b)
      std::memcpy(out[r].data() + uint64_t(me.out_slot[b]) * shard, scratch.data() + b * shard, shard);
    for (int s = 0; s < W; ++s)
      ASSERT_EQ(0, std::memcmp(out[r].data() + uint64_t(s) * shard, in[s].data(), shard))
          << t.describe() << ": rank " << r << " slot " << s;
  }
}

TEST(HierWiring, EveryRankGetsAllGatherIntoTensorsResult) {
  for (int n : {1, 2, 3, 4, 5, 8})
    for (int k : {1, 2, 3, 4, 8}) {
      SCOPED_TRACE(std::to_string(n) + " nodes x " + std::to_string(k));
      simulate(Topology::blocks(n * k, k), 5, 64);
      simulate(Topology::blocks(n * k, k), 16, 16);  // shard == max: slots back to back
    }
  // Interleaved nodes: ranks 0,2,4 on one node, 1,3,5 on the other.
  std::vector<int> ids = {7, 3, 7, 3, 7, 3};
  simulate(Topology::from_node_ids(ids), 3, 8);
  simulate(Topology::force_inter(4), 8, 8);
}

}  // namespace hier_wiring_test
