// plan_batch: every byte exactly once, order within lanes, chunk limit, striping, rotation.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "core/batch_plan.hpp"

using sluice::detail::Lane;
using sluice::detail::Piece;
using sluice::detail::plan_batch;
using sluice::detail::PlanOptions;

namespace {

uint8_t* const kBase = reinterpret_cast<uint8_t*>(uintptr_t(1) << 40);

// Checks the invariants every plan must satisfy and returns the lanes.
std::vector<Lane> checked_plan(const std::vector<Piece>& batch, const PlanOptions& opt) {
  auto lanes = plan_batch(batch, opt);
  EXPECT_EQ(lanes.size(), static_cast<size_t>(std::max(1, opt.channels)));
  // Every (local byte) of the input appears exactly once, with the matching remote byte.
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> covered;  // local start -> (length, remote start)
  for (const auto& lane : lanes) {
    uint64_t bytes = 0;
    for (const auto& p : lane.pieces) {
      EXPECT_GT(p.length, 0u);
      EXPECT_LE(p.length, opt.chunk_size) << "piece above the chunk limit";
      uint64_t off = p.local - kBase;
      EXPECT_TRUE(covered.emplace(off, std::make_pair(p.length, p.remote_offset)).second) << "duplicate piece";
      bytes += p.length;
    }
    EXPECT_EQ(bytes, lane.bytes);
  }
  // Rebuild the input coverage: the pieces must tile each input piece exactly.
  std::map<uint64_t, std::pair<uint64_t, uint64_t>> want;
  for (const auto& p : batch) want.emplace(p.local - kBase, std::make_pair(p.length, p.remote_offset));
  uint64_t total_in = 0, total_out = 0;
  for (auto& [off, lr] : want) total_in += lr.first;
  for (auto& [off, lr] : covered) total_out += lr.first;
  EXPECT_EQ(total_in, total_out);
  for (auto& [off, lr] : want) {
    uint64_t pos = off, end = off + lr.first;
    while (pos < end) {
      auto it = covered.find(pos);
      if (it == covered.end()) {
        ADD_FAILURE() << "byte " << pos << " not covered";
        break;
      }
      EXPECT_EQ(it->second.second, lr.second + (pos - off)) << "remote offset does not follow local offset";
      pos += it->second.first;
    }
    EXPECT_EQ(pos, end) << "pieces overrun an input piece";
  }
  return lanes;
}

std::vector<Piece> batch_of(const std::vector<uint64_t>& lengths) {
  std::vector<Piece> b;
  uint64_t off = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    Piece p;
    p.local = kBase + off;
    p.remote_id = i + 1;
    p.remote_offset = 1000000 + off * 3;  // distinct, not equal to local offsets
    p.remote_addr = 0x7000000000ull + p.remote_offset;
    p.length = lengths[i];
    b.push_back(p);
    off += lengths[i] + 17;  // gaps between pieces
  }
  return b;
}

TEST(BatchPlan, SmallBatchStaysOnOneChannel) {
  PlanOptions opt;
  opt.channels = 4;
  opt.stripe_threshold = 256 << 10;
  auto lanes = checked_plan(batch_of({1000, 2000, 3000}), opt);
  int used = 0;
  for (auto& l : lanes) used += !l.pieces.empty();
  EXPECT_EQ(used, 1);
  EXPECT_EQ(lanes[0].pieces.size(), 3u);
  // Exactly at the threshold: still unstriped.
  lanes = checked_plan(batch_of({opt.stripe_threshold}), opt);
  used = 0;
  for (auto& l : lanes) used += !l.pieces.empty();
  EXPECT_EQ(used, 1);
}

TEST(BatchPlan, RotationPicksTheChannelForUnstripedBatches) {
  PlanOptions opt;
  opt.channels = 3;
  for (unsigned r = 0; r < 7; ++r) {
    opt.rotate = r;
    auto lanes = checked_plan(batch_of({100, 200}), opt);
    for (int c = 0; c < 3; ++c) EXPECT_EQ(lanes[c].pieces.empty(), c != static_cast<int>(r % 3)) << "rotate " << r;
  }
}

TEST(BatchPlan, LargeBatchIsStripedOverAllChannels) {
  PlanOptions opt;
  opt.channels = 4;
  opt.chunk_size = 1 << 20;
  auto lanes = checked_plan(batch_of({16u << 20}), opt);
  for (auto& l : lanes) {
    EXPECT_FALSE(l.pieces.empty());
    EXPECT_NEAR(static_cast<double>(l.bytes), 4.0 * (1 << 20), 1 << 20);
  }
}

TEST(BatchPlan, ChunkLimitHonouredWithoutStriping) {
  PlanOptions opt;
  opt.channels = 1;
  opt.chunk_size = 4096;
  auto lanes = checked_plan(batch_of({4096 * 5 + 1, 1, 4095}), opt);
  ASSERT_EQ(lanes.size(), 1u);
  EXPECT_EQ(lanes[0].pieces.size(), 6u + 1 + 1);
}

TEST(BatchPlan, OrderWithinLanesFollowsBatchOrder) {
  PlanOptions opt;
  opt.channels = 3;
  opt.chunk_size = 64 << 10;
  opt.min_piece = 4096;
  auto batch = batch_of({300000, 5, 700000, 123456, 99});
  auto lanes = checked_plan(batch, opt);
  for (auto& l : lanes)
    for (size_t i = 1; i < l.pieces.size(); ++i) EXPECT_LT(l.pieces[i - 1].local, l.pieces[i].local) << "lane order broken";
}

TEST(BatchPlan, RemoteAddrFollowsOffsetAndZeroStaysZero) {
  PlanOptions opt;
  opt.channels = 2;
  opt.chunk_size = 4096;
  auto batch = batch_of({20000});
  batch[0].remote_addr = 0;
  for (auto& l : checked_plan(batch, opt))
    for (auto& p : l.pieces) EXPECT_EQ(p.remote_addr, 0u);
  batch = batch_of({20000});
  for (auto& l : checked_plan(batch, opt))
    for (auto& p : l.pieces) EXPECT_EQ(p.remote_addr, batch[0].remote_addr + (p.remote_offset - batch[0].remote_offset));
}

TEST(BatchPlan, StripingNeverCutsBelowMinPiece) {
  PlanOptions opt;
  opt.channels = 8;
  opt.chunk_size = 4 << 20;
  opt.stripe_threshold = 1024;
  opt.min_piece = 64 << 10;
  auto lanes = checked_plan(batch_of({1 << 20}), opt);
  for (auto& l : lanes)
    for (auto& p : l.pieces) EXPECT_GE(p.length, 64u << 10);
}

TEST(BatchPlan, RandomisedInvariants) {
  std::mt19937_64 rng(12345);
  for (int iter = 0; iter < 300; ++iter) {
    PlanOptions opt;
    opt.channels = 1 + rng() % 8;
    opt.chunk_size = 4096ull << (rng() % 8);
    opt.stripe_threshold = 1ull << (10 + rng() % 12);
    opt.min_piece = std::min<uint64_t>(64 << 10, opt.chunk_size);
    opt.rotate = static_cast<unsigned>(rng());
    std::vector<uint64_t> lens(1 + rng() % 12);
    for (auto& l : lens) l = 1 + rng() % (1ull << (rng() % 22));
    SCOPED_TRACE("iteration " + std::to_string(iter));
    auto lanes = checked_plan(batch_of(lens), opt);
    uint64_t total = 0;
    for (auto l : lens) total += l;
    int used = 0;
    for (auto& l : lanes) used += !l.pieces.empty();
    if (total <= opt.stripe_threshold || opt.channels == 1) {
      EXPECT_EQ(used, 1);
    }
    for (auto& l : lanes)
      for (size_t i = 1; i < l.pieces.size(); ++i) EXPECT_LT(l.pieces[i - 1].local, l.pieces[i].local);
  }
}

TEST(BatchPlan, ZeroChannelsTreatedAsOne) {
  PlanOptions opt;
  opt.channels = 0;
  auto lanes = plan_batch(batch_of({100}), opt);
  ASSERT_EQ(lanes.size(), 1u);
  EXPECT_EQ(lanes[0].bytes, 100u);
}

}  // namespace
