// sluice-port-bench: the port channel between two GPUs of one host (two engines in one
// process, nvlink), against the copy engine driven from the host in the same run:
//   - bidirectional put-with-signal at 1 KiB, 1 MiB and 128 MiB vs cudaMemcpyPeerAsync both ways
//   - FIFO push cost from one GPU thread (ns per request, the proxy consuming meanwhile)
//   - ping-pong round trip (put_with_signal + wait on each side), then the same pattern with the
//     proxy's work replaced by the bare act of each way a host proxy can carry a hop (floors.cu)
//   - small-request rate: 8-byte put+signal requests per second through one proxy, pushed by
//     one GPU thread (bound by the push cost) and by many (bound by the proxy)
// It prints the settings it ran with first (the proxy's batching, nvlink's batch kernel), so
// that tables from runs with other settings are not mixed up.
//   sluice-port-bench [--peer-device 1] [--iters N] [--producers 1024] [--requests 1000000] [--floor-rounds 5000]
//                     [--set key=value ...]
// --set passes an engine option to both engines, e.g. --set port.batch_max=1 or
// --set nvlink.post_batch=false for the unbatched path (SLUICE_* variables work too).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "../common/cuda_check.hpp"
#include "floors.hpp"
#include "sluice/cuda.hpp"
#include "sluice/port_channel.hpp"
#include "sluice/sluice.hpp"

using namespace sluice;
using Clock = std::chrono::steady_clock;

namespace {

// Each side: rounds x (put_with_signal of n bytes, then wait for the peer's), then flush.
__global__ void exchange(PortChannelDeviceHandle ch, uint64_t n, int rounds, int* err) {
  for (int i = 0; i < rounds; ++i) {
    PortResult r = ch.put_with_signal(n, 0, n);
    if (r == PortResult::kOk) r = ch.wait();
    if (r != PortResult::kOk) {
      *err = int(r);
      return;
    }
  }
  *err = int(ch.flush());
}

__global__ void pong(PortChannelDeviceHandle ch, int rounds, int* err) {
  for (int i = 0; i < rounds; ++i) {
    PortResult r = ch.wait();
    if (r == PortResult::kOk) r = ch.put_with_signal(0, 0, 8);
    if (r != PortResult::kOk) {
      *err = int(r);
      return;
    }
  }
  *err = 0;
}

__global__ void ping(PortChannelDeviceHandle ch, int rounds, int* err, unsigned long long* ns) {
  uint64_t t0 = 0, t1 = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 0; i < rounds; ++i) {
    PortResult r = ch.put_with_signal(0, 0, 8);
    if (r == PortResult::kOk) r = ch.wait();
    if (r != PortResult::kOk) {
      *err = int(r);
      return;
    }
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  *ns = t1 - t0;
  *err = 0;
}

// `count` pushes from one thread (kinds: signal only when `put` is false), timed on the GPU.
__global__ void pushes(PortChannelDeviceHandle ch, int count, bool put, int* err, unsigned long long* ns) {
  uint64_t t0 = 0, t1 = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (int i = 0; i < count; ++i) {
    PortResult r = put ? ch.put_with_signal(uint64_t(i % 1024) * 8, uint64_t(i % 1024) * 8, 8) : ch.signal();
    if (r != PortResult::kOk) {
      *err = int(r);
      return;
    }
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  *ns = t1 - t0;
  *err = int(ch.flush(60'000'000'000ull));
}

// `count` 8-byte put+signal requests spread over every thread of the grid, each thread on its
// own 8-byte slot; *err: the first failure (0 if none).
__global__ void pushes_par(PortChannelDeviceHandle ch, int count, int* err) {
  const int threads = gridDim.x * blockDim.x, t = blockIdx.x * blockDim.x + threadIdx.x;
  for (int i = t; i < count; i += threads) {
    const uint64_t off = uint64_t(t % 1024) * 8;
    PortResult r = ch.put_with_signal(off, off, 8);
    if (r != PortResult::kOk) {
      atomicCAS(err, 0, int(r));
      return;
    }
  }
}

__global__ void flush_one(PortChannelDeviceHandle ch, int* err) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int r = int(ch.flush(60'000'000'000ull));
    if (r != 0) atomicCAS(err, 0, r);
  }
}

EngineConfig g_config;  // both engines' (--set)

struct Side {
  int dev;
  std::unique_ptr<Engine> engine;
  Allocation region;  // [src n | dst n | counters 4096]
  Endpoint ep;
  std::unique_ptr<ProxyService> proxy;
  PortChannel ch;
  int* err = nullptr;
  unsigned long long* ns = nullptr;
  cudaStream_t stream = nullptr;
};

void build(Side& a, Side& b, uint64_t n, uint32_t depth) {
  for (Side* s : {&a, &b}) {
    EngineConfig c = g_config;
    c.listen_host = "127.0.0.1";
    s->engine = std::make_unique<Engine>(c);
    s->region = s->engine->allocate(2 * n + 4096, Location::cuda(s->dev), "r");
    CK(cudaSetDevice(s->dev));
    CK(cudaMemset(s->region.ptr, 1, 2 * n));
    CK(cudaMemset(static_cast<uint8_t*>(s->region.ptr) + 2 * n, 0, 4096));
    if (!s->err) {
      CK(cudaMalloc(&s->err, sizeof(int)));
      CK(cudaMalloc(&s->ns, sizeof(unsigned long long)));
      CK(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    }
  }
  a.ep = a.engine->connect(b.engine->local_info());
  auto acc = b.engine->accept(std::chrono::seconds(10));
  if (!acc) {
    std::fprintf(stderr, "accept failed\n");
    std::exit(2);
  }
  b.ep = *acc;
  for (auto [s, o] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
    ProxyOptions opt;
    opt.producers = ProducerKind::kCuda;
    opt.cuda_device = s->dev;
    opt.fifo_depth = depth;
    opt.idle_spin = std::chrono::seconds(3600);  // a benchmark keeps its proxy spinning
    s->proxy = std::make_unique<ProxyService>(*s->engine, opt);
    RemoteHandle peer = *s->ep.remote_region("r");
    s->ch = s->proxy->add_channel(s->ep, s->proxy->add_memory(s->ep, peer), s->proxy->add_memory(s->region.handle),
                                  {peer, 2 * n}, {s->region.handle, 2 * n});
    s->proxy->start();
  }
}

void teardown(Side& s) {
  s.proxy.reset();
  s.ep = {};
  s.engine.reset();
}

int result(Side& s) {
  int h = -1;
  CK(cudaSetDevice(s.dev));
  CK(cudaMemcpy(&h, s.err, sizeof(h), cudaMemcpyDeviceToHost));
  return h;
}
unsigned long long ns_of(Side& s) {
  unsigned long long h = 0;
  CK(cudaSetDevice(s.dev));
  CK(cudaMemcpy(&h, s.ns, sizeof(h), cudaMemcpyDeviceToHost));
  return h;
}

double copy_engine_bidir(int da, int db, uint64_t n, int rounds) {
  void *a = nullptr, *b = nullptr, *a2 = nullptr, *b2 = nullptr;
  cudaStream_t sa, sb;
  CK(cudaSetDevice(da));
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&a2, n));
  CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  cudaDeviceEnablePeerAccess(db, 0);
  cudaGetLastError();
  CK(cudaSetDevice(db));
  CK(cudaMalloc(&b, n));
  CK(cudaMalloc(&b2, n));
  CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  cudaDeviceEnablePeerAccess(da, 0);
  cudaGetLastError();
  auto run = [&] {
    for (int i = 0; i < rounds; ++i) {
      CK(cudaMemcpyPeerAsync(b2, db, a, da, n, sa));
      CK(cudaMemcpyPeerAsync(a2, da, b, db, n, sb));
    }
    CK(cudaStreamSynchronize(sa));
    CK(cudaStreamSynchronize(sb));
  };
  run();  // warm-up
  auto t0 = Clock::now();
  run();
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  cudaFree(a2);
  cudaFree(b2);
  cudaFree(b);
  CK(cudaSetDevice(da));
  cudaFree(a);
  return 2.0 * n * rounds / s;
}

}  // namespace

int main(int argc, char** argv) {
  int peer = 1, iters = 20, producers = 1024, requests = 1000000, floor_rounds = 5000;
  try {
    for (int i = 1; i + 1 < argc; i += 2) {
      std::string k = argv[i], v = argv[i + 1];
      if (k == "--peer-device") peer = std::atoi(v.c_str());
      else if (k == "--iters") iters = std::atoi(v.c_str());
      else if (k == "--producers") producers = std::max(1, std::atoi(v.c_str()));
      else if (k == "--requests") requests = std::max(1, std::atoi(v.c_str()));
      else if (k == "--floor-rounds") floor_rounds = std::max(0, std::atoi(v.c_str()));
      else if (k == "--set" && v.find('=') != std::string::npos) g_config.set(v.substr(0, v.find('=')), v.substr(v.find('=') + 1));
      else throw Error(ErrorCode::kInvalidArgument, "unknown argument " + k);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\nusage: sluice-port-bench [--peer-device 1] [--iters N] [--producers 1024] [--requests 1000000] [--floor-rounds 5000 (0: none)] [--set key=value ...]\n",
                 e.what());
    return 1;
  }
  {
    EngineConfig eff = EngineConfig::from_env(g_config);
    std::printf("settings: port.batch_max=%s nvlink.post_batch=%s nvlink.post_sm_copy_max=%s post.depth=%s "
                "post.flush_spin_us=%s; "
                "proxy: 1 worker, idle_spin 3600 s; GPUs 0 and --peer-device %d\n\n",
                eff.get("port.batch_max").c_str(), eff.get("nvlink.post_batch").c_str(),
                eff.get("nvlink.post_sm_copy_max").c_str(), eff.get("post.depth").c_str(),
                eff.get("post.flush_spin_us").c_str(), peer);
  }
  if (sluice::cuda::device_count() < 1) {
    std::fprintf(stderr, "sluice-port-bench: no GPU: %s\n", sluice::cuda::unavailable_reason().c_str());
    return 1;
  }
  if (peer >= sluice::cuda::device_count()) peer = 0;
  std::printf("| pattern | size | port channel | copy engine (cudaMemcpyPeerAsync) | ratio |\n|---|---|---|---|---|\n");
  for (uint64_t n : {uint64_t(1) << 10, uint64_t(1) << 20, uint64_t(128) << 20}) {
    Side a{0}, b{peer};
    build(a, b, n, 512);
    int rounds = n >= (64u << 20) ? iters : iters * 50;
    auto launch = [&] {
      CK(cudaSetDevice(a.dev));
      exchange<<<1, 1, 0, a.stream>>>(a.ch.device_handle(), n, rounds, a.err);
      CK(cudaSetDevice(b.dev));
      exchange<<<1, 1, 0, b.stream>>>(b.ch.device_handle(), n, rounds, b.err);
      CK(cudaStreamSynchronize(b.stream));
      CK(cudaSetDevice(a.dev));
      CK(cudaStreamSynchronize(a.stream));
    };
    launch();  // warm-up
    auto t0 = Clock::now();
    launch();
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (result(a) != 0 || result(b) != 0) {
      std::fprintf(stderr, "exchange failed: %s / %s\n", a.ch.status().to_string().c_str(),
                   b.ch.status().to_string().c_str());
      return 2;
    }
    double port = 2.0 * n * rounds / s, ce = copy_engine_bidir(a.dev, b.dev, n, rounds);
    std::printf("| bidirectional put-with-signal | %llu B | %.2f GB/s | %.2f GB/s | %.3f |\n",
                (unsigned long long)n, port / 1e9, ce / 1e9, port / ce);
    teardown(a);
    teardown(b);
  }

  Side a{0}, b{peer};
  build(a, b, 8192, 4096);
  // Ping-pong.
  constexpr int kPing = 10000;
  CK(cudaSetDevice(b.dev));
  pong<<<1, 1, 0, b.stream>>>(b.ch.device_handle(), kPing, b.err);
  CK(cudaSetDevice(a.dev));
  ping<<<1, 1, 0, a.stream>>>(a.ch.device_handle(), kPing, a.err, a.ns);
  CK(cudaStreamSynchronize(a.stream));
  CK(cudaSetDevice(b.dev));
  CK(cudaStreamSynchronize(b.stream));
  if (result(a) != 0 || result(b) != 0) {
    std::fprintf(stderr, "ping-pong failed: %s\n", a.ch.status().to_string().c_str());
    return 2;
  }
  std::printf("\nping-pong round trip: %.2f us\n", ns_of(a) / 1e3 / kPing);
  // What any host proxy could reach at best on this machine, measured right after it.
  if (floor_rounds > 0 && run_floors(a.dev, b.dev, floor_rounds, 3) != 0) return 2;
  // FIFO push cost: pushes that never find the FIFO full (fewer than its depth) ...
  CK(cudaSetDevice(a.dev));
  pushes<<<1, 1, 0, a.stream>>>(a.ch.device_handle(), 2048, false, a.err, a.ns);
  CK(cudaStreamSynchronize(a.stream));
  std::printf("FIFO push (signal requests, FIFO never full): %.3f us per request\n", ns_of(a) / 1e3 / 2048);
  // ... and the sustained rate of 8-byte put+signal requests through one proxy.
  const int kMany = requests;  // --requests: the slow path (nvlink.post_batch=false) needs fewer
  auto t0 = Clock::now();
  pushes<<<1, 1, 0, a.stream>>>(a.ch.device_handle(), kMany, true, a.err, a.ns);
  CK(cudaStreamSynchronize(a.stream));
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (result(a) != 0) {
    std::fprintf(stderr, "small requests failed: %s\n", a.ch.status().to_string().c_str());
    return 2;
  }
  std::printf("8-byte put+signal requests, 1 GPU thread: %.3f M/s (push side alone %.3f us per request)\n",
              kMany / s / 1e6, ns_of(a) / 1e3 / kMany);
  // The same from many GPU threads at once: what one proxy sustains when pushes are not the
  // bound (the issue's bar: >= 1 M/s).
  const ProxyStats before = a.proxy->stats();
  CK(cudaMemset(a.err, 0, sizeof(int)));
  const int threads = std::min(producers, 256), blocks = (producers + threads - 1) / threads;
  // flush_one is launched while pushes_par may spin on a full FIFO: loaded first, or its lazy
  // load would wait for that kernel (docs/port-channel.md, lazy loading).
  cudaFuncAttributes attr;
  CK(cudaFuncGetAttributes(&attr, pushes_par));
  CK(cudaFuncGetAttributes(&attr, flush_one));
  t0 = Clock::now();
  pushes_par<<<blocks, threads, 0, a.stream>>>(a.ch.device_handle(), kMany, a.err);
  flush_one<<<1, 1, 0, a.stream>>>(a.ch.device_handle(), a.err);
  CK(cudaStreamSynchronize(a.stream));
  s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (result(a) != 0) {
    std::fprintf(stderr, "small requests from %d threads failed: %s\n", blocks * threads,
                 a.ch.status().to_string().c_str());
    return 2;
  }
  const ProxyStats after = a.proxy->stats();
  const uint64_t posts = (after.puts - before.puts) + (after.signals - before.signals);
  const uint64_t batches = after.batches - before.batches;
  std::printf("8-byte put+signal requests, %d GPU threads: %.3f M/s (%llu post_batch calls, %.1f posts each)\n",
              blocks * threads, kMany / s / 1e6, (unsigned long long)batches, batches ? double(posts) / batches : 0.0);
  teardown(a);
  teardown(b);
  return 0;
}
