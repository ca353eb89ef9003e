// The batched nvlink post path under the port channel, for the GPU machine: the proxy pops
// what the FIFO holds and posts it with one Endpoint::post_batch, which nvlink turns into one
// kernel (small puts as SM copies, the signals after them) with large puts on the copy engine.
// Checked here: many GPU threads' small put+signals land with every byte right; a reader on
// the peer GPU that sees a signal sees every put before it (small, SM-copied, and large,
// copy-engine, in one batch); a request out of range inside a batch fails its channel only;
// Endpoint::post_batch over nvlink directly. Skips without a GPU (gpu_pair.cuh).
#include <cstring>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cuda/atomic>
#include <string>
#include <vector>

#include "gpu_pair.cuh"

using namespace sluice;
using namespace sluice_test_gpu;

namespace {

constexpr uint64_t kSmall = 4096;          // under nvlink.post_sm_copy_max: an SM copy
constexpr uint64_t kLarge = 8ull << 20;    // over it: a copy-engine job
constexpr uint64_t kSmCopyMax = 64 << 10;  // set explicitly, so the split above holds

EngineConfig batch_config() {
  EngineConfig c = gpu_config();
  c.set("nvlink.post_sm_copy_max", std::to_string(kSmCopyMax));
  c.set("nvlink.post_batch", "true");
  return c;
}

__device__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One block on the receiving GPU: for each round r, waits (acquire, system scope) until the
// counter reaches r + 1, then at once checks round r's bytes [r * stride, r * stride + len)
// of `dst` against fill()'s pattern of the same offsets. A signal seen before its puts
// shows up as bad bytes; out[0] = bad bytes, out[1] = rounds checked.
__global__ void check_rounds(const uint64_t* counter, const uint8_t* dst, uint64_t stride, uint64_t len, int rounds,
                             uint8_t seed, unsigned long long* out) {
  __shared__ int go;
  ::cuda::atomic_ref<const uint64_t, ::cuda::thread_scope_system> c(*counter);
  for (int r = 0; r < rounds; ++r) {
    if (threadIdx.x == 0) {
      const uint64_t deadline = now_ns() + 30ull * 1000 * 1000 * 1000;
      go = 0;
      while (now_ns() < deadline)
        if (c.load(::cuda::memory_order_acquire) >= uint64_t(r) + 1) {
          go = 1;
          break;
        }
    }
    __syncthreads();  // orders thread 0's acquire before every thread's reads
    if (!go) return;
    for (uint64_t i = r * stride + threadIdx.x; i < r * stride + len; i += blockDim.x)
      if (dst[i] != uint8_t(i * 131 + seed)) atomicAdd(&out[0], 1ull);
    if (threadIdx.x == 0) out[1] = r + 1;
    __syncthreads();
  }
}

// One thread: rounds first .. first + rounds - 1, each a put_with_signal of [r * stride, + len)
// into the peer's same offset of its destination half (dst_off = n + src_off). out[0]: the
// first failure, else kOk.
__global__ void put_rounds(PortChannelDeviceHandle ch, uint64_t n, uint64_t stride, uint64_t len, int first,
                           int rounds, int* out) {
  out[0] = 0;
  for (int r = first; r < first + rounds; ++r) {
    PortResult res = ch.put_with_signal(n + r * stride, r * stride, len);
    if (res != PortResult::kOk) {
      out[0] = int(res);
      return;
    }
  }
}

// One thread: per round a small put, a large put, a small put, then a signal (four requests).
__global__ void mixed_rounds(PortChannelDeviceHandle ch, uint64_t n, uint64_t stride, int rounds, int* out) {
  out[0] = 0;
  for (int r = 0; r < rounds; ++r) {
    const uint64_t base = r * stride;
    PortResult res = ch.put(n + base, base, kSmall);
    if (res == PortResult::kOk) res = ch.put(n + base + kSmall, base + kSmall, kLarge);
    if (res == PortResult::kOk) res = ch.put(n + base + kSmall + kLarge, base + kSmall + kLarge, kSmall);
    if (res == PortResult::kOk) res = ch.signal();
    if (res != PortResult::kOk) {
      out[0] = int(res);
      return;
    }
  }
}

// Thread t puts 1 + t % 32 bytes at offset t * 32 and signals.
__global__ void slot_producers(PortChannelDeviceHandle ch, uint64_t n, int* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  out[t] = int(ch.put_with_signal(n + uint64_t(t) * 32, uint64_t(t) * 32, 1 + t % 32));
}

__global__ void count_bad_slots(const uint8_t* dst, int threads, uint8_t seed, unsigned long long* bad) {
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < threads; t += gridDim.x * blockDim.x)
    for (int j = 0; j < 1 + t % 32; ++j) {
      const uint64_t i = uint64_t(t) * 32 + j;
      if (dst[i] != uint8_t(i * 131 + seed)) atomicAdd(bad, 1ull);
    }
}

__global__ void flush_on(PortChannelDeviceHandle ch, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = int(ch.flush());
}

// Device memory for a kernel's results, zeroed; read back with get().
template <class T>
struct DeviceOut {
  T* p = nullptr;
  size_t n;
  DeviceOut(int device, size_t count) : n(count) {
    cudaSetDevice(device);
    if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess || cudaMemset(p, 0, n * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceOut() {
    if (p) cudaFree(p);
  }
  std::vector<T> get() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

uint64_t counter_at(const Allocation& r, uint64_t off, int device) {
  uint64_t v = ~0ull;
  cudaSetDevice(device);
  cudaMemcpy(&v, static_cast<const uint8_t*>(r.ptr) + off, 8, cudaMemcpyDeviceToHost);
  return v;
}

TEST(PortChannelGpuBatch, SmallPutsFromOneThreadNeverOvertakeTheirSignals) {
  NEED_GPU();
  constexpr uint64_t kStride = 203;  // odd: the batch kernel's byte, 4-, 8- and 16-byte paths all run
  constexpr int kRounds = 2000;
  Pair p(kStride * kRounds, 512, batch_config());
  const int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<64, 256>>>(static_cast<uint8_t*>(p.ra.ptr), p.n, 5);
  CK(cudaDeviceSynchronize());
  DeviceOut<int> res(da, 2);
  DeviceOut<unsigned long long> chk(db, 2);
  ASSERT_TRUE(res.p && chk.p);
  cudaFuncAttributes attr;
  for (int d : {da, db}) {
    cudaSetDevice(d);
    CK(cudaFuncGetAttributes(&attr, check_rounds));
    CK(cudaFuncGetAttributes(&attr, put_rounds));
    CK(cudaFuncGetAttributes(&attr, flush_on));
  }
  SideStream sa(da), sb(db);
  ASSERT_TRUE(sa.s && sb.s);
  cudaSetDevice(db);
  check_rounds<<<1, 256, 0, sb>>>(reinterpret_cast<const uint64_t*>(static_cast<uint8_t*>(p.rb.ptr) + 2 * p.n),
                                  static_cast<const uint8_t*>(p.rb.ptr) + p.n, kStride, kStride, kRounds, 5, chk.p);
  cudaSetDevice(da);
  put_rounds<<<1, 1, 0, sa>>>(p.ca.device_handle(), p.n, kStride, kStride, 0, kRounds, res.p);
  flush_on<<<1, 1, 0, sa>>>(p.ca.device_handle(), res.p + 1);
  CK(cudaStreamSynchronize(sa));
  cudaSetDevice(db);
  CK(cudaStreamSynchronize(sb));
  auto r = res.get();
  auto c = chk.get();
  EXPECT_EQ(0, r[0]) << p.ca.status().to_string() << stats_of(*p.pa);
  EXPECT_EQ(0, r[1]) << "flush: " << p.ca.status().to_string() << stats_of(*p.pa);
  EXPECT_EQ(uint64_t(kRounds), c[1]) << "the reader saw only " << c[1] << " signals" << stats_of(*p.pa);
  EXPECT_EQ(0u, c[0]) << "bytes missing when their signal was seen" << stats_of(*p.pa);
  std::printf("  proxy: %s\n", stats_of(*p.pa).c_str());
}

TEST(PortChannelGpuBatch, ManyThreadsSmallPutsLandWithEveryByte) {
  NEED_GPU();
  constexpr int kThreads = 4096;
  Pair p(uint64_t(kThreads) * 32, /*depth=*/256, batch_config());
  const int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<64, 256>>>(static_cast<uint8_t*>(p.ra.ptr), p.n, 9);
  CK(cudaDeviceSynchronize());
  DeviceOut<int> out(da, kThreads + 1);
  ASSERT_TRUE(out.p);
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, flush_on));  // launched while the producers spin on a full FIFO
  slot_producers<<<kThreads / 256, 256>>>(p.ca.device_handle(), p.n, out.p);
  flush_on<<<1, 1>>>(p.ca.device_handle(), out.p + kThreads);
  CK(cudaDeviceSynchronize());
  auto h = out.get();
  for (int t = 0; t <= kThreads; ++t)
    ASSERT_EQ(0, h[t]) << "thread " << t << ": " << p.ca.status().to_string() << stats_of(*p.pa);
  DeviceOut<unsigned long long> bad(db, 1);
  cudaSetDevice(db);
  count_bad_slots<<<16, 256>>>(static_cast<const uint8_t*>(p.rb.ptr) + p.n, kThreads, 9, bad.p);
  CK(cudaDeviceSynchronize());
  EXPECT_EQ(0u, bad.get()[0]) << stats_of(*p.pa);
  EXPECT_EQ(uint64_t(kThreads), counter_at(p.rb, 2 * p.n, db));
  ProxyStats s = p.pa->stats();
  EXPECT_EQ(uint64_t(kThreads), s.puts);
  EXPECT_EQ(uint64_t(kThreads), s.signals);
  std::printf("  proxy: %s (mean batch %.1f posts)\n", stats_of(*p.pa).c_str(),
              s.batches ? double(s.puts + s.signals) / s.batches : 0.0);
}

TEST(PortChannelGpuBatch, MixedSmCopyAndCopyEngineBatchSignalsAfterBoth) {
  NEED_GPU();
  constexpr int kRounds = 8;
  constexpr uint64_t kStride = 2 * kSmall + kLarge;
  // Proxies not started: the producer queues all 32 requests first, so the worker pops them
  // as ONE batch (small, large, small, signal, ...) and the ordering inside it is what is tested.
  Pair p(kStride * kRounds, 512, batch_config(), /*start=*/false);
  const int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<264, 512>>>(static_cast<uint8_t*>(p.ra.ptr), p.n, 7);
  CK(cudaDeviceSynchronize());
  DeviceOut<int> res(da, 2);
  DeviceOut<unsigned long long> chk(db, 2);
  ASSERT_TRUE(res.p && chk.p);
  cudaFuncAttributes attr;
  for (int d : {da, db}) {
    cudaSetDevice(d);
    CK(cudaFuncGetAttributes(&attr, check_rounds));
    CK(cudaFuncGetAttributes(&attr, mixed_rounds));
    CK(cudaFuncGetAttributes(&attr, flush_on));
  }
  SideStream sa(da), sb(db);
  ASSERT_TRUE(sa.s && sb.s);
  cudaSetDevice(db);
  check_rounds<<<1, 1024, 0, sb>>>(reinterpret_cast<const uint64_t*>(static_cast<uint8_t*>(p.rb.ptr) + 2 * p.n),
                                   static_cast<const uint8_t*>(p.rb.ptr) + p.n, kStride, kStride, kRounds, 7, chk.p);
  cudaSetDevice(da);
  mixed_rounds<<<1, 1, 0, sa>>>(p.ca.device_handle(), p.n, kStride, kRounds, res.p);
  CK(cudaStreamSynchronize(sa));
  ASSERT_EQ(0, res.get()[0]) << "pushing the requests failed";
  p.pa->start();
  cudaSetDevice(db);
  CK(cudaStreamSynchronize(sb));
  cudaSetDevice(da);
  flush_on<<<1, 1, 0, sa>>>(p.ca.device_handle(), res.p + 1);
  CK(cudaStreamSynchronize(sa));
  auto c = chk.get();
  EXPECT_EQ(0, res.get()[1]) << "flush: " << p.ca.status().to_string() << stats_of(*p.pa);
  EXPECT_EQ(uint64_t(kRounds), c[1]) << "the reader saw only " << c[1] << " signals" << stats_of(*p.pa);
  EXPECT_EQ(0u, c[0]) << "a signal was seen before its SM-copied or copy-engine puts" << stats_of(*p.pa);
  ProxyStats s = p.pa->stats();
  EXPECT_EQ(uint64_t(3 * kRounds), s.puts);
  EXPECT_EQ(uint64_t(kRounds), s.signals);
  EXPECT_EQ(1u, s.batches) << "the 32 queued requests were not posted as one batch" << stats_of(*p.pa);
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + p.n, p.n, 7, db)) << "after flush";
}

TEST(PortChannelGpuBatch, OutOfRangeInsideABatchFailsOnlyItsChannel) {
  NEED_GPU();
  constexpr uint64_t n = 1 << 20;
  Pair p(n, 512, batch_config(), /*start=*/false);
  const int da = 0, db = other_device();
  RemoteHandle to_b = *p.ab.remote_region("rb");
  // A second channel on the same endpoint (same FIFO, same batch), its own semaphores.
  PortChannel bad = p.pa->add_channel(p.ab, p.a_to_b, p.a_ra, {to_b, 2 * n + 8}, {p.ra.handle, 2 * n + 8});
  // The region is as large as the engine allocated (a GPU allocation is rounded up).
  const uint64_t end_b = p.rb.length;
  cudaSetDevice(da);
  fill<<<64, 256>>>(static_cast<uint8_t*>(p.ra.ptr), n, 3);
  CK(cudaDeviceSynchronize());
  DeviceOut<int> res(da, 8);
  ASSERT_TRUE(res.p);
  SideStream sa(da);
  // good, good, bad (past the end of b's region), good: queued, then served as one batch.
  put_rounds<<<1, 1, 0, sa>>>(p.ca.device_handle(), n, 4096, 4096, 0, 2, res.p);
  put_rounds<<<1, 1, 0, sa>>>(bad.device_handle(), end_b - 4, 0, 8, 0, 1, res.p + 1);  // past the end
  put_rounds<<<1, 1, 0, sa>>>(p.ca.device_handle(), n, 4096, 4096, 2, 1, res.p + 2);
  put_rounds<<<1, 1, 0, sa>>>(bad.device_handle(), n, 0, 8, 0, 1, res.p + 3);  // after the failure: dropped
  CK(cudaStreamSynchronize(sa));
  p.pa->start();
  flush_on<<<1, 1, 0, sa>>>(p.ca.device_handle(), res.p + 4);
  flush_on<<<1, 1, 0, sa>>>(bad.device_handle(), res.p + 5);
  CK(cudaStreamSynchronize(sa));
  auto r = res.get();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(0, r[i]) << "push " << i;
  EXPECT_EQ(0, r[4]) << "the good channel's flush: " << p.ca.status().to_string() << stats_of(*p.pa);
  EXPECT_EQ(int(PortResult::kFailed), r[5]) << "the bad channel's flush";
  EXPECT_TRUE(p.ca.status().ok()) << p.ca.status().to_string();
  EXPECT_EQ(ErrorCode::kOutOfRange, bad.status().code) << bad.status().to_string();
  const std::string prefix = "channel " + std::to_string(bad.id()) + ": post_write: ";
  EXPECT_EQ(0u, bad.status().message.rfind(prefix, 0)) << bad.status().message;
  EXPECT_EQ(3u, counter_at(p.rb, 2 * n, db)) << "the good channel's signals";
  EXPECT_EQ(0u, counter_at(p.rb, 2 * n + 8, db)) << "the bad channel signalled";
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + n, 3 * 4096, 3, db)) << "the good channel's bytes";
  // The bad channel's request after its failure, and its flush request (a GPU push does not
  // read the channel's state: the proxy consumes and drops it).
  EXPECT_EQ(2u, p.pa->stats().dropped);
}

// Endpoint::post_batch over nvlink without a proxy: 100 small writes (SM copies), one large
// (copy engine) and a signal, then a batch that fails at its third request.
TEST(PortChannelGpuBatch, EndpointPostBatchOverNvlink) {
  NEED_GPU();
  constexpr uint64_t n = 16ull << 20;
  Pair p(n, 64, batch_config(), /*start=*/false);
  const int da = 0, db = other_device();
  cudaSetDevice(da);
  fill<<<264, 512>>>(static_cast<uint8_t*>(p.ra.ptr), n, 11);
  CK(cudaDeviceSynchronize());
  RemoteHandle to_b = *p.ab.remote_region("rb");
  ASSERT_EQ("nvlink", p.ab.transport());
  std::vector<PostRequest> reqs;
  for (int i = 0; i < 100; ++i) reqs.push_back(PostRequest::write(p.ra.handle, i * 1000, to_b, n + i * 1000, 1000));
  reqs.push_back(PostRequest::write(p.ra.handle, 1 << 20, to_b, n + (1 << 20), kLarge));
  reqs.push_back(PostRequest::signal(to_b, 2 * n));
  PostBatchResult r = p.ab.post_batch(reqs);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(reqs.size(), r.posted);
  p.ab.flush(std::chrono::seconds(30));
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + n, 100 * 1000, 11, db));
  EXPECT_EQ(0u, bad_bytes(static_cast<uint8_t*>(p.rb.ptr) + n + (1 << 20), kLarge, uint8_t(11 + (1 << 20) * 131), db));
  EXPECT_EQ(1u, counter_at(p.rb, 2 * n, db));

  std::vector<PostRequest> broken = {PostRequest::write(p.ra.handle, 0, to_b, n, 64), PostRequest::signal(to_b, 2 * n),
                                     PostRequest::write(p.ra.handle, 0, to_b, p.rb.length - 8, 64),  // past the end
                                     PostRequest::signal(to_b, 2 * n)};
  r = p.ab.post_batch(broken);
  EXPECT_EQ(2u, r.posted);
  EXPECT_EQ(ErrorCode::kOutOfRange, r.error.code) << r.error.to_string();
  p.ab.flush(std::chrono::seconds(30));
  EXPECT_EQ(2u, counter_at(p.rb, 2 * n, db)) << "only the signal before the bad write";
}

// A GPU producer's local semaphore: host memory a kernel cannot read (plain malloc) is
// refused; pinned host memory mapped at the same address (cudaHostAlloc) is accepted.
TEST(PortChannelGpuBatch, LocalSemaphoreInHostMemoryOnlyWhenPinnedAndMapped) {
  NEED_GPU();
  Pair p(1 << 16, 64, batch_config(), /*start=*/false);
  RemoteHandle to_b = *p.ab.remote_region("rb");
  std::vector<uint64_t> plain(64, 0);
  MemoryHandle hp = p.a.register_memory(plain.data(), plain.size() * 8, Location::host(), "plain_sem");
  try {
    (void)p.pa->add_channel(p.ab, p.a_to_b, p.a_ra, {to_b, 2 * p.n + 16}, {hp, 0});
    ADD_FAILURE() << "a semaphore in pageable host memory was accepted for GPU producers";
  } catch (const Error& e) {
    EXPECT_EQ(ErrorCode::kInvalidArgument, e.status().code) << e.what();
  }
  void* pinned = nullptr;
  ASSERT_EQ(cudaSuccess, cudaHostAlloc(&pinned, 4096, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(pinned, 0, 4096);
  MemoryHandle hm = p.a.register_memory(pinned, 4096, Location::host(), "mapped_sem");
  PortChannel ch = p.pa->add_channel(p.ab, p.a_to_b, p.a_ra, {to_b, 2 * p.n + 16}, {hm, 8});
  EXPECT_TRUE(ch.valid());
  p.pa->stop();
  p.a.unregister_memory(hm);
  p.a.unregister_memory(hp);
  cudaFreeHost(pinned);
}

}  // namespace
