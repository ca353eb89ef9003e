// What the port channel's GPU test files share (port_channel_cuda_test.cu,
// port_channel_batch_cuda_test.cu): skip without a GPU, byte patterns checked on the GPU, and
// a pair of engines on two GPUs (or one) with a proxy and a channel each way.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "sluice/cuda.hpp"
#include "sluice/port_channel.hpp"
#include "sluice/sluice.hpp"

// Kernels are static (each test file gets its own copy), functions inline.
namespace sluice_test_gpu {

using namespace sluice;

#define NEED_GPU()                                                                                     \
  do {                                                                                                 \
    if (sluice::cuda::device_count() < 1) GTEST_SKIP() << "needs a CUDA device: " << sluice::cuda::unavailable_reason(); \
  } while (0)
#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

// What a proxy did, for failure messages: a stalled proxy and a stalled producer differ here.
inline std::string stats_of(const ProxyService& p) {
  ProxyStats s = p.stats();
  return " [proxy: " + std::to_string(s.requests) + " requests, " + std::to_string(s.puts) + " puts, " +
         std::to_string(s.signals) + " signals, " + std::to_string(s.flushes) + " flushes, " +
         std::to_string(s.dropped) + " dropped, " + std::to_string(s.batches) + " batches]";
}

inline int other_device() { return sluice::cuda::device_count() > 1 ? 1 : 0; }

// A non-blocking stream per side: with one GPU both sides' kernels share the device, and on
// the legacy default stream the second would queue behind the first, which spins waiting for it.
struct SideStream {
  cudaStream_t s = nullptr;
  explicit SideStream(int device) {
    cudaSetDevice(device);
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) s = nullptr;
  }
  ~SideStream() {
    if (s) cudaStreamDestroy(s);
  }
  operator cudaStream_t() const { return s; }
};

inline EngineConfig gpu_config() {
  EngineConfig c;
  c.listen_host = "127.0.0.1";
  return c;
}

static __global__ void fill(uint8_t* p, uint64_t n, uint8_t seed) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(i * 131 + seed);
}

// Counts the bytes of p[0, n) that differ from fill()'s pattern.
static __global__ void count_bad(const uint8_t* p, uint64_t n, uint8_t seed, unsigned long long* bad) {
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    if (p[i] != uint8_t(i * 131 + seed)) atomicAdd(bad, 1ull);
}

inline uint64_t bad_bytes(const void* p, uint64_t n, uint8_t seed, int device) {
  cudaSetDevice(device);
  unsigned long long* bad = nullptr;
  cudaMalloc(&bad, sizeof(*bad));
  cudaMemset(bad, 0, sizeof(*bad));
  count_bad<<<264, 512>>>(static_cast<const uint8_t*>(p), n, seed, bad);
  unsigned long long h = ~0ull;
  cudaMemcpy(&h, bad, sizeof(h), cudaMemcpyDeviceToHost);
  cudaFree(bad);
  return h;
}

// Two engines, one per GPU, each with a region [src n | dst n | counters 4096] and a proxy
// whose channel puts into the other's region.
struct Pair {
  uint64_t n;
  Engine a, b;
  Allocation ra, rb;
  Endpoint ab, ba;
  std::unique_ptr<ProxyService> pa, pb;
  PortChannel ca, cb;
  MemoryId a_to_b = 0, a_ra = 0, b_to_a = 0, b_rb = 0;  // the proxies' memory ids (a's and b's table)

  // `config`: both engines' (nvlink.* and port.* options); `start`: start the proxies now
  // (false: requests pushed before start() are popped as one batch).
  explicit Pair(uint64_t bytes, uint32_t depth = 512, EngineConfig config = gpu_config(), bool start = true)
      : n(bytes), a(config), b(config) {
    int da = 0, db = other_device();
    ra = a.allocate(2 * n + 4096, Location::cuda(da), "ra");
    rb = b.allocate(2 * n + 4096, Location::cuda(db), "rb");
    cudaSetDevice(da);
    cudaMemset(ra.ptr, 0, 2 * n + 4096);
    cudaSetDevice(db);
    cudaMemset(rb.ptr, 0, 2 * n + 4096);
    cudaDeviceSynchronize();
    ab = a.connect(b.local_info());
    auto acc = b.accept(std::chrono::seconds(10));
    if (!acc) throw Error(ErrorCode::kTimeout, "b never accepted");
    ba = *acc;
    ProxyOptions oa, ob;
    oa.producers = ob.producers = ProducerKind::kCuda;
    oa.fifo_depth = ob.fifo_depth = depth;
    oa.cuda_device = da;
    ob.cuda_device = db;
    oa.idle_spin = ob.idle_spin = std::chrono::microseconds(1000000);  // latency tests: keep spinning
    pa = std::make_unique<ProxyService>(a, oa);
    pb = std::make_unique<ProxyService>(b, ob);
    RemoteHandle to_b = *ab.remote_region("rb"), to_a = *ba.remote_region("ra");
    // One statement each: the order of a call's arguments is unspecified, and the ids follow it.
    a_to_b = pa->add_memory(ab, to_b);
    a_ra = pa->add_memory(ra.handle);
    b_to_a = pb->add_memory(ba, to_a);
    b_rb = pb->add_memory(rb.handle);
    ca = pa->add_channel(ab, a_to_b, a_ra, {to_b, 2 * n}, {ra.handle, 2 * n});
    cb = pb->add_channel(ba, b_to_a, b_rb, {to_a, 2 * n}, {rb.handle, 2 * n});
    if (start) {
      pa->start();
      pb->start();
    }
  }
};

}  // namespace sluice_test_gpu
