// The hierarchical AllGather's plan (issue 14), checked without a GPU: every rank's steps are
// executed on host buffers (plan_sim.cpp) for every shape from 1x1 to 16x8, and deliberately
// broken plans must be caught.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>

#include "collective/hier_allgather_plan.hpp"
#include "expect_error.hpp"
#include "plan_sim.hpp"
#include "sluice/error.hpp"

using sluice::ErrorCode;
using sluice::detail::HierAllGatherPlan;
using sluice::detail::plan_hier_allgather;
using sluice::detail::Step;
using sluice::detail::StepKind;
using sluice::detail::Topology;
using sluice::test::expect_error;
using sluice::test::plan_all;
using sluice::test::simulate;

namespace {

// (nodes, ranks per node): 1 node, 1 rank per node, odd node counts, up to 16 x 8.
class HierPlanShapes : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(HierPlanShapes, EveryRankEndsWithTheAllGather) {
  const auto [nodes, k] = GetParam();
  for (uint64_t shard : {uint64_t{1}, uint64_t{3}, uint64_t{8}}) {  // odd sizes too: offsets are bytes
    const Topology t = Topology::blocks(nodes * k, k);
    ASSERT_EQ(t.nodes(), nodes);
    const auto plans = plan_all(t, shard);
    const auto res = simulate(t, plans, shard);
    EXPECT_TRUE(res.ok()) << nodes << "x" << k << " shard " << shard << ":\n" << res.report();
    // Every ordered pair of distinct nodes carries exactly k shards, and nothing else crosses.
    EXPECT_EQ(res.net_bytes.size(), static_cast<size_t>(nodes * (nodes - 1)));
    for (const auto& p : plans) {
      EXPECT_EQ(p.net_bytes_sent(), (nodes - 1) * shard) << "every NIC carries the same load";
      EXPECT_EQ(p.phases(), nodes * k == 1 ? 1 : (nodes > 1 && k > 1 ? 3 : 2));
    }
  }
}

TEST_P(HierPlanShapes, InterleavedNodesWork) {
  // Node ids round-robin over the ranks (rank r on node r % nodes): not torchrun's layout, but
  // allowed, and the output stays rank-major.
  const auto [nodes, k] = GetParam();
  std::vector<int> ids(nodes * k);
  for (int r = 0; r < nodes * k; ++r) ids[r] = 100 + (r % nodes);
  const Topology t = Topology::from_node_ids(ids);
  const auto res = simulate(t, plan_all(t, 5), 5);
  EXPECT_TRUE(res.ok()) << t.describe() << ":\n" << res.report();
}

TEST_P(HierPlanShapes, SerialisedPlansRoundTrip) {
  const auto [nodes, k] = GetParam();
  const Topology t = Topology::blocks(nodes * k, k);
  for (const auto& p : plan_all(t, 4096)) ASSERT_EQ(HierAllGatherPlan::parse(p.serialize()), p) << p.serialize();
}

INSTANTIATE_TEST_SUITE_P(Shapes, HierPlanShapes,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 7, 8, 16),
                                            ::testing::Values(1, 2, 3, 4, 5, 7, 8)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "x" + std::to_string(std::get<1>(info.param));
                         });

TEST(HierPlan, TwoByTwoIsExactlyThis) {
  // The scheme spelled out for rank 1 = (node 0, local 1) of 2 nodes x 2: a reviewer's anchor.
  const auto p = plan_hier_allgather(Topology::blocks(4, 2), 1, 10);
  const std::string want =
      "sluice-hier-allgather 1 rank=1 world=4 nodes=2 per_node=2 shard_bytes=10 steps=7\n"
      "0 copy_input 1 1 10 10\n"
      "1 net_send 3 1 10 10\n"   // own shard to the same rail on node 1
      "1 net_recv 3 3 30 10\n"
      "1 nvl_send 0 1 10 10\n"   // own shard to the local peer, overlapping the network
      "1 nvl_recv 0 0 0 10\n"
      "2 nvl_send 0 3 30 10\n"   // forward what came over the rail
      "2 nvl_recv 0 2 20 10\n";  // the peer forwards what came over its rail
  EXPECT_EQ(p.serialize(), want);
}

TEST(HierPlan, ForceInterSendsEverythingOverTheNetwork) {
  // The mode switch: 4 GPUs of one host as 4 nodes. No NVLink step at all.
  const Topology t = Topology::force_inter(4);
  EXPECT_EQ(t.nodes(), 4);
  EXPECT_EQ(t.ranks_per_node(), 1);
  const auto plans = plan_all(t, 16);
  const auto res = simulate(t, plans, 16);
  EXPECT_TRUE(res.ok()) << res.report();
  EXPECT_TRUE(res.nvl_shards.empty());
  for (const auto& p : plans) {
    EXPECT_EQ(p.net_bytes_sent(), 3u * 16);
    for (const Step& s : p.steps) EXPECT_TRUE(s.kind != StepKind::kNvlSend && s.kind != StepKind::kNvlRecv);
  }
  // The same from torchrun's environment: 1 = every rank its own node.
  const Topology e = Topology::from_torchrun(2, 4, 2, 4, 1);
  EXPECT_EQ(e.nodes(), 4);
  EXPECT_TRUE(simulate(e, plan_all(e, 16), 16).ok());
}

TEST(HierPlan, OneHostSplitIntoTwoNodesOfTwo) {
  // 2 "nodes" x 2 GPUs on a 4-GPU host: both paths are exercised on one machine.
  const Topology t = Topology::from_torchrun(3, 4, 3, 4, 2);
  EXPECT_EQ(t.nodes(), 2);
  EXPECT_EQ(t.place(3).node, 1);
  EXPECT_EQ(t.place(3).local_rank, 1);
  const auto res = simulate(t, plan_all(t, 7), 7);
  EXPECT_TRUE(res.ok()) << res.report();
  EXPECT_EQ(res.net_bytes.at({0, 1}), 2u * 7);
  EXPECT_EQ(res.nvl_shards.at({0, 1}), 2);  // own shard + the one forwarded from node 1
}

TEST(HierPlan, BadArgumentsAreRefused) {
  const Topology t = Topology::blocks(8, 4);
  expect_error([&] { plan_hier_allgather(t, 8, 16); }, ErrorCode::kOutOfRange, "rank 8 outside world size 8");
  expect_error([&] { plan_hier_allgather(t, 0, 0); }, ErrorCode::kInvalidArgument, "shard_bytes is 0");
  expect_error([&] { plan_hier_allgather(t, 0, uint64_t{1} << 62); }, ErrorCode::kInvalidArgument, "overflow");
}

TEST(HierPlan, MalformedTextIsRefusedWithTheLine) {
  const std::string good = plan_hier_allgather(Topology::blocks(4, 2), 1, 10).serialize();
  auto refused = [](const std::string& text, const std::string& needle) {
    expect_error([&] { HierAllGatherPlan::parse(text); }, ErrorCode::kInvalidArgument, needle);
  };
  refused("", "line 1: missing header");
  refused("other 1 rank=0\n", "not a sluice-hier-allgather plan");
  refused(std::string(good).replace(good.find("steps=7"), 7, "steps=8"), "line 9: missing");
  refused(std::string(good).replace(good.find("net_send"), 8, "teleport"), "line 3: unknown step kind 'teleport'");
  refused(std::string(good).replace(good.find("1 net_send 3"), 12, "1 net_send 9"), "line 3: peer or shard outside");
  refused(std::string(good).replace(good.find("2 nvl_send"), 1, "0"), "line 7: phases out of order");
  refused(std::string(good).replace(good.find("shard_bytes=10"), 14, "shard_bytes=x"), "shard_bytes 'x' is not a number");
  refused(good + "1 net_send 3 1 10 10\n", "text after the last step");
  refused(std::string(good).replace(good.find("nodes=2"), 7, "nodes=3"), "line 1: inconsistent header");
  refused(std::string(good).replace(good.find("rank=1"), 6, "rank=4"), "line 1: inconsistent header");
}

// Mutations: each breaks the plan in one way a buggy planner could; the simulator must say so.
// (This is what makes the shape tests above worth anything.)
class HierPlanMutation : public ::testing::Test {
 protected:
  const Topology t = Topology::blocks(12, 4);  // 3 nodes x 4
  std::vector<HierAllGatherPlan> plans = plan_all(t, 8);
  // The first step of that phase and kind. Throws if there is none (the planner changed), so
  // that a mutation test fails cleanly instead of writing through end().
  Step& find(int rank, int phase, StepKind kind) {
    auto& steps = plans[rank].steps;
    auto it = std::find_if(steps.begin(), steps.end(), [&](const Step& s) { return s.phase == phase && s.kind == kind; });
    if (it == steps.end()) throw std::runtime_error("rank " + std::to_string(rank) + " has no such step");
    return *it;
  }
  sluice::test::SimResult run() { return simulate(t, plans, 8); }
};

TEST_F(HierPlanMutation, Unmutated) { EXPECT_TRUE(run().ok()) << run().report(); }

TEST_F(HierPlanMutation, WrongRailIsCaught) {
  Step& s = find(1, 1, StepKind::kNetSend);  // rank 1 = (0, 1) -> (1, 1) = rank 5
  s.peer = 6;                               // (1, 2): right node, wrong rail
  const auto res = run();
  EXPECT_TRUE(res.mentions("leaves its rail")) << res.report();
  EXPECT_TRUE(res.mentions("no matching net_recv")) << res.report();
  EXPECT_TRUE(res.mentions("never sent")) << res.report();
}

TEST_F(HierPlanMutation, ConsistentWrongRailStillCaught) {
  // Sender and receiver agree on the wrong rail (a planner bug on both sides): the data may even
  // arrive, but the rail property (and so the NIC balance) is checked on its own.
  find(1, 1, StepKind::kNetSend).peer = 6;
  for (Step& s : plans[6].steps)
    if (s.kind == StepKind::kNetRecv && s.peer == 2) s.peer = 1, s.shard = 1, s.offset = 8;
  EXPECT_TRUE(run().mentions("leaves its rail")) << run().report();
}

TEST_F(HierPlanMutation, ForwardingTooEarlyIsCaught) {
  Step& s = find(0, 2, StepKind::kNvlSend);  // a forwarded shard, moved into the network phase
  Step moved = s;
  moved.phase = 1;
  plans[0].steps.erase(plans[0].steps.begin() + (&s - plans[0].steps.data()));
  auto at = std::find_if(plans[0].steps.begin(), plans[0].steps.end(), [](const Step& x) { return x.phase == 2; });
  plans[0].steps.insert(at, moved);
  EXPECT_TRUE(run().mentions("before it was filled")) << run().report();
}

TEST_F(HierPlanMutation, MissingForwardIsCaught) {
  auto& steps = plans[2].steps;
  steps.erase(steps.begin() + (&find(2, 2, StepKind::kNvlSend) - steps.data()));
  const auto res = run();
  EXPECT_TRUE(res.mentions("written 0 times")) << res.report();
  EXPECT_TRUE(res.mentions("never sent")) << res.report();
}

TEST_F(HierPlanMutation, DuplicateNetworkSendIsCaught) {
  plans[4].steps.insert(plans[4].steps.begin() + 1, find(4, 1, StepKind::kNetSend));
  const auto res = run();
  EXPECT_TRUE(res.mentions("written 2 times")) << res.report();
  EXPECT_TRUE(res.mentions("crossed the network to node")) << res.report();
  EXPECT_TRUE(res.mentions("network bytes (want")) << res.report();
}

TEST_F(HierPlanMutation, NetworkInsideANodeIsCaught) {
  // Sending a local peer's shard over the network instead of NVLink.
  Step& s = find(0, 1, StepKind::kNvlSend);
  s.kind = StepKind::kNetSend;
  EXPECT_TRUE(run().mentions("network send inside node 0")) << run().report();
}

TEST_F(HierPlanMutation, WrongOffsetIsCaught) {
  find(7, 2, StepKind::kNvlSend).offset += 1;
  EXPECT_TRUE(run().mentions("is not slot")) << run().report();
}

}  // namespace
