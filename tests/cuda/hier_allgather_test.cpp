// The hierarchical AllGather (include/sluice/hier_allgather.hpp) with every rank a thread of
// this process: forced inter-node (every rank its own "node", tcp through the port channel
// proxy), 2 nodes x 2 when 4 GPUs exist, CUDA-graph replays, and a rank that goes away
// mid-run (the other must report an error within the timeout, not hang). Skips without a GPU.
#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
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
//
// Every rank sets up (streams, device and pinned buffers, graph instantiation: calls that may
// wait for the whole device) before a barrier, moves bytes only with async copies of pinned
// memory while the calls run, and tears down after a second barrier: no rank's CUDA call waits
// for a kernel that is itself waiting for that rank. (Each rank has its own GPU: two on one GPU
// in one process are refused, see HierAllGather's constructor.)
void run_and_check(Group& g, uint64_t bytes, int calls, bool graph) {
  const int world = static_cast<int>(g.ranks.size());
  std::vector<std::string> errs(world);
  std::barrier set_up(world), finished(world);
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r)
    ts.emplace_back([&, r] {
      auto fail = [&](const std::string& what) {
        if (errs[r].empty()) errs[r] = what;
      };
      cudaSetDevice(g.device[r]);
      cudaStream_t s = nullptr;
      uint8_t *in = nullptr, *out = nullptr, *host = nullptr, *got = nullptr, *sentinel = nullptr;
      cudaGraphExec_t exec = nullptr;
      if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&in), bytes) != cudaSuccess ||
          cudaMalloc(reinterpret_cast<void**>(&out), bytes * world) != cudaSuccess ||
          cudaHostAlloc(reinterpret_cast<void**>(&host), bytes, cudaHostAllocDefault) != cudaSuccess ||
          cudaHostAlloc(reinterpret_cast<void**>(&got), bytes * world, cudaHostAllocDefault) != cudaSuccess ||
          cudaHostAlloc(reinterpret_cast<void**>(&sentinel), bytes * world, cudaHostAllocDefault) != cudaSuccess)
        fail("cuda setup");
      else
        std::memset(sentinel, 0xee, bytes * world);
      if (graph && errs[r].empty()) {
        cudaGraph_t gr = nullptr;
        try {
          if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) != cudaSuccess) throw std::runtime_error("capture");
          g.ranks[r]->all_gather_bytes(in, out, bytes, s);
          if (cudaStreamEndCapture(s, &gr) != cudaSuccess) throw std::runtime_error("end capture");
          if (cudaGraphInstantiate(&exec, gr, 0) != cudaSuccess) throw std::runtime_error("instantiate");
          if (cudaGraphUpload(exec, s) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess)
            throw std::runtime_error("upload");
        } catch (const std::exception& e) {
          fail(std::string("graph: ") + e.what());
        }
        if (gr) cudaGraphDestroy(gr);
      }
      set_up.arrive_and_wait();
      for (int c = 0; c < calls && errs[r].empty(); ++c) {
        for (uint64_t i = 0; i < bytes; ++i) host[i] = pattern(r, c, i);
        cudaMemcpyAsync(in, host, bytes, cudaMemcpyHostToDevice, s);
        cudaMemcpyAsync(out, sentinel, bytes * world, cudaMemcpyHostToDevice, s);  // not cudaMemsetAsync: above
        try {
          if (!graph) g.ranks[r]->all_gather_bytes(in, out, bytes, s);
          else if (cudaGraphLaunch(exec, s) != cudaSuccess) throw std::runtime_error("graph launch");
        } catch (const std::exception& e) {
          fail(std::string("call ") + std::to_string(c) + ": " + e.what());
          break;
        }
        if (cudaMemcpyAsync(got, out, bytes * world, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
            cudaStreamSynchronize(s) != cudaSuccess) {
          fail("sync");
          break;
        }
        Status st = g.ranks[r]->status();
        if (!st.ok()) {
          fail("call " + std::to_string(c) + ": " + st.to_string());
          break;
        }
        for (int q = 0; q < world && errs[r].empty(); ++q)
          for (uint64_t i = 0; i < bytes; ++i)
            if (got[q * bytes + i] != pattern(q, c, i)) {
              fail("call " + std::to_string(c) + ": slot " + std::to_string(q) + " byte " + std::to_string(i) + " is " +
                   std::to_string(got[q * bytes + i]) + ", expected " + std::to_string(pattern(q, c, i)));
              break;
            }
      }
      finished.arrive_and_wait();
      if (exec) cudaGraphExecDestroy(exec);
      cudaFree(in);
      cudaFree(out);
      cudaFreeHost(host);
      cudaFreeHost(got);
      cudaFreeHost(sentinel);
      cudaStreamDestroy(s);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errs[r], "") << "rank " << r << ", " << bytes << " bytes, graph " << graph;
}

TEST(HierAllGather, ForcedInterTwoRanksEagerAndGraph) {
  HIER_NEED_GPUS(2);
  Group g;
  make_group(g, 2, {0, 1}, 1 << 20, std::chrono::seconds(20));
  ASSERT_EQ(g.ranks[0]->nodes(), 2);
  EXPECT_EQ(g.ranks[0]->transport(), "tcp");
  for (uint64_t b : {1ull, 13ull, 1024ull, 65536ull + 3, 1ull << 20}) run_and_check(g, b, 6, false);
  run_and_check(g, 4096, 12, true);
  run_and_check(g, 1000, 3, false);  // eager again after graph replays: the counters agree
}

TEST(HierAllGather, ForcedInterFourRanks) {
  HIER_NEED_GPUS(4);
  Group g;
  make_group(g, 4, {0, 1, 2, 3}, 256 << 10, std::chrono::seconds(20));
  for (uint64_t b : {8ull, 4097ull, 256ull << 10}) run_and_check(g, b, 4, false);
  run_and_check(g, 2048, 8, true);
  run_and_check(g, 4097, 3, false);
}

// A second rank on a GPU that already has one in this process is refused, naming the GPU; once
// the first is gone the GPU can be used again.
TEST(HierAllGather, TwoRanksOnOneGpuInOneProcessAreRefused) {
  HIER_NEED_GPUS(1);
  auto first = std::make_unique<cuda::HierAllGather>(4096, 2, 0, 0, std::vector<int>{0, 1});
  try {
    cuda::HierAllGather second(4096, 2, 1, 0, {0, 1});
    ADD_FAILURE() << "a second rank on cuda:0 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuda:0 already has a rank in this process"), std::string::npos) << e.what();
  }
  first.reset();
  EXPECT_NO_THROW(cuda::HierAllGather again(4096, 2, 1, 0, {0, 1}));
}

TEST(HierAllGather, TwoNodesOfTwo) {
  HIER_NEED_GPUS(4);
  Group g;
  make_group(g, 4, {0, 0, 1, 1}, 1 << 20, std::chrono::seconds(20));
  ASSERT_EQ(g.ranks[0]->ranks_per_node(), 2);
  for (uint64_t b : {16ull, 1001ull, 300000ull, 1ull << 20}) run_and_check(g, b, 4, false);
  run_and_check(g, 8192, 8, true);
  // The first group goes before the second is built: each GPU takes one rank per process.
  g.ranks.clear();
  // Interleaved nodes: ranks 0 and 2 on one node.
  Group h;
  make_group(h, 4, {5, 9, 5, 9}, 4096, std::chrono::seconds(20));
  run_and_check(h, 4096, 4, false);
}

TEST(HierAllGather, OversizeCallIsRefused) {
  HIER_NEED_GPUS(2);
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
  HIER_NEED_GPUS(2);
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
