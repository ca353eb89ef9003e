// sluice-gpu-bench: nvlink transport READ/WRITE bandwidth and small-op latency between two
// processes (cuda:0 here, cuda:1 in a child), against raw cudaMemcpyPeerAsync in the same run.
//   sluice-gpu-bench [--out FILE] [--max-mib 256] [--peer-device 1]
// The AllGather benchmark against NCCL is allgather_bench.py beside this file.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "../common/cuda_check.hpp"
#include "sluice/cuda.hpp"
#include "sluice/sluice.hpp"

using namespace sluice;
using Clock = std::chrono::steady_clock;

namespace {

std::ostringstream report;
void out(const std::string& s) {
  std::cout << s << std::endl;
  report << s << "\n";
}

int child_main(int dev, uint64_t bytes) {
  EngineConfig c;
  Engine e(c);
  auto a = e.allocate(bytes, Location::cuda(dev), "dst");
  (void)a;
  // The same size in plain cudaMalloc memory (shared through cudaIpc handles).
  void* p = nullptr;
  cudaSetDevice(dev);
  if (cudaMalloc(&p, bytes) != cudaSuccess) return 3;
  e.register_memory(p, bytes, Location::cuda(dev), "dst_malloc");
  e.allocate(64 << 20, Location::host(), "host_dst");  // for the staged tcp / shm numbers
  std::printf("%s\n", e.local_info().c_str());
  std::fflush(stdout);
  char ch;
  while (::read(0, &ch, 1) > 0) {
  }
  return 0;
}

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

std::string fmt(const char* f, double a) {
  char b[64];
  std::snprintf(b, sizeof b, f, a);
  return b;
}

std::string human(uint64_t n) {
  if (n >= (1ull << 20)) return std::to_string(n >> 20) + " MiB";
  if (n >= 1024) return std::to_string(n >> 10) + " KiB";
  return std::to_string(n) + " B";
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  uint64_t max_mib = 256;
  int peer_dev = 1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--child=", 0) == 0) return child_main(std::atoi(argv[i] + 8), std::strtoull(argv[i + 1], nullptr, 10));
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--max-mib" && i + 1 < argc) max_mib = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--peer-device" && i + 1 < argc) peer_dev = std::atoi(argv[++i]);
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "no CUDA device: %s\n", cuda::unavailable_reason().c_str());
    return 0;
  }
  if (cuda::device_count() < 2) peer_dev = 0;
  const uint64_t max_bytes = max_mib << 20;

  // The peer process.
  int in[2], outp[2];
  if (::pipe(in) || ::pipe(outp)) return 1;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(outp[1], 1);
    ::close(in[0]);
    ::close(in[1]);
    ::close(outp[0]);
    ::close(outp[1]);
    std::string a1 = "--child=" + std::to_string(peer_dev), a2 = std::to_string(max_bytes);
    char* av[] = {const_cast<char*>("/proc/self/exe"), a1.data(), a2.data(), nullptr};
    ::execv("/proc/self/exe", av);
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(outp[1]);
  std::string info;
  char ch;
  while (::read(outp[0], &ch, 1) == 1 && ch != '\n') info += ch;

  CK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  out("# sluice-gpu-bench: nvlink transport, cuda:0 (this process) <-> cuda:" + std::to_string(peer_dev) +
      " (peer process); " + prop.name);

  struct Cfg {
    std::string name;
    const char* streams;
    bool malloc_mem;  // cudaMalloc memory registered on both sides instead of engine allocations
  };
  std::vector<Cfg> cfgs = {
      {"engine allocations (cuMem, POSIX fd), 1 copy stream (default)", "1", false},
      {"cudaMalloc memory registered on both sides (cudaIpc), 1 copy stream", "1", true},
      {"engine allocations, SLUICE_NVLINK_STREAMS=2 (copies >= 8 MiB split over 2 streams)", "2", false},
      {"cudaMalloc memory, SLUICE_NVLINK_STREAMS=2", "2", true}};

  // Raw baseline buffers in this process on both devices.
  void *b0 = nullptr, *b1 = nullptr;
  CK(cudaMalloc(&b0, max_bytes));
  CK(cudaSetDevice(peer_dev));
  CK(cudaMalloc(&b1, max_bytes));
  CK(cudaSetDevice(0));
  if (peer_dev != 0) {
    cudaError_t e = cudaDeviceEnablePeerAccess(peer_dev, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
    cudaGetLastError();
  }
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto iters_for = [](uint64_t n) { return (int)std::clamp<uint64_t>((4ull << 30) / n, 10, 200); };
  // `depth` copies in flight: issue depth, then wait for all (depth 1 = one at a time).
  auto raw = [&](uint64_t n, bool write, int iters, int depth = 1) {
    auto issue = [&] {
      if (write) CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, n, s));
      else CK(cudaMemcpyPeerAsync(b0, 0, b1, peer_dev, n, s));
    };
    for (int w = 0; w < 3; ++w) issue();
    CK(cudaStreamSynchronize(s));
    int rounds = std::max(1, iters / depth);
    auto t0 = Clock::now();
    for (int i = 0; i < rounds; ++i) {
      for (int d = 0; d < depth; ++d) issue();
      CK(cudaStreamSynchronize(s));
    }
    return secs(Clock::now() - t0) / (rounds * depth);
  };

  std::vector<uint64_t> sizes;
  for (uint64_t n = 64 << 10; n <= max_bytes; n *= 4) sizes.push_back(n);
  if (sizes.back() != max_bytes) sizes.push_back(max_bytes);

  std::vector<std::vector<double>> results;  // per cfg: per size: write, read
  for (auto& cfg : cfgs) {
    ::setenv("SLUICE_NVLINK_SM_COPY_MAX", "0", 1);
    ::setenv("SLUICE_NVLINK_STREAMS", cfg.streams, 1);
    EngineConfig c;  // default channels and chunk size: the transport merges the pieces back
    Engine e(c);
    Allocation src;
    if (cfg.malloc_mem) {
      src.ptr = b0;
      src.length = max_bytes;
      src.handle = e.register_memory(b0, max_bytes, Location::cuda(0));
    } else {
      src = e.allocate(max_bytes, Location::cuda(0));
    }
    auto ep = e.connect(info);
    if (ep.transport() != "nvlink") {
      out("endpoint runs over " + ep.transport() + ", not nvlink");
      return 1;
    }
    auto dst = *ep.remote_region(cfg.malloc_mem ? "dst_malloc" : "dst");
    out("");
    out("## Bandwidth, " + cfg.name + " (one op at a time, GB/s = 1e9 B/s)");
    out("| size | in flight | sluice WRITE | raw cudaMemcpyPeerAsync 0->1 | ratio | sluice READ | raw 1->0 | ratio |");
    out("|---|---|---|---|---|---|---|---|");
    for (uint64_t n : sizes) {
      int iters = iters_for(n);
      for (int depth : {1, 4}) {
        double t[2];
        int rounds = std::max(1, iters / depth);
        for (int dir = 0; dir < 2; ++dir) {
          Batch b{{src.handle, 0, dst, 0, n}};
          for (int w = 0; w < 3; ++w) (dir == 0 ? ep.write(b) : ep.read(b)).get();
          std::vector<Future> fs(depth);
          auto t0 = Clock::now();
          for (int i = 0; i < rounds; ++i) {
            for (int d = 0; d < depth; ++d) fs[d] = dir == 0 ? ep.write(b) : ep.read(b);
            for (auto& f : fs) f.get();
          }
          t[dir] = secs(Clock::now() - t0) / (rounds * depth);
        }
        double rw = raw(n, true, iters, depth), rr = raw(n, false, iters, depth);
        auto gb = [&](double t) { return n / t / 1e9; };
        out("| " + human(n) + " | " + std::to_string(depth) + " | " + fmt("%.1f", gb(t[0])) + " | " + fmt("%.1f", gb(rw)) +
            " | " + fmt("%.3f", rw / t[0]) + " | " + fmt("%.1f", gb(t[1])) + " | " + fmt("%.1f", gb(rr)) + " | " +
            fmt("%.3f", rr / t[1]) + " |");
      }
    }
    ep.close();
  }

  // Diagnostic: the raw copy between cuMem (engine) allocations of one process.
  {
    Engine e;
    auto v0 = e.allocate(max_bytes, Location::cuda(0));
    auto v1 = e.allocate(max_bytes, Location::cuda(peer_dev));
    out("");
    out("## Raw cudaMemcpyAsync between cuMem allocations in one process vs cudaMalloc (GB/s)");
    out("| size | cuMem 0->1 | cudaMalloc 0->1 |");
    out("|---|---|---|");
    for (uint64_t n : sizes) {
      if (n < (16ull << 20)) continue;
      int iters = iters_for(n);
      for (int w = 0; w < 3; ++w) CK(cudaMemcpyAsync(v1.ptr, v0.ptr, n, cudaMemcpyDefault, s));
      CK(cudaStreamSynchronize(s));
      auto t0 = Clock::now();
      for (int i = 0; i < iters; ++i) {
        CK(cudaMemcpyAsync(v1.ptr, v0.ptr, n, cudaMemcpyDefault, s));
        CK(cudaStreamSynchronize(s));
      }
      double tv = secs(Clock::now() - t0) / iters;
      double tr = raw(n, true, iters);
      out("| " + human(n) + " | " + fmt("%.1f", n / tv / 1e9) + " | " + fmt("%.1f", n / tr / 1e9) + " |");
    }
  }

  // Small-op latency: submit -> Future complete, one at a time.
  out("");
  out("## Small-op latency (us, median of 2000; copy engine vs SM copy kernel vs raw memcpy+sync)");
  out("| size | WRITE CE | WRITE SM | READ CE | READ SM | raw 0->1 cudaMemcpyPeerAsync+sync | raw 1->0 (READ's path) |");
  out("|---|---|---|---|---|---|");
  // 8 B twice: first right after connect, and again last (whether the first rows pay for setup
  // still running on the engine's threads).
  std::vector<uint64_t> small = {8, 64, 512, 4096, 32768, 65536, 262144, 8};
  std::vector<std::vector<double>> lat(small.size(), std::vector<double>(6));
  ::setenv("SLUICE_NVLINK_STREAMS", "1", 1);
  for (int mode = 0; mode < 2; ++mode) {
    ::setenv("SLUICE_NVLINK_SM_COPY_MAX", mode ? "1048576" : "0", 1);
    EngineConfig c;
    Engine e(c);
    auto src = e.allocate(1 << 20, Location::cuda(0));
    auto ep = e.connect(info);
    auto dst = *ep.remote_region("dst");
    for (size_t k = 0; k < small.size(); ++k) {
      for (int dir = 0; dir < 2; ++dir) {
        Batch b{{src.handle, 0, dst, 0, small[k]}};
        std::vector<double> v;
        for (int i = 0; i < 2200; ++i) {
          auto t0 = Clock::now();
          (dir == 0 ? ep.write(b) : ep.read(b)).get();
          if (i >= 200) v.push_back(secs(Clock::now() - t0) * 1e6);
        }
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        lat[k][dir * 2 + mode] = v[v.size() / 2];
      }
    }
    ep.close();
  }
  for (size_t k = 0; k < small.size(); ++k) {
    for (int dir = 0; dir < 2; ++dir) {
      std::vector<double> v;
      for (int i = 0; i < 2200; ++i) {
        auto t0 = Clock::now();
        if (dir == 0)
          CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, small[k], s));
        else
          CK(cudaMemcpyPeerAsync(b0, 0, b1, peer_dev, small[k], s));  // what a READ does: peer -> here
        CK(cudaStreamSynchronize(s));
        if (i >= 200) v.push_back(secs(Clock::now() - t0) * 1e6);
      }
      lat[k][4 + dir] = median(v);
    }
    out("| " + human(small[k]) + (k + 1 == small.size() ? " (again)" : "") + " | " + fmt("%.1f", lat[k][0]) + " | " + fmt("%.1f", lat[k][1]) + " | " +
        fmt("%.1f", lat[k][2]) + " | " + fmt("%.1f", lat[k][3]) + " | " + fmt("%.1f", lat[k][4]) + " | " + fmt("%.1f", lat[k][5]) + " |");
  }

  // Where a lone op's time goes: how long the submitting call takes and how long until the op
  // completes: by default (the call returns once the copy is queued, the waiter completes the
  // op), and with nvlink.waiters_poll=0 (ops up to nvlink.inline_max are polled to completion
  // inside the call, larger ones completed by the poller thread), against the raw copy's
  // launch and its launch + synchronize. Medians of 2000, us.
  out("");
  out("## Lone-op breakdown (us, median of 2000): call returns / op complete; raw: launch / launch + sync");
  out("| size | WRITE default call / complete | READ default call / complete | WRITE waiters_poll=0 call / complete | raw launch / + sync |");
  out("|---|---|---|---|---|");
  {
    const std::vector<uint64_t> lone = {8, 65536, 1 << 20};
    std::vector<std::vector<std::pair<double, double>>> res(lone.size(), std::vector<std::pair<double, double>>(4));
    ::setenv("SLUICE_NVLINK_SM_COPY_MAX", "0", 1);
    for (int mode = 0; mode < 2; ++mode) {
      if (mode) ::setenv("SLUICE_NVLINK_WAITERS_POLL", "0", 1);
      EngineConfig c;
      Engine e(c);
      auto src = e.allocate(1 << 20, Location::cuda(0));
      auto ep = e.connect(info);
      auto dst = *ep.remote_region("dst");
      for (size_t k = 0; k < lone.size(); ++k)
        for (int dir = 0; dir < 2; ++dir) {
          if (mode == 1 && dir == 1) continue;
          Batch b{{src.handle, 0, dst, 0, lone[k]}};
          std::vector<double> call, all;
          for (int i = 0; i < 2200; ++i) {
            auto t0 = Clock::now();
            Future f = dir == 0 ? ep.write(b) : ep.read(b);
            auto t1 = Clock::now();
            f.get();
            auto t2 = Clock::now();
            if (i >= 200) {
              call.push_back(secs(t1 - t0) * 1e6);
              all.push_back(secs(t2 - t0) * 1e6);
            }
          }
          res[k][mode == 0 ? dir : 2] = {median(call), median(all)};
        }
      ep.close();
    }
    ::unsetenv("SLUICE_NVLINK_WAITERS_POLL");
    for (size_t k = 0; k < lone.size(); ++k) {
      std::vector<double> call, all;
      for (int i = 0; i < 2200; ++i) {
        auto t0 = Clock::now();
        CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, lone[k], s));
        auto t1 = Clock::now();
        CK(cudaStreamSynchronize(s));
        auto t2 = Clock::now();
        if (i >= 200) {
          call.push_back(secs(t1 - t0) * 1e6);
          all.push_back(secs(t2 - t0) * 1e6);
        }
      }
      res[k][3] = {median(call), median(all)};
      auto cell = [&](int j) { return fmt("%.1f", res[k][j].first) + " / " + fmt("%.1f", res[k][j].second); };
      out("| " + human(lone[k]) + " | " + cell(0) + " | " + cell(1) + " | " + cell(2) + " | " + cell(3) + " |");
    }
  }

  // cuda memory over tcp and shm (staged through pinned host buffers).
  out("");
  out("## Staged cuda memory over tcp / shm, 64 MiB, one op at a time (GB/s)");
  out("| transport | here | remote | WRITE | READ |");
  out("|---|---|---|---|---|");
  for (const char* t : {"tcp", "shm"}) {
    for (int k = 0; k < 3; ++k) {
      const char* remote = k == 0 ? "dst" : "host_dst";
      const bool here_host = k == 2;  // the host-memory ceiling of the same transport
      const std::string label = std::string("| ") + t + " | " + (here_host ? "host (memfd)" : "cuda") + " | " +
                                (remote[0] == 'd' ? "cuda" : "host (memfd)") + " | ";
      try {
        Engine e;
        auto src = e.allocate(64 << 20, here_host ? Location::host() : Location::cuda(0));
        ConnectOptions o;
        o.transport = t;
        auto ep = e.connect(info, o);
        auto r = *ep.remote_region(remote);
        double tt[2];
        for (int dir = 0; dir < 2; ++dir) {
          Batch b{{src.handle, 0, r, 0, 64ull << 20}};
          (dir == 0 ? ep.write(b) : ep.read(b)).get();
          auto t0 = Clock::now();
          for (int i = 0; i < 5; ++i) (dir == 0 ? ep.write(b) : ep.read(b)).get();
          tt[dir] = secs(Clock::now() - t0) / 5;
        }
        out(label + fmt("%.1f", (64 << 20) / tt[0] / 1e9) + " | " + fmt("%.1f", (64 << 20) / tt[1] / 1e9) + " |");
      } catch (const std::exception& ex) {
        out(label + ex.what() + " | |");
      }
    }
  }

  // The thin post path (post_write / post_signal / flush) over nvlink, GPU to GPU: what a
  // port-channel proxy does per request. Counter: the last 8 bytes of the peer's "dst".
  out("");
  out("## Thin post path over nvlink (cuda:0 -> peer's cuda memory), one proxy thread");
  out("| pattern | requests | sluice posts | per request | raw host-launched cudaMemcpyPeerAsync | counter check |");
  out("|---|---|---|---|---|---|");
  ::setenv("SLUICE_NVLINK_SM_COPY_MAX", "0", 1);
  ::setenv("SLUICE_NVLINK_STREAMS", "1", 1);
  try {
    EngineConfig c;
    Engine e(c);
    auto src = e.allocate(max_bytes, Location::cuda(0));
    auto scratch = e.allocate(8, Location::cuda(0));
    auto ep = e.connect(info);
    auto dst = *ep.remote_region("dst");
    const uint64_t counter = max_bytes - 8;
    uint64_t signals = 0;
    // Zero the counter with a plain write.
    CK(cudaMemset(scratch.ptr, 0, 8));
    ep.write({{scratch.handle, 0, dst, counter, 8}}).get();
    auto check = [&] {
      ep.read({{scratch.handle, 0, dst, counter, 8}}).get();
      uint64_t v = 0;
      CK(cudaMemcpy(&v, scratch.ptr, 8, cudaMemcpyDeviceToHost));
      return v == signals ? std::string("ok (") + std::to_string(v) + ")"
                          : "FAILED: " + std::to_string(v) + " != " + std::to_string(signals);
    };
    struct Pattern {
      const char* name;
      uint64_t size;
      int n;
      bool signal;
    };
    for (const Pattern& pt : {Pattern{"8 B put + signal", 8, 100000, true}, Pattern{"8 B put", 8, 100000, false},
                              Pattern{"1 KiB put + signal", 1024, 50000, true},
                              Pattern{"1 MiB put + signal", 1 << 20, 2000, true},
                              Pattern{"128 MiB put + signal", std::min<uint64_t>(128ull << 20, max_bytes - 4096), 20, true}}) {
      auto once = [&](int n) {
        for (int i = 0; i < n; ++i) {
          uint64_t off = (uint64_t(i) * pt.size) % (max_bytes - 4096 - pt.size + 1);
          ep.post_write(src.handle, off, dst, off, pt.size);
          if (pt.signal) {
            ep.post_signal(dst, counter, 1);
            ++signals;
          }
        }
        ep.flush();
      };
      once(std::max(1, pt.n / 10));
      auto t0 = Clock::now();
      once(pt.n);
      double t = secs(Clock::now() - t0);
      // The same copies launched from the host one by one on one stream, synchronised once.
      auto r0 = Clock::now();
      for (int i = 0; i < pt.n; ++i) {
        uint64_t off = (uint64_t(i) * pt.size) % (max_bytes - 4096 - pt.size + 1);
        CK(cudaMemcpyPeerAsync(static_cast<char*>(b1) + off, peer_dev, static_cast<char*>(b0) + off, 0, pt.size, s));
      }
      CK(cudaStreamSynchronize(s));
      double tr = secs(Clock::now() - r0);
      auto rate = [&](double secs_) {
        return pt.size >= (1 << 20) ? fmt("%.1f GB/s", pt.size * double(pt.n) / secs_ / 1e9)
                                    : fmt("%.2f M req/s", pt.n / secs_ / 1e6);
      };
      out(std::string("| ") + pt.name + " | " + std::to_string(pt.n) + " | " + rate(t) + " | " +
          fmt("%.2f us", t / pt.n * 1e6) + " | " + rate(tr) + " | " + check() + " |");
    }
    ep.close();
  } catch (const std::exception& ex) {
    out(std::string("| post path failed: ") + ex.what() + " | | | | | |");
  }

  if (!out_path.empty()) std::ofstream(out_path) << report.str();
  ::close(in[1]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return 0;
}
