// Stream-ordered send/recv (include/sluice/stream_p2p.hpp): two ranks in this process, one
// thread each, on two GPUs (or both on one). Skip cleanly without a GPU, except the check of
// how construction fails there.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "sluice/cuda.hpp"
#include "sluice/stream_p2p.hpp"

#ifdef SLUICE_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace sluice;
using namespace std::chrono_literals;

TEST(StreamP2pNoDevice, ConstructionFailsCleanly) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  try {
    cuda::StreamP2p p(0, {1}, 0);
    FAIL() << "StreamP2p without a GPU should throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNoDevice) << e.what();
  }
}

#ifdef SLUICE_TEST_CUDA
// A named namespace: the CI builds tests as unity batches, beside cuda_test.cpp's helpers.
namespace stream_p2p_test {

#define NEED_GPU()                                                                                                  \
  do {                                                                                                              \
    if (cuda::device_count() < 1) GTEST_SKIP() << "needs a CUDA device: " << cuda::unavailable_reason();           \
  } while (0)

int dev_of(int r) { return cuda::device_count() > 1 ? r : 0; }

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  return v;
}

// A pair of connected objects, small rings so that large messages wrap them many times.
struct Pair {
  std::unique_ptr<cuda::StreamP2p> p[2];
  explicit Pair(cuda::StreamP2pOptions o = {4, 2, 64 << 10}) {
    for (int r = 0; r < 2; ++r) p[r] = std::make_unique<cuda::StreamP2p>(r, std::vector<int>{1 - r}, dev_of(r), o);
    const std::string h0 = p[0]->handle(), h1 = p[1]->handle();
    p[0]->connect(1, h1);
    p[1]->connect(0, h0);
  }
};

struct Bufs {
  uint8_t* in = nullptr;
  uint8_t* out = nullptr;
  cudaStream_t s = nullptr;
  int dev = 0;
  Bufs(int device, size_t n) : dev(device) {
    cudaSetDevice(dev);
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaMalloc(reinterpret_cast<void**>(&in), n);
    cudaMalloc(reinterpret_cast<void**>(&out), n);
  }
  ~Bufs() {
    cudaSetDevice(dev);
    cudaStreamSynchronize(s);
    cudaFree(in);
    cudaFree(out);
    cudaStreamDestroy(s);
  }
};

// Both directions at once, sizes from 8 bytes to many times the ring, queued back to back and
// replayed from a CUDA graph; every byte checked.
TEST(StreamP2p, BothDirectionsEveryByteAndGraph) {
  NEED_GPU();
  Pair pr;
  const std::vector<size_t> sizes = {8, 1000, (16 << 10) + 16, 1 << 20, (3 << 20) + 48, 16 << 20};
  const size_t most = 16 << 20;
  std::string errors[2];
  auto run = [&](int r) {
    Bufs b(dev_of(r), most);
    // A second stream for the recvs: a rank's send larger than the ring completes only while
    // the peer's recv runs, and both ranks send first.
    cudaStream_t rs;
    cudaStreamCreateWithFlags(&rs, cudaStreamNonBlocking);
    for (int graph = 0; graph < 2 && errors[r].empty(); ++graph) {
      for (size_t n : sizes) {
        auto mine = pattern(n, uint32_t(r * 77 + n));
        cudaMemcpy(b.in, mine.data(), n, cudaMemcpyHostToDevice);
        cudaMemset(b.out, 0xEE, n);
        cudaDeviceSynchronize();
        if (graph) {
          cudaGraph_t g[2];
          cudaGraphExec_t x[2];
          cudaStreamBeginCapture(b.s, cudaStreamCaptureModeThreadLocal);
          pr.p[r]->send(1 - r, b.in, n, b.s, 7);
          cudaStreamEndCapture(b.s, &g[0]);
          cudaStreamBeginCapture(rs, cudaStreamCaptureModeThreadLocal);
          pr.p[r]->recv(1 - r, b.out, n, rs, 7);
          cudaStreamEndCapture(rs, &g[1]);
          for (int k = 0; k < 2; ++k) cudaGraphInstantiate(&x[k], g[k], 0);
          for (int k = 0; k < 3; ++k) {
            cudaGraphLaunch(x[0], b.s);
            cudaGraphLaunch(x[1], rs);
          }
          cudaStreamSynchronize(b.s);
          cudaStreamSynchronize(rs);
          for (int k = 0; k < 2; ++k) {
            cudaGraphExecDestroy(x[k]);
            cudaGraphDestroy(g[k]);
          }
        } else {
          for (int k = 0; k < 3; ++k) {
            pr.p[r]->send(1 - r, b.in, n, b.s, 7);
            pr.p[r]->recv(1 - r, b.out, n, rs, 7);
          }
        }
        if (cudaStreamSynchronize(b.s) != cudaSuccess || cudaStreamSynchronize(rs) != cudaSuccess) {
          errors[r] = "cuda error";
          break;
        }
        std::vector<uint8_t> got(n);
        cudaMemcpy(got.data(), b.out, n, cudaMemcpyDeviceToHost);
        if (got != pattern(n, uint32_t((1 - r) * 77 + n))) {
          errors[r] = "wrong bytes at " + std::to_string(n) + (graph ? " (graph)" : "");
          break;
        }
        if (!pr.p[r]->status().ok()) {
          errors[r] = pr.p[r]->status().to_string();
          break;
        }
      }
    }
    cudaStreamDestroy(rs);
  };
  std::thread t0(run, 0), t1(run, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A recv queued for another size or tag than the message that comes delivers nothing of it,
// says so, and both sides refuse further calls instead of hanging.
TEST(StreamP2p, MismatchStopsBothSides) {
  NEED_GPU();
  for (bool tag : {false, true}) {
    Pair pr;
    pr.p[0]->set_timeout(10s);
    pr.p[1]->set_timeout(10s);
    Bufs a(dev_of(0), 1 << 20), b(dev_of(1), 1 << 20);
    cudaSetDevice(b.dev);
    cudaMemset(b.out, 0x5A, 1 << 20);
    cudaDeviceSynchronize();
    cudaSetDevice(a.dev);
    pr.p[0]->send(1, a.in, 1 << 20, a.s, 1);
    cudaSetDevice(b.dev);
    pr.p[1]->recv(0, b.out, tag ? 1 << 20 : 1 << 19, b.s, tag ? 2 : 1);
    ASSERT_EQ(cudaStreamSynchronize(b.s), cudaSuccess);
    Status st = pr.p[1]->status();
    EXPECT_EQ(st.code, ErrorCode::kProtocol) << st.to_string();
    EXPECT_NE(st.message.find(tag ? "(tag 1)" : "1048576 bytes"), std::string::npos) << st.message;
    std::vector<uint8_t> got(1 << 20);
    cudaMemcpy(got.data(), b.out, got.size(), cudaMemcpyDeviceToHost);
    EXPECT_EQ(got, std::vector<uint8_t>(1 << 20, 0x5A)) << "a mismatched message must deliver nothing";
    EXPECT_THROW(pr.p[1]->recv(0, b.out, 64, b.s), Error);
    // The sender's send (larger than the ring) stopped on the peer's word, well before its
    // 10 s timeout, and it refuses the next one.
    cudaSetDevice(a.dev);
    ASSERT_EQ(cudaStreamSynchronize(a.s), cudaSuccess);
    EXPECT_EQ(pr.p[0]->status().code, ErrorCode::kRemoteError) << pr.p[0]->status().to_string();
    EXPECT_THROW(pr.p[0]->send(1, a.in, 64, a.s), Error);
  }
}

// A recv whose sender never comes ends at the timeout; without a timeout, abort() ends it.
TEST(StreamP2p, SilentPeerTimesOutOrIsAborted) {
  NEED_GPU();
  {
    Pair pr;
    pr.p[1]->set_timeout(300ms);
    Bufs b(dev_of(1), 1 << 20);
    const auto t0 = std::chrono::steady_clock::now();
    pr.p[1]->recv(0, b.out, 1 << 20, b.s);
    ASSERT_EQ(cudaStreamSynchronize(b.s), cudaSuccess);
    EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
    EXPECT_EQ(pr.p[1]->status().code, ErrorCode::kTimeout) << pr.p[1]->status().to_string();
  }
  {
    Pair pr;
    Bufs b(dev_of(1), 1 << 20);
    pr.p[1]->recv(0, b.out, 1 << 20, b.s);
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(cudaStreamQuery(b.s), cudaErrorNotReady) << "the recv should still wait for its sender";
    pr.p[1]->abort();
    ASSERT_EQ(cudaStreamSynchronize(b.s), cudaSuccess);
    EXPECT_EQ(pr.p[1]->status().code, ErrorCode::kCancelled);
  }
}

TEST(StreamP2p, RefusesBadHandlesAndPeers) {
  NEED_GPU();
  cuda::StreamP2p a(0, {1}, dev_of(0), {4, 2, 64 << 10});
  cuda::StreamP2p b(1, {0}, dev_of(1), {4, 2, 64 << 10});
  cuda::StreamP2p other(1, {0}, dev_of(1), {8, 2, 64 << 10});
  cuda::StreamP2p stranger(2, {3}, dev_of(1), {4, 2, 64 << 10});
  EXPECT_THROW(a.connect(2, b.handle()), Error);               // not a peer
  EXPECT_THROW(a.connect(1, stranger.handle()), Error);        // rank 2's handle
  EXPECT_THROW(a.connect(1, other.handle()), Error);           // other settings
  EXPECT_THROW(a.connect(1, "00ff"), Error);                   // malformed
  std::string forged = b.handle();
  forged[66] = forged[66] == '0' ? '1' : '0';                  // another pointer in this process
  EXPECT_THROW(a.connect(1, forged), Error);
  EXPECT_THROW(a.send(1, nullptr, 64, nullptr), Error);        // not connected
  EXPECT_THROW(cuda::StreamP2p(0, {0}, dev_of(0)), Error);     // itself
  EXPECT_THROW(cuda::StreamP2p(0, {1, 1}, dev_of(0)), Error);  // twice
  a.connect(1, b.handle());
  EXPECT_TRUE(a.connected(1));
}
}  // namespace stream_p2p_test
#endif
