// The thin post path over nvlink with GPU memory (the conformance suite, tests/transport/
// post_test.cpp, covers host memory): writes between two cuda regions, signals into a counter
// in the peer's GPU memory (a kernel on the post stream) and in its host memory (a frame its
// owner applies once our copies are done), and a GPU counter behind writes the owner executes.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "sluice/cuda.hpp"
#include "sluice/sluice.hpp"
#include "test_engine.hpp"

#ifdef SLUICE_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace sluice;
using namespace std::chrono_literals;
using sluice_test::quiet;

#ifdef SLUICE_TEST_CUDA
namespace {

#define NEED_GPU()                                                                                        \
  do {                                                                                                    \
    if (cuda::device_count() < 1)                                                                         \
      GTEST_SKIP() << "needs a CUDA device; have none: " << cuda::unavailable_reason();                   \
  } while (0)
#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x


int other_device() { return cuda::device_count() > 1 ? 1 : 0; }

uint64_t device_u64(const void* p) {
  uint64_t v = 0;
  if (cudaMemcpy(&v, p, 8, cudaMemcpyDeviceToHost) != cudaSuccess) return ~0ull;
  return v;
}

constexpr uint64_t kChunk = 64 << 10;
constexpr int kRounds = 48;

}  // namespace

// Writes and signals between two cuda regions: every byte lands, the counter adds up, and a
// reader that sees the counter at v finds chunks 0..v-1 complete.
TEST(NvlinkPost, GpuWritesAndGpuCounter) {
  NEED_GPU();
  Engine a(quiet()), b(quiet());
  const uint64_t n = kChunk * kRounds;
  auto src = a.allocate(n, Location::cuda(0));
  auto dst = b.allocate(n + 4096, Location::cuda(other_device()), "dst");
  CK(cudaMemset(dst.ptr, 0, n + 4096));
  std::vector<uint8_t> data(n);
  for (uint64_t k = 0; k < kRounds; ++k) std::memset(data.data() + k * kChunk, int(k + 1), kChunk);
  CK(cudaMemcpy(src.ptr, data.data(), n, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  Endpoint ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  ASSERT_TRUE(ep.capabilities().rma_post && ep.capabilities().signal);
  RemoteHandle r = *ep.remote_region("dst");
  const uint8_t* counter = static_cast<const uint8_t*>(dst.ptr) + n;

  std::atomic<bool> stop{false};
  std::atomic<int> bad{-1};
  std::thread reader([&] {
    if (cudaSetDevice(other_device()) != cudaSuccess) return;
    uint64_t seen = 0;
    std::vector<uint8_t> got(kChunk);
    while (!stop.load() && seen < kRounds) {
      uint64_t v = device_u64(counter);
      if (v == ~0ull || v > kRounds) {
        bad = 1000;
        return;
      }
      for (uint64_t k = seen; k < v; ++k) {
        if (cudaMemcpy(got.data(), static_cast<const uint8_t*>(dst.ptr) + k * kChunk, kChunk, cudaMemcpyDeviceToHost) !=
                cudaSuccess ||
            got.front() != uint8_t(k + 1) || got.back() != uint8_t(k + 1)) {
          bad = static_cast<int>(k);
          return;
        }
      }
      seen = v;
    }
  });
  for (uint64_t k = 0; k < kRounds; ++k) {
    ep.post_write(src.handle, k * kChunk, r, k * kChunk, kChunk);
    ep.post_signal(r, n, 1);
  }
  ep.flush();
  EXPECT_EQ(uint64_t(kRounds), device_u64(counter)) << "flush returned before every signal kernel ran";
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (device_u64(counter) < kRounds && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  stop = true;
  reader.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes were there";
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), dst.ptr, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
  // Signals with nothing before them, and large adds (the frame splits them; the kernel not).
  ep.post_signal(r, n, 1ull << 40);
  ep.post_signal(r, n, 2);
  ep.flush();
  EXPECT_EQ(uint64_t(kRounds) + (1ull << 40) + 2, device_u64(counter));
  // A caller error is refused at once and leaves nothing outstanding. (The region is as long
  // as its peer advertises: an engine allocation is rounded up to the allocation granularity.)
  uint64_t advertised = 0;
  for (const auto& info : ep.remote_regions())
    if (info.id == r.id) advertised = info.length;
  ASSERT_GE(advertised, n + 4096);
  EXPECT_THROW(ep.post_write(src.handle, 0, r, advertised - 4, 8), Error);
  ep.flush();
}

// GPU data, counter in the peer's host memory: the signal is a frame that must wait until
// the copies before it are done.
TEST(NvlinkPost, GpuWritesAndHostCounter) {
  NEED_GPU();
  Engine a(quiet()), b(quiet());
  const uint64_t n = kChunk * kRounds;
  auto src = a.allocate(n, Location::cuda(0));
  auto dst = b.allocate(n, Location::cuda(other_device()), "dst");
  alignas(64) static uint64_t host_counter[8];
  host_counter[0] = 0;
  b.register_memory(host_counter, sizeof(host_counter), Location::host(), "counter");
  std::vector<uint8_t> data(n);
  for (uint64_t k = 0; k < kRounds; ++k) std::memset(data.data() + k * kChunk, int(k + 7), kChunk);
  CK(cudaMemcpy(src.ptr, data.data(), n, cudaMemcpyHostToDevice));
  CK(cudaMemset(dst.ptr, 0, n));
  CK(cudaDeviceSynchronize());
  Endpoint ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  RemoteHandle r = *ep.remote_region("dst"), rc = *ep.remote_region("counter");
  std::atomic<bool> stop{false};
  std::atomic<int> bad{-1};
  std::thread reader([&] {
    if (cudaSetDevice(other_device()) != cudaSuccess) return;
    uint64_t seen = 0;
    uint8_t first = 0, last = 0;
    while (!stop.load() && seen < kRounds) {
      uint64_t v = __atomic_load_n(&host_counter[0], __ATOMIC_ACQUIRE);
      for (uint64_t k = seen; k < v && k < kRounds; ++k) {
        const uint8_t* c = static_cast<const uint8_t*>(dst.ptr) + k * kChunk;
        if (cudaMemcpy(&first, c, 1, cudaMemcpyDeviceToHost) != cudaSuccess ||
            cudaMemcpy(&last, c + kChunk - 1, 1, cudaMemcpyDeviceToHost) != cudaSuccess || first != uint8_t(k + 7) ||
            last != uint8_t(k + 7)) {
          bad = static_cast<int>(k);
          return;
        }
      }
      seen = v;
    }
  });
  for (uint64_t k = 0; k < kRounds; ++k) {
    ep.post_write(src.handle, k * kChunk, r, k * kChunk, kChunk);
    ep.post_signal(rc, 0, 1);
  }
  ep.flush();
  EXPECT_EQ(uint64_t(kRounds), __atomic_load_n(&host_counter[0], __ATOMIC_ACQUIRE));
  stop = true;
  reader.join();
  EXPECT_EQ(-1, bad.load()) << "the counter said chunk " << bad.load() << " had landed before its bytes were there";
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), dst.ptr, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
}

// Host data into the peer's plain host memory (its owner executes those writes), counter in
// its GPU memory: the kernel must wait for the owner's answers.
TEST(NvlinkPost, OwnerWritesAndGpuCounter) {
  NEED_GPU();
  Engine a(quiet()), b(quiet());
  const uint64_t n = 1 << 20;
  std::vector<uint8_t> src(n), plain(n, 0);
  for (uint64_t i = 0; i < n; ++i) src[i] = uint8_t(i * 13 + 1);
  auto hs = a.register_memory(src.data(), n);
  b.register_memory(plain.data(), n, Location::host(), "plain");
  auto sem = b.allocate(4096, Location::cuda(other_device()), "sem");
  CK(cudaMemset(sem.ptr, 0, 4096));
  CK(cudaDeviceSynchronize());
  Endpoint ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  RemoteHandle rp = *ep.remote_region("plain"), rs = *ep.remote_region("sem");
  for (uint64_t off = 0; off < n; off += kChunk) {
    ep.post_write(hs, off, rp, off, kChunk);
    ep.post_signal(rs, 8, 1);
  }
  ep.flush();
  EXPECT_EQ(n / kChunk, device_u64(static_cast<uint8_t*>(sem.ptr) + 8));
  EXPECT_EQ(0, std::memcmp(src.data(), plain.data(), n));
}

#endif  // SLUICE_TEST_CUDA
