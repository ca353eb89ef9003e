// The port channel driven by GPU threads (issue 13's GPU tests), for the GPU machine: the
// tutorial's bidirectional put-with-signal with the bytes checked, a ping-pong, 1,024 producer
// threads against a 64-entry FIFO, offsets and sizes beyond 4 GiB, and a peer killed while a
// kernel waits (the kernel gets kFailed). Skips without a GPU. Also meant for
// `compute-sanitizer --tool memcheck|racecheck`.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../transport/harness.hpp"
#include "gpu_pair.cuh"
#include "sluice/cuda.hpp"
#include "sluice/port_channel.hpp"
#include "sluice/sluice.hpp"

using namespace sluice;
using namespace sluice_test;
using namespace sluice_test_gpu;

namespace {

// Results a kernel reports: one int per step (0 = PortResult::kOk).
__global__ void put_signal_wait_flush(PortChannelDeviceHandle ch, uint64_t dst_off, uint64_t src_off, uint64_t n,
                                      int* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  out[0] = int(ch.put_with_signal(dst_off, src_off, n));
  out[1] = int(ch.wait());
  out[2] = int(ch.flush());
}

__global__ void ping(PortChannelDeviceHandle ch, int rounds, int* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int i = 0; i < rounds; ++i) {
    PortResult r = ch.put_with_signal(0, 0, 8);
    if (r == PortResult::kOk) r = ch.wait();
    if (r != PortResult::kOk) {
      out[0] = int(r);
      out[1] = i;
      return;
    }
  }
  out[0] = int(ch.flush());
  out[1] = rounds;
}

__global__ void pong(PortChannelDeviceHandle ch, int rounds, int* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  for (int i = 0; i < rounds; ++i) {
    PortResult r = ch.wait();
    if (r == PortResult::kOk) r = ch.put_with_signal(0, 0, 8);
    if (r != PortResult::kOk) {
      out[0] = int(r);
      out[1] = i;
      return;
    }
  }
  out[0] = int(ch.flush());
  out[1] = rounds;
}

// Every thread pushes one 8-byte put of its own slot plus a signal.
__global__ void many_producers(PortChannelDeviceHandle ch, int* out) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  out[t] = int(ch.put_with_signal(uint64_t(t) * 8, uint64_t(t) * 8, 8));
}

__global__ void flush_one(PortChannelDeviceHandle ch, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = int(ch.flush());
}

__global__ void wait_one(PortChannelDeviceHandle ch, uint64_t bound_ns, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = int(ch.wait(bound_ns));
}

TEST(PortChannelGpu, BidirectionalPutWithSignal) {
  NEED_GPU();
  constexpr uint64_t n = 128ull << 20;
  Pair p(n);
  int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<264, 512>>>(static_cast<uint8_t*>(p.ra.ptr), n, 1);
  int* out_a = nullptr;
  CK(cudaMalloc(&out_a, 3 * sizeof(int)));
  CK(cudaDeviceSynchronize());
  cudaSetDevice(db);
  fill<<<264, 512>>>(static_cast<uint8_t*>(p.rb.ptr), n, 2);
  int* out_b = nullptr;
  CK(cudaMalloc(&out_b, 3 * sizeof(int)));
  CK(cudaDeviceSynchronize());
  SideStream sa(da), sb(db);
  ASSERT_TRUE(sa.s && sb.s);
  cudaSetDevice(da);
  put_signal_wait_flush<<<1, 1, 0, sa>>>(p.ca.device_handle(), n, 0, n, out_a);
  cudaSetDevice(db);
  put_signal_wait_flush<<<1, 1, 0, sb>>>(p.cb.device_handle(), n, 0, n, out_b);
  CK(cudaDeviceSynchronize());
  cudaSetDevice(da);
  CK(cudaDeviceSynchronize());
  int ha[3], hb[3];
  CK(cudaMemcpy(ha, out_a, sizeof(ha), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb, out_b, sizeof(hb), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(0, ha[i]) << "a step " << i << ": " << p.ca.status().to_string() << stats_of(*p.pa);
    EXPECT_EQ(0, hb[i]) << "b step " << i << ": " << p.cb.status().to_string() << stats_of(*p.pb);
  }
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + n, n, 1, db)) << "a's bytes at b";
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.ra.ptr) + n, n, 2, da)) << "b's bytes at a";
  cudaFree(out_a);
  cudaFree(out_b);
}

TEST(PortChannelGpu, PingPong) {
  NEED_GPU();
  Pair p(4096);
  int da = 0, db = other_device();
  constexpr int kRounds = 1000;
  int *oa = nullptr, *ob = nullptr;
  cudaSetDevice(da);
  CK(cudaMalloc(&oa, 2 * sizeof(int)));
  cudaSetDevice(db);
  CK(cudaMalloc(&ob, 2 * sizeof(int)));
  SideStream sa(da), sb(db);
  ASSERT_TRUE(sa.s && sb.s);
  // Both kernels load before either runs: with one GPU, ping's lazy load would wait for pong,
  // which spins until ping answers (docs/port-channel.md: load kernels before they spin).
  cudaFuncAttributes attr;
  for (int d : {da, db}) {
    cudaSetDevice(d);
    CK(cudaFuncGetAttributes(&attr, ping));
    CK(cudaFuncGetAttributes(&attr, pong));
  }
  cudaSetDevice(db);
  pong<<<1, 1, 0, sb>>>(p.cb.device_handle(), kRounds, ob);
  cudaSetDevice(da);
  ping<<<1, 1, 0, sa>>>(p.ca.device_handle(), kRounds, oa);
  CK(cudaDeviceSynchronize());
  cudaSetDevice(db);
  CK(cudaDeviceSynchronize());
  int ha[2], hb[2];
  CK(cudaMemcpy(ha, oa, sizeof(ha), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb, ob, sizeof(hb), cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, ha[0]) << "ping stopped at round " << ha[1] << ": " << p.ca.status().to_string();
  EXPECT_EQ(0, hb[0]) << "pong stopped at round " << hb[1] << ": " << p.cb.status().to_string();
  EXPECT_EQ(kRounds, ha[1]);
  EXPECT_EQ(kRounds, hb[1]);
}

TEST(PortChannelGpu, ThousandProducersOnASixtyFourEntryFifo) {
  NEED_GPU();
  constexpr int kThreads = 1024;
  Pair p(kThreads * 8, /*depth=*/64);
  int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<8, 128>>>(static_cast<uint8_t*>(p.ra.ptr), kThreads * 8, 3);
  int* out = nullptr;
  CK(cudaMalloc(&out, (kThreads + 1) * sizeof(int)));
  // flush_one is launched while many_producers spins: under CUDA's lazy loading its load would
  // wait for the spinning kernel (and hold up the proxy's CUDA calls meanwhile). Load it first,
  // as docs/port-channel.md tells users to.
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, flush_one));
  many_producers<<<kThreads / 256, 256>>>(p.ca.device_handle(), out);
  flush_one<<<1, 1>>>(p.ca.device_handle(), out + kThreads);
  CK(cudaDeviceSynchronize());
  std::vector<int> h(kThreads + 1);
  CK(cudaMemcpy(h.data(), out, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
  for (int t = 0; t <= kThreads; ++t) ASSERT_EQ(0, h[t]) << "thread " << t << ": " << p.ca.status().to_string() << stats_of(*p.pa);
  // The data landed at b's offset 0 (dst offset = src offset), the counter counts every signal.
  EXPECT_EQ(0u, bad_bytes(p.rb.ptr, kThreads * 8, 3, db));
  uint64_t counter = 0;
  cudaSetDevice(db);
  CK(cudaMemcpy(&counter, static_cast<uint8_t*>(p.rb.ptr) + 2 * p.n, 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(uint64_t(kThreads), counter);
  cudaFree(out);
}

TEST(PortChannelGpu, OffsetsAndSizesBeyondFourGiB) {
  NEED_GPU();
  constexpr uint64_t n = (4ull << 30) + (64ull << 20);  // one put of 4 GiB + 64 MiB
  size_t free_b = 0, total = 0;
  cudaSetDevice(other_device());
  cudaMemGetInfo(&free_b, &total);
  if (free_b < 2 * (2 * n + 4096) + (1ull << 30)) GTEST_SKIP() << "needs about 18 GiB of free GPU memory";
  Pair p(n);
  int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<264, 512>>>(static_cast<uint8_t*>(p.ra.ptr), n, 4);
  int* out = nullptr;
  CK(cudaMalloc(&out, 3 * sizeof(int)));
  CK(cudaDeviceSynchronize());
  int* out_b = nullptr;
  cudaSetDevice(db);
  CK(cudaMalloc(&out_b, 3 * sizeof(int)));
  SideStream sa(da), sb(db);
  ASSERT_TRUE(sa.s && sb.s);
  // dst offset n (> 4 GiB) and size n (> 4 GiB) in one request; b signals back so wait() ends.
  cudaSetDevice(da);
  put_signal_wait_flush<<<1, 1, 0, sa>>>(p.ca.device_handle(), n, 0, n, out);
  cudaSetDevice(db);
  // (into a's destination half: a's source is being read by the big put meanwhile)
  put_signal_wait_flush<<<1, 1, 0, sb>>>(p.cb.device_handle(), n, 0, 8, out_b);
  CK(cudaDeviceSynchronize());
  cudaSetDevice(da);
  CK(cudaDeviceSynchronize());
  int h[3];
  CK(cudaMemcpy(h, out, sizeof(h), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(0, h[i]) << "step " << i << ": " << p.ca.status().to_string();
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + n, n, 4, db));
  cudaFree(out);
  cudaFree(out_b);
}

// A kernel waits on a channel whose peer (a forked child over tcp) is killed: wait() returns
// kFailed, the channel says kPeerLost. The child never touches CUDA.
TEST(PortChannelGpu, KilledPeerWhileAKernelWaits) {
  NEED_GPU();
  ChildConfig cfg;
  cfg.transport = "tcp";
  auto child = std::make_unique<Child>(cfg);
  ASSERT_FALSE(child->blob().empty());
  Engine engine(engine_config("tcp", 2, std::chrono::seconds(10)));
  std::vector<uint8_t> src(1 << 20, 1);
  MemoryHandle hs = engine.register_memory(src.data(), src.size());
  auto sem = engine.allocate(4096, Location::cuda(0), "sem");
  CK(cudaMemset(sem.ptr, 0, 4096));
  Endpoint ep = engine.connect(child->blob());
  RemoteHandle heap = *ep.remote_region("heap");
  ProxyOptions opt;
  opt.producers = ProducerKind::kCuda;
  ProxyService proxy(engine, opt);
  PortChannel ch = proxy.add_channel(ep, proxy.add_memory(ep, heap), proxy.add_memory(hs), {heap, 0}, {sem.handle, 0});
  proxy.start();
  int* out = nullptr;
  CK(cudaMalloc(&out, sizeof(int)));
  CK(cudaMemset(out, 0xff, sizeof(int)));
  wait_one<<<1, 1>>>(ch.device_handle(), 60'000'000'000ull, out);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  child->kill(SIGKILL);
  child->reap_killed();
  CK(cudaDeviceSynchronize());
  int h = -1;
  CK(cudaMemcpy(&h, out, sizeof(h), cudaMemcpyDeviceToHost));
  EXPECT_EQ(int(PortResult::kFailed), h) << "the kernel's wait() did not return kFailed";
  EXPECT_EQ(ErrorCode::kPeerLost, ch.status().code) << ch.status().to_string();
  cudaFree(out);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
