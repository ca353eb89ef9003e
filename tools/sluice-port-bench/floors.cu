// What a host proxy can reach at best on this machine: the port channel's ping-pong pattern
// (a GPU thread posts a request into host memory and waits for a counter in its own device
// memory; a host thread serves both GPUs) with the proxy's work replaced by the bare act of
// each way of carrying a put+signal, interleaved in the same run. Nothing of the engine runs
// here; it is the ceiling the port channel's ping-pong is measured against.
#include "floors.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
constexpr unsigned long long kBoundNs = 5ull * 1000 * 1000 * 1000;  // every GPU spin gives up after 5 s

__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long load_acq(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_rel(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// Spins until *p >= v; false after kBoundNs.
__device__ bool wait_ge(const unsigned long long* p, unsigned long long v) {
  const unsigned long long t0 = gtime();
  while (load_acq(p) < v)
    if (gtime() - t0 > kBoundNs) return false;
  return true;
}

// req: this side's request word (host memory); flag: the counter it waits on.
__global__ void floor_ping(unsigned long long* req, const unsigned long long* flag, int n, unsigned long long* out) {
  const unsigned long long t0 = gtime();
  for (int i = 1; i <= n; ++i) {
    store_rel(req, i);
    if (!wait_ge(flag, i)) {
      out[1] = 1;
      return;
    }
  }
  out[0] = gtime() - t0;
}
__global__ void floor_pong(unsigned long long* req, const unsigned long long* flag, int n, unsigned long long* out) {
  for (int i = 1; i <= n; ++i) {
    if (!wait_ge(flag, i)) {
      out[1] = 1;
      return;
    }
    store_rel(req, i);
  }
}
// A put of 8 bytes and its signal, as nvlink's batch kernel does them for one request.
__global__ void floor_put_signal(const unsigned long long* src, unsigned long long* dst, unsigned long long* flag) {
  *dst = *src;
  __threadfence_system();
  atomicAdd_system(flag, 1ull);
}
// The same, by a kernel that stays resident and takes commands from a ring in host memory.
struct Command {
  const unsigned long long* src;
  unsigned long long* dst;
  unsigned long long* flag;
  unsigned long long seq;  // written last; ~0 = exit
  unsigned long long pad[4];
};
constexpr int kRing = 64;
__global__ void floor_executor(Command* ring) {
  for (unsigned long long i = 1;; ++i) {
    Command* c = ring + (i % kRing);
    if (!wait_ge(&c->seq, i)) return;
    if (load_acq(&c->seq) == ~0ull) return;
    *c->dst = *c->src;
    __threadfence_system();
    atomicAdd_system(c->flag, 1ull);
  }
}

enum Mode { kHostStore, kExecutor, kCopyEngine, kLaunch, kModes };
const char* kNames[kModes] = {
    "host thread stores the counter (in host memory; moves no GPU data)",
    "resident executor kernel (ring in host memory): 8 B copy + fence + atomic",
    "cudaMemcpyAsync of the counter's new value (copy engine)",
    "kernel launch per hop: 8 B copy + fence + atomic (the port channel's nvlink path)",
};

bool ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "floors: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

struct Gpu {
  int dev = 0;
  unsigned long long* data = nullptr;   // device: [0] source word, [8] destination word
  unsigned long long* flag = nullptr;   // device: the counter this side waits on
  cudaStream_t spin = nullptr, post = nullptr, exec = nullptr;
  Command* ring = nullptr;              // host, mapped
  unsigned long long* staged = nullptr;  // host, pinned: values the copy engine writes
};

// One round of `n` ping-pongs in `mode`; the round trip in microseconds, or < 0 on failure.
double round_trip(Mode mode, Gpu (&g)[2], unsigned long long* req, unsigned long long* hflag, unsigned long long* out,
                  int n, double* call_us) {
  std::memset(req, 0, 4096);
  std::memset(hflag, 0, 4096);
  std::memset(out, 0, 64);
  for (auto& s : g) {
    if (!ok(cudaSetDevice(s.dev), "cudaSetDevice") || !ok(cudaMemset(s.flag, 0, 64), "cudaMemset") ||
        !ok(cudaMemset(s.data, 0, 128), "cudaMemset") || !ok(cudaStreamSynchronize(nullptr), "sync"))
      return -1;
    std::memset(s.ring, 0, kRing * sizeof(Command));
  }
  const bool host_flags = mode == kHostStore;
  unsigned long long* flags[2] = {host_flags ? hflag : g[0].flag, host_flags ? hflag + 8 : g[1].flag};
  unsigned long long* reqs[2] = {req, req + 8};
  if (mode == kExecutor)
    for (auto& s : g) {
      cudaSetDevice(s.dev);
      floor_executor<<<1, 1, 0, s.exec>>>(s.ring);
    }
  std::atomic<bool> failed{false};
  std::vector<double> calls;
  calls.reserve(2 * n);
  unsigned long long value[2] = {0, 0};  // hops served from each side
  std::thread proxy([&] {
    unsigned long long seen[2] = {0, 0};
    const auto give_up = Clock::now() + std::chrono::seconds(10);
    for (int served = 0; served < 2 * n && !failed;) {
      for (int from = 0; from < 2; ++from) {
        const unsigned long long v = __atomic_load_n(reqs[from], __ATOMIC_ACQUIRE);
        if (v == seen[from]) continue;
        seen[from] = v;
        ++served;
        const int to = 1 - from;
        const unsigned long long next = ++value[from];
        const auto t0 = Clock::now();
        bool good = true;
        switch (mode) {
          case kHostStore:
            __atomic_store_n(flags[to], next, __ATOMIC_RELEASE);
            break;
          case kExecutor: {
            Command* c = g[from].ring + (next % kRing);
            c->src = g[from].data;
            c->dst = g[to].data + 8;
            c->flag = flags[to];
            __atomic_store_n(&c->seq, next, __ATOMIC_RELEASE);
            break;
          }
          case kCopyEngine: {
            unsigned long long* s = g[from].staged + (next % 4096);
            *s = next;
            good = ok(cudaSetDevice(g[from].dev), "cudaSetDevice") &&
                   ok(cudaMemcpyAsync(flags[to], s, 8, cudaMemcpyDefault, g[from].post), "cudaMemcpyAsync");
            break;
          }
          case kLaunch:
            good = ok(cudaSetDevice(g[from].dev), "cudaSetDevice");
            floor_put_signal<<<1, 1, 0, g[from].post>>>(g[from].data, g[to].data + 8, flags[to]);
            good = good && ok(cudaGetLastError(), "launch");
            break;
          default:
            break;
        }
        calls.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        if (!good) failed = true;
      }
      if (Clock::now() > give_up) failed = true;
    }
  });
  cudaSetDevice(g[1].dev);
  floor_pong<<<1, 1, 0, g[1].spin>>>(reqs[1], flags[1], n, out + 2);
  cudaSetDevice(g[0].dev);
  floor_ping<<<1, 1, 0, g[0].spin>>>(reqs[0], flags[0], n, out);
  proxy.join();
  bool good = !failed;
  for (auto& s : g) good = ok(cudaStreamSynchronize(s.spin), "ping/pong") && good;
  if (mode == kExecutor)
    for (auto& s : g) {
      __atomic_store_n(&s.ring[(value[&s - g] + 1) % kRing].seq, ~0ull, __ATOMIC_RELEASE);
      good = ok(cudaStreamSynchronize(s.exec), "executor") && good;
    }
  for (auto& s : g) good = ok(cudaStreamSynchronize(s.post), "post stream") && good;
  if (!good || out[1] || out[3]) return -1;
  std::sort(calls.begin(), calls.end());
  *call_us = calls.empty() ? 0 : calls[calls.size() / 2];
  return out[0] / 1e3 / n;
}

}  // namespace

int run_floors(int dev_a, int dev_b, int rounds, int reps) {
  Gpu g[2];
  g[0].dev = dev_a;
  g[1].dev = dev_b;
  unsigned long long *req = nullptr, *hflag = nullptr, *out = nullptr;
  const unsigned mapped = cudaHostAllocMapped | cudaHostAllocPortable;
  bool good = ok(cudaHostAlloc(&req, 4096, mapped), "cudaHostAlloc") &&
              ok(cudaHostAlloc(&hflag, 4096, mapped), "cudaHostAlloc") && ok(cudaHostAlloc(&out, 64, mapped), "cudaHostAlloc");
  for (auto& s : g) {
    good = good && ok(cudaSetDevice(s.dev), "cudaSetDevice");
    const int other = (&s == g) ? dev_b : dev_a;
    cudaError_t pe = cudaDeviceEnablePeerAccess(other, 0);
    if (pe == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
    else good = good && ok(pe, "cudaDeviceEnablePeerAccess");
    good = good && ok(cudaMalloc(&s.data, 128), "cudaMalloc") && ok(cudaMalloc(&s.flag, 64), "cudaMalloc") &&
           ok(cudaStreamCreateWithFlags(&s.spin, cudaStreamNonBlocking), "stream") &&
           ok(cudaStreamCreateWithFlags(&s.post, cudaStreamNonBlocking), "stream") &&
           ok(cudaStreamCreateWithFlags(&s.exec, cudaStreamNonBlocking), "stream") &&
           ok(cudaHostAlloc(&s.ring, kRing * sizeof(Command), mapped), "cudaHostAlloc") &&
           ok(cudaHostAlloc(&s.staged, 4096 * 8, cudaHostAllocPortable), "cudaHostAlloc");
  }
  // Every kernel is loaded before any spins (a lazy load waits for running kernels).
  cudaFuncAttributes attr;
  for (const void* k : {(const void*)floor_ping, (const void*)floor_pong, (const void*)floor_put_signal,
                        (const void*)floor_executor})
    for (auto& s : g) good = good && ok(cudaSetDevice(s.dev), "cudaSetDevice") && ok(cudaFuncGetAttributes(&attr, k), "load");
  if (!good) return 1;
  // The host clock, read twice per post by the proxy's bookkeeping: a VM's may be a system call.
  const auto c0 = Clock::now();
  volatile long long sink = 0;
  for (int i = 0; i < 100000; ++i) sink = sink + Clock::now().time_since_epoch().count();
  const double clock_ns = std::chrono::duration<double, std::nano>(Clock::now() - c0).count() / 100000;

  std::vector<double> rt[kModes], call[kModes];
  for (int r = 0; r < reps; ++r)
    for (int m = 0; m < kModes; ++m) {
      double c = 0;
      const double us = round_trip(static_cast<Mode>(m), g, req, hflag, out, rounds, &c);
      if (us < 0) {
        std::fprintf(stderr, "floors: %s failed\n", kNames[m]);
        return 1;
      }
      rt[m].push_back(us);
      call[m].push_back(c);
    }
  std::printf("\nhost-proxy floors: ping-pong round trip between GPUs %d and %d, %d round trips x %d rounds "
              "interleaved (median [min-max]); host clock read %.0f ns\n\n",
              dev_a, dev_b, rounds, reps, clock_ns);
  std::printf("| how the proxy carries each hop | round trip, us | host call per hop, us |\n|---|---|---|\n");
  for (int m = 0; m < kModes; ++m) {
    std::sort(rt[m].begin(), rt[m].end());
    std::sort(call[m].begin(), call[m].end());
    std::printf("| %s | %.2f [%.2f-%.2f] | %.2f |\n", kNames[m], rt[m][rt[m].size() / 2], rt[m].front(), rt[m].back(),
                call[m][call[m].size() / 2]);
  }
  for (auto& s : g) {
    cudaSetDevice(s.dev);
    cudaFree(s.data);
    cudaFree(s.flag);
    cudaStreamDestroy(s.spin);
    cudaStreamDestroy(s.post);
    cudaStreamDestroy(s.exec);
    cudaFreeHost(s.ring);
    cudaFreeHost(s.staged);
  }
  cudaFreeHost(req);
  cudaFreeHost(hflag);
  cudaFreeHost(out);
  return 0;
}
