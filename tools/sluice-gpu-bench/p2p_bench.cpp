// sluice-p2p-bench: where a stream-ordered send/recv's time goes (include/sluice/stream_p2p.hpp),
// two ranks in this process on cuda:0 and cuda:1, one thread each. Per size, one-way time of
// a ping-pong in three ways, the same run:
//   gpu     N round trips queued ahead on one stream per rank (send, recv, send, ...), timed by
//           the host around the whole chain: the kernels' own latency, no launch in the path;
//   events  one round trip per sample as the torch backend issues it (kernels on a send and a
//           recv stream per rank, ordered through the caller's stream by events), host
//           synchronize at the end of each sample;
//   raw     cudaMemcpyPeerAsync of the same bytes, one direction per sample (a copy-engine
//           ceiling for the data, with its own launch and synchronize).
//   sluice-p2p-bench [--max-mib 256] [--iters 50] [--lanes N] [--json]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/cuda_check.hpp"
#include "sluice/cuda.hpp"
#include "sluice/stream_p2p.hpp"

using namespace sluice;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Rank {
  int dev = 0;
  cudaStream_t cur = nullptr, snd = nullptr, rcv = nullptr;
  cudaEvent_t ev[4]{};
  uint8_t* buf = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  uint64_t max_mib = 256;
  int iters = 50;
  int lanes = 0;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--max-mib" && i + 1 < argc) max_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (a == "--lanes" && i + 1 < argc) lanes = std::atoi(argv[++i]);
    else if (a == "--json") json = true;
    else {
      std::fprintf(stderr, "usage: sluice-p2p-bench [--max-mib 256] [--iters 50] [--lanes N] [--json]\n");
      return 2;
    }
  }
  if (cuda::device_count() < 2) {
    std::fprintf(stderr, "sluice-p2p-bench: needs 2 GPUs, have %d: %s\n", cuda::device_count(),
                 cuda::unavailable_reason().c_str());
    return 1;
  }
  const uint64_t max_bytes = max_mib << 20;
  cuda::StreamP2pOptions o;
  o.lanes = lanes;
  std::unique_ptr<cuda::StreamP2p> p[2];
  Rank rk[2];
  for (int r = 0; r < 2; ++r) {
    rk[r].dev = r;
    CK(cudaSetDevice(r));
    p[r] = std::make_unique<cuda::StreamP2p>(r, std::vector<int>{1 - r}, r, o);
    for (cudaStream_t* s : {&rk[r].cur, &rk[r].snd, &rk[r].rcv}) CK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    for (auto& e : rk[r].ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaMalloc(reinterpret_cast<void**>(&rk[r].buf), max_bytes));
    CK(cudaMemset(rk[r].buf, r, max_bytes));
  }
  p[0]->connect(1, p[1]->handle());
  p[1]->connect(0, p[0]->handle());
  CK(cudaSetDevice(0));
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (can) {
    cudaError_t e = cudaDeviceEnablePeerAccess(1, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
    cudaGetLastError();
  }

  std::barrier sync(2);
  // mode 0: gpu chain; mode 1: events as the torch backend; one-way seconds per sample.
  auto play = [&](int r, uint64_t n, int mode, int reps, std::vector<double>* times) {
    Rank& me = rk[r];
    CK(cudaSetDevice(me.dev));
    for (int it = 0; it < reps; ++it) {
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      const int chain = mode == 0 ? 20 : 1;
      for (int k = 0; k < chain; ++k) {
        for (int step = 0; step < 2; ++step) {
          const bool sending = (step == 0) == (r == 0);
          if (mode == 0) {
            if (sending) p[r]->send(1 - r, me.buf, n, me.cur);
            else p[r]->recv(1 - r, me.buf, n, me.cur);
          } else {
            cudaStream_t s = sending ? me.snd : me.rcv;
            CK(cudaEventRecord(me.ev[0], me.cur));
            CK(cudaStreamWaitEvent(s, me.ev[0], 0));
            if (sending) p[r]->send(1 - r, me.buf, n, s);
            else p[r]->recv(1 - r, me.buf, n, s);
            CK(cudaEventRecord(me.ev[1], s));
            CK(cudaStreamWaitEvent(me.cur, me.ev[1], 0));
          }
        }
      }
      CK(cudaStreamSynchronize(me.cur));
      if (times) times->push_back(std::chrono::duration<double>(Clock::now() - t0).count() / (2.0 * chain));
    }
  };
  auto raw = [&](uint64_t n, int reps) {
    CK(cudaSetDevice(0));
    std::vector<double> t;
    for (int it = 0; it < reps; ++it) {
      const auto t0 = Clock::now();
      CK(cudaMemcpyPeerAsync(rk[1].buf, 1, rk[0].buf, 0, n, rk[0].cur));
      CK(cudaStreamSynchronize(rk[0].cur));
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return median(t);
  };

  if (!json) {
    std::printf("# sluice-p2p-bench: cuda:0 <-> cuda:1, %d samples per cell, one-way us (median)\n", iters);
    std::printf("| bytes | gpu chain | events (as torch) | raw cudaMemcpyPeerAsync | gpu GB/s | raw GB/s |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  } else {
    std::printf("[");
  }
  bool first = true;
  for (uint64_t n = 8; n <= max_bytes; n *= (n < (1 << 20) ? 4 : 2)) {
    const int reps = n >= (64ull << 20) ? std::max(5, iters / 5) : iters;
    double res[2];
    for (int mode = 0; mode < 2; ++mode) {
      std::vector<double> t0, t1;
      std::thread a([&] { play(0, n, mode, 2, nullptr); play(0, n, mode, reps, &t0); });
      std::thread b([&] { play(1, n, mode, 2, nullptr); play(1, n, mode, reps, &t1); });
      a.join();
      b.join();
      res[mode] = median(t0);
    }
    const double rw = raw(n, reps);
    for (int r = 0; r < 2; ++r)
      if (!p[r]->status().ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, p[r]->status().to_string().c_str());
        return 1;
      }
    if (json) {
      std::printf("%s{\"bytes\": %llu, \"gpu_us\": %.2f, \"events_us\": %.2f, \"raw_us\": %.2f}", first ? "" : ", ",
                  (unsigned long long)n, res[0] * 1e6, res[1] * 1e6, rw * 1e6);
    } else {
      std::printf("| %llu | %.1f | %.1f | %.1f | %.1f | %.1f |\n", (unsigned long long)n, res[0] * 1e6, res[1] * 1e6,
                  rw * 1e6, n / res[0] / 1e9, n / rw / 1e9);
    }
    first = false;
    std::fflush(stdout);
  }
  if (json) std::printf("]\n");
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    cudaDeviceSynchronize();
  }
  return 0;
}
