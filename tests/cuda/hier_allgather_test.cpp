// The hierarchical AllGather (include/sluice/hier_allgather.hpp) with every rank a thread of
// this process: forced inter-node (every rank its own "node", tcp through the port channel
// proxy), 2 nodes x 2 when 4 GPUs exist, CUDA-graph replays, and a rank that goes away
// mid-run (the other must report an error within the timeout, not hang). Skips without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "sluice/cuda.hpp"
#include "sluice/hier_allgather.hpp"

#if defined(SLUICE_TEST_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace hier_gpu_test {

using namespace sluice;

#define HIER_NEED_GPUS(n)                                                                          \
  do {                                                                                             \
    if (cuda::device_count() < (n))                                                                \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s); have " << cuda::device_count() << ": "   \
                   << cuda::unavailable_reason();                                                  \
  } while (0)

TEST(HierAllGather, NoGpuIsReportedClearly) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  try {
    cuda::HierAllGather h(1024, 2, 0, 0, {0, 1});
    ADD_FAILURE() << "constructed without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice) << e.what();
  }
}

#if defined(SLUICE_TEST_CUDA)

#define HCK(x) ASSERT_EQ((x), cudaSuccess) << #x

uint8_t pattern(int rank, int call, uint64_t i) { return uint8_t(rank * 31 + call * 7 + i * 13 + 1); }

struct Group {
  std::vector<std::unique_ptr<cuda::HierAllGather>> ranks;
  std::vector<int> device;
};

// Builds and connects `world` ranks (ranks construct and connect on threads: connect is collective).
void make_group(Group& g, int world, const std::vector<int>& nodes, uint64_t max_bytes, std::chrono::milliseconds timeout) {
  const int ndev = cuda::device_count();
  g.ranks.resize(world);
  g.device.resize(world);
  cuda::HierAllGatherOptions o;
  o.transport = "tcp";
  o.timeout = timeout;
  for (int r = 0; r < world; ++r) {
    g.device[r] = r % ndev;
    g.ranks[r] = std::make_unique<cuda::HierAllGather>(max_bytes, world, r, g.device[r], nodes, o);
  }
  std::vector<std::string> hs;
  for (auto& h : g.ranks) hs.push_back(h->handle());
  std::vector<std::thread> ts;
  std::vector<std::string> errs(world);
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      try {
        g.ranks[r]->connect(hs);
      } catch (const std::exception& e) {
        errs[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) ASSERT_EQ(errs[r], "") << "rank " << r;
}

// `calls` calls of `bytes` per rank on every rank (one thread and one stream each), eager or
// as replays of one captured graph; every output checked against the rank-major expectation.
void run_and_check(Group& g, uint64_t bytes, int calls, bool graph) {
  const int world = static_cast<int>(g.ranks.size());
  std::vector<std::string> errs(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto fail = [&](const std::string& what) { errs[r] = what; };
      cudaSetDevice(g.device[r]);
      cudaStream_t s = nullptr;
      uint8_t *in = nullptr, *out = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess || cudaMalloc(reinterpret_cast<void**>(&in), bytes) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&out), bytes * world) != cudaSuccess)
        return fail("cuda setup");
      cudaGraphExec_t exec = nullptr;
      std::vector<uint8_t> host(bytes), got(bytes * world);
      for (int c = 0; c < calls && errs[r].empty(); ++c) {
        for (uint64_t i = 0; i < bytes; ++i) host[i] = pattern(r, c, i);
        cudaMemcpyAsync(in, host.data(), bytes, cudaMemcpyHostToDevice, s);
        cudaMemsetAsync(out, 0xee, bytes * world, s);
        try {
          if (!graph) {
            g.ranks[r]->all_gather_bytes(in, out, bytes, s);
          } else {
            if (!exec) {
              cudaGraph_t gr = nullptr;
              if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return fail("capture");
              g.ranks[r]->all_gather_bytes(in, out, bytes, s);
              if (cudaStreamEndCapture(s, &gr) != cudaSuccess) return fail("end capture");
              if (cudaGraphInstantiate(&exec, gr, 0) != cudaSuccess) return fail("instantiate");
              cudaGraphDestroy(gr);
            }
            if (cudaGraphLaunch(exec, s) != cudaSuccess) return fail("graph launch");
          }
        } catch (const std::exception& e) {
          return fail(std::string("call ") + std::to_string(c) + ": " + e.what());
        }
        if (cudaMemcpyAsync(got.data(), out, bytes * world, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
            cudaStreamSynchronize(s) != cudaSuccess)
          return fail("sync");
        Status st = g.ranks[r]->status();
        if (!st.ok()) return fail(st.to_string());
        for (int q = 0; q < world; ++q)
          for (uint64_t i = 0; i < bytes; ++i)
            if (got[q * bytes + i] != pattern(q, c, i))
              return fail("call " + std::to_string(c) + ": slot " + std::to_string(q) + " byte " + std::to_string(i) +
                          " is " + std::to_string(got[q * bytes + i]) + ", expected " + std::to_string(pattern(q, c, i)));
      }
      if (exec) cudaGraphExecDestroy(exec);
      cudaFree(in);
      cudaFree(out);
      cudaStreamDestroy(s);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errs[r], "") << "rank " << r << ", " << bytes << " bytes, graph " << graph;
}

TEST(HierAllGather, ForcedInterTwoRanksEagerAndGraph) {
  HIER_NEED_GPUS(1);  // two ranks may share a GPU: the network side is host memory and tcp
  Group g;
  make_group(g, 2, {0, 1}, 1 << 20, std::chrono::seconds(20));
  ASSERT_EQ(g.ranks[0]->nodes(), 2);
  EXPECT_EQ(g.ranks[0]->transport(), "tcp");
  for (uint64_t b : {1ull, 13ull, 1024ull, 65536ull + 3, 1ull << 20}) run_and_check(g, b, 6, false);
  run_and_check(g, 4096, 12, true);
  run_and_check(g, 1000, 3, false);  // eager again after graph replays: the counters agree
}

TEST(HierAllGather, ForcedInterFourRanks) {
  HIER_NEED_GPUS(2);
  Group g;
  make_group(g, 4, {0, 1, 2, 3}, 256 << 10, std::chrono::seconds(20));
  for (uint64_t b : {8ull, 4097ull, 256ull << 10}) run_and_check(g, b, 4, false);
  // Graph replays only with a GPU per rank. With two ranks per GPU in this one process (one CUDA
  // context per GPU), replays stalled until the timeout in 5 of 6 runs on 2 x H200 (2026-11-28;
  // eager calls and the two-rank graph test pass there): not understood yet, docs/gpu.md.
  if (cuda::device_count() >= 4) run_and_check(g, 2048, 8, true);
}

TEST(HierAllGather, TwoNodesOfTwo) {
  HIER_NEED_GPUS(4);
  Group g;
  make_group(g, 4, {0, 0, 1, 1}, 1 << 20, std::chrono::seconds(20));
  ASSERT_EQ(g.ranks[0]->ranks_per_node(), 2);
  for (uint64_t b : {16ull, 1001ull, 300000ull, 1ull << 20}) run_and_check(g, b, 4, false);
  run_and_check(g, 8192, 8, true);
  // Interleaved nodes: ranks 0 and 2 on one node.
  Group h;
  make_group(h, 4, {5, 9, 5, 9}, 4096, std::chrono::seconds(20));
  run_and_check(h, 4096, 4, false);
}

TEST(HierAllGather, OversizeCallIsRefused) {
  HIER_NEED_GPUS(1);
  Group g;
  make_group(g, 2, {0, 1}, 4096, std::chrono::seconds(5));
  try {
    g.ranks[0]->all_gather_bytes(nullptr, nullptr, 4097, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfRange) << e.what();
  }
}

// Rank 1 goes away (its engine closes) after a good call; rank 0's next call must end within
// the timeout with an error that status() / the following call report.
TEST(HierAllGather, APeerThatGoesAwayFailsTheCallNotHangs) {
  HIER_NEED_GPUS(1);
  Group g;
  make_group(g, 2, {0, 1}, 4096, std::chrono::seconds(3));
  run_and_check(g, 4096, 2, false);
  g.ranks[1].reset();
  HCK(cudaSetDevice(g.device[0]));
  cudaStream_t s = nullptr;
  HCK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  uint8_t *in = nullptr, *out = nullptr;
  HCK(cudaMalloc(reinterpret_cast<void**>(&in), 4096));
  HCK(cudaMalloc(reinterpret_cast<void**>(&out), 2 * 4096));
  auto t0 = std::chrono::steady_clock::now();
  bool threw = false;
  try {
    g.ranks[0]->all_gather_bytes(in, out, 4096, s);
  } catch (const Error&) {
    threw = true;  // the proxy may already have failed the channel
  }
  HCK(cudaStreamSynchronize(s));
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(secs, 15.0) << "the call took " << secs << " s";
  Status st = g.ranks[0]->status();
  EXPECT_FALSE(st.ok()) << "no error after the peer went away";
  EXPECT_TRUE(st.code == ErrorCode::kPeerLost || st.code == ErrorCode::kTimeout || st.code == ErrorCode::kClosed)
      << st.to_string();
  if (!threw) {
    try {
      g.ranks[0]->all_gather_bytes(in, out, 4096, s);
      ADD_FAILURE() << "the call after the failure did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("HierAllGather rank 0"), std::string::npos) << e.what();
    }
  }
  cudaFree(in);
  cudaFree(out);
  cudaStreamDestroy(s);
}

#endif  // SLUICE_TEST_CUDA

}  // namespace hier_gpu_test
