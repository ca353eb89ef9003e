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

#include "sluice/cuda.hpp"
#include "sluice/sluice.hpp"

using namespace sluice;
using Clock = std::chrono::steady_clock;

namespace {

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                        \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

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
  std::printf("%s\n", e.local_info().c_str());
  std::fflush(stdout);
  char ch;
  while (::read(0, &ch, 1) > 0) {
  }
  return 0;
}

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

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
  };
  std::vector<Cfg> cfgs = {{"default: 1 copy stream (SLUICE_NVLINK_STREAMS=1)", "1"},
                           {"SLUICE_NVLINK_STREAMS=2 (copies >= 8 MiB split over 2 streams)", "2"},
                           {"SLUICE_NVLINK_STREAMS=4", "4"}};

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
  auto raw = [&](uint64_t n, bool write, int iters) {
    for (int w = 0; w < 3; ++w) {
      if (write) CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, n, s));
      else CK(cudaMemcpyPeerAsync(b0, 0, b1, peer_dev, n, s));
      CK(cudaStreamSynchronize(s));
    }
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if (write) CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, n, s));
      else CK(cudaMemcpyPeerAsync(b0, 0, b1, peer_dev, n, s));
      CK(cudaStreamSynchronize(s));
    }
    return secs(Clock::now() - t0) / iters;
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
    auto src = e.allocate(max_bytes, Location::cuda(0));
    auto ep = e.connect(info);
    if (ep.transport() != "nvlink") {
      out("endpoint runs over " + ep.transport() + ", not nvlink");
      return 1;
    }
    auto dst = *ep.remote_region("dst");
    out("");
    out("## Bandwidth, " + cfg.name + " (one op at a time, GB/s = 1e9 B/s)");
    out("| size | sluice WRITE | raw cudaMemcpyPeerAsync 0->1 | ratio | sluice READ | raw 1->0 | ratio |");
    out("|---|---|---|---|---|---|---|");
    for (uint64_t n : sizes) {
      int iters = iters_for(n);
      double t[2];
      for (int dir = 0; dir < 2; ++dir) {
        Batch b{{src.handle, 0, dst, 0, n}};
        for (int w = 0; w < 3; ++w) (dir == 0 ? ep.write(b) : ep.read(b)).get();
        auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) (dir == 0 ? ep.write(b) : ep.read(b)).get();
        t[dir] = secs(Clock::now() - t0) / iters;
      }
      double rw = raw(n, true, iters), rr = raw(n, false, iters);
      auto gb = [&](double t) { return n / t / 1e9; };
      out("| " + human(n) + " | " + fmt("%.1f", gb(t[0])) + " | " + fmt("%.1f", gb(rw)) + " | " +
          fmt("%.3f", rw / t[0]) + " | " + fmt("%.1f", gb(t[1])) + " | " + fmt("%.1f", gb(rr)) + " | " +
          fmt("%.3f", rr / t[1]) + " |");
    }
    ep.close();
  }

  // Small-op latency: submit -> Future complete, one at a time.
  out("");
  out("## Small-op latency (us, median of 2000; copy engine vs SM copy kernel vs raw memcpy+sync)");
  out("| size | WRITE CE | WRITE SM | READ CE | READ SM | raw cudaMemcpyPeerAsync+sync |");
  out("|---|---|---|---|---|---|");
  std::vector<uint64_t> small = {8, 64, 512, 4096, 32768, 65536, 262144};
  std::vector<std::vector<double>> lat(small.size(), std::vector<double>(5));
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
    std::vector<double> v;
    for (int i = 0; i < 2200; ++i) {
      auto t0 = Clock::now();
      CK(cudaMemcpyPeerAsync(b1, peer_dev, b0, 0, small[k], s));
      CK(cudaStreamSynchronize(s));
      if (i >= 200) v.push_back(secs(Clock::now() - t0) * 1e6);
    }
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    lat[k][4] = v[v.size() / 2];
    out("| " + human(small[k]) + " | " + fmt("%.1f", lat[k][0]) + " | " + fmt("%.1f", lat[k][1]) + " | " +
        fmt("%.1f", lat[k][2]) + " | " + fmt("%.1f", lat[k][3]) + " | " + fmt("%.1f", lat[k][4]) + " |");
  }

  if (!out_path.empty()) std::ofstream(out_path) << report.str();
  ::close(in[1]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return 0;
}
