// Topology: rank -> (node, local rank) from node ids, blocks, torchrun's environment and the
// force-inter modes; invalid groupings refused with a message that says what was wrong.
#include <gtest/gtest.h>

#include <vector>

#include "collective/topology.hpp"
#include "expect_error.hpp"

using sluice::ErrorCode;
using sluice::detail::Topology;
using sluice::test::expect_error;

namespace {

TEST(Topology, BlocksAreTorchrunsLayout) {
  const Topology t = Topology::blocks(16, 8);
  EXPECT_EQ(t.world_size(), 16);
  EXPECT_EQ(t.nodes(), 2);
  EXPECT_EQ(t.ranks_per_node(), 8);
  for (int r = 0; r < 16; ++r) {
    EXPECT_EQ(t.place(r).node, r / 8);
    EXPECT_EQ(t.place(r).local_rank, r % 8);
    EXPECT_EQ(t.rank_of(r / 8, r % 8), r);
  }
}

TEST(Topology, NodeIdsAreLabelsAndNeedNotBeContiguous) {
  // Labels are arbitrary (hashed hostnames, say); nodes are numbered by their first rank, local
  // ranks by ascending global rank.
  const std::vector<int> ids = {42, 7, 42, 7, 9, 9};
  const Topology t = Topology::from_node_ids(ids);
  EXPECT_EQ(t.nodes(), 3);
  EXPECT_EQ(t.ranks_per_node(), 2);
  EXPECT_EQ(t.place(0).node, 0);
  EXPECT_EQ(t.place(1).node, 1);
  EXPECT_EQ(t.place(2).node, 0);
  EXPECT_EQ(t.place(2).local_rank, 1);
  EXPECT_EQ(t.place(4).node, 2);
  EXPECT_EQ(t.rank_of(1, 1), 3);
  EXPECT_EQ(t.describe(), "6 ranks, 3 nodes x 2: node 0 = {0,2}, node 1 = {1,3}, node 2 = {4,5}");
}

TEST(Topology, ForceInterGivesEveryRankItsOwnNode) {
  const Topology t = Topology::force_inter(4);
  EXPECT_EQ(t.nodes(), 4);
  EXPECT_EQ(t.ranks_per_node(), 1);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(t.place(r).node, r);
}

TEST(Topology, FromTorchrun) {
  // 2 hosts x 4 GPUs; this process is RANK 6 = LOCAL_RANK 2 of host 1.
  const Topology t = Topology::from_torchrun(6, 8, 2, 4);
  EXPECT_EQ(t.nodes(), 2);
  EXPECT_EQ(t.place(6).node, 1);
  EXPECT_EQ(t.place(6).local_rank, 2);
  // Override: "nodes" of 2 on each host (4 nodes), and of 1 (force inter: 8 nodes).
  EXPECT_EQ(Topology::from_torchrun(6, 8, 2, 4, 2).nodes(), 4);
  EXPECT_EQ(Topology::from_torchrun(6, 8, 2, 4, 1).nodes(), 8);
  // One process: one node of one rank.
  EXPECT_EQ(Topology::from_torchrun(0, 1, 0, 1).nodes(), 1);
}

TEST(Topology, InvalidGroupingsAreRefused) {
  expect_error([] { Topology::from_node_ids(std::vector<int>{}); }, ErrorCode::kInvalidArgument, "no ranks");
  expect_error([] { Topology::from_node_ids(std::vector<int>{0, -1}); }, ErrorCode::kInvalidArgument,
               "rank 1 has a negative node id -1");
  expect_error([] { Topology::from_node_ids(std::vector<int>{0, 0, 1}); }, ErrorCode::kUnsupported,
               "uneven nodes: node 0 has 2 ranks, node 1 (id 1) has 1");
  expect_error([] { Topology::from_node_ids(std::vector<int>(9, 3)); }, ErrorCode::kUnsupported,
               "node 0 (id 3) has 9 ranks; at most 8 per node");
  expect_error([] { Topology::blocks(0, 1); }, ErrorCode::kInvalidArgument, "world size 0 is not positive");
  expect_error([] { Topology::blocks(4, 0); }, ErrorCode::kInvalidArgument, "ranks per node 0 is not positive");
  expect_error([] { Topology::blocks(6, 4); }, ErrorCode::kUnsupported, "not a multiple of 4 ranks per node");
  expect_error([] { Topology::blocks(32, 16); }, ErrorCode::kUnsupported, "at most 8 per node");
  expect_error([] { Topology::force_inter(0); }, ErrorCode::kInvalidArgument, "world size 0");
}

TEST(Topology, InconsistentTorchrunEnvironmentIsRefused) {
  expect_error([] { Topology::from_torchrun(8, 8, 0, 4); }, ErrorCode::kInvalidArgument,
               "inconsistent torchrun environment: RANK=8 WORLD_SIZE=8");
  expect_error([] { Topology::from_torchrun(1, 8, 4, 4); }, ErrorCode::kInvalidArgument, "LOCAL_RANK=4");
  expect_error([] { Topology::from_torchrun(1, 6, 1, 4); }, ErrorCode::kUnsupported,
               "WORLD_SIZE is not a multiple of LOCAL_WORLD_SIZE");
  expect_error([] { Topology::from_torchrun(5, 8, 0, 4); }, ErrorCode::kUnsupported, "pass node ids explicitly");
  expect_error([] { Topology::from_torchrun(0, 8, 0, 4, 3); }, ErrorCode::kUnsupported, "would span two hosts");
  expect_error([] { Topology::from_torchrun(0, 8, 0, 4, -1); }, ErrorCode::kInvalidArgument, "is negative");
  expect_error([] { Topology::from_torchrun(0, 32, 0, 16); }, ErrorCode::kUnsupported, "at most 8 per node");
}

TEST(Topology, LookupsOutsideTheWorldThrow) {
  const Topology t = Topology::blocks(4, 2);
  expect_error([&] { t.place(4); }, ErrorCode::kOutOfRange, "rank 4 outside world size 4");
  expect_error([&] { t.place(-1); }, ErrorCode::kOutOfRange, "rank -1");
  expect_error([&] { t.rank_of(2, 0); }, ErrorCode::kOutOfRange, "(node 2, local rank 0) outside 2 nodes x 2");
}

}  // namespace
