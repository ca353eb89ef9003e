// C++ side of op_overhead.py: the same calls through the C++ API, to compare per-call cost.
// Built by python/CMakeLists.txt when SLUICE_PY_OVERHEAD_BENCH=ON.
#include <chrono>
#include <cstdio>
#include <vector>

#include "sluice/sluice.hpp"

using Clock = std::chrono::steady_clock;

template <class F>
double ns_per(int n, F&& f) {
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) f(i);
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / n);
  }
  return best;
}

int main() {
  sluice::EngineConfig c;
  c.channels = 1;
  sluice::Engine a(c), b(c);
  std::vector<uint8_t> src(1 << 20), dst(1 << 20);
  b.register_memory(src.data(), src.size(), sluice::Location::host(), "src");
  auto hd = a.register_memory(dst.data(), dst.size());
  auto ep = a.connect(b.listen_address());
  auto r = *ep.remote_region("src");
  auto done = ep.read({{hd, 0, r, 0, 8}});
  done.wait();
  volatile bool sink = false;
  std::printf("%-40s %10.1f ns\n", "future.test() (completed)", ns_per(2000000, [&](int) { sink = done.test(); }));
  std::printf("%-40s %10.1f ns\n", "future.bytes()", ns_per(2000000, [&](int) { sink = done.bytes() != 0; }));
  for (const char* transport : {"shm", "tcp"}) {
    sluice::ConnectOptions co;
    co.transport = transport;
    auto e2 = a.connect(b.listen_address(), co);
    std::vector<sluice::Future> fs;
    fs.reserve(20000);
    double submit = ns_per(2000, [&](int i) { fs.push_back(e2.read({{hd, 0, r, 0, 8}})); });
    for (auto& f : fs) f.wait();
    fs.clear();
    sluice::Batch b64;
    for (int j = 0; j < 64; ++j) b64.push_back({hd, uint64_t(j) * 8, r, uint64_t(j) * 8, 8});
    double submit64 = ns_per(1000, [&](int) { fs.push_back(e2.read(b64)); });
    for (auto& f : fs) f.wait();
    double rt = ns_per(2000, [&](int) { e2.read({{hd, 0, r, 0, 8}}).wait(); });
    std::printf("%-40s %10.1f ns\n", (std::string(transport) + ": submit read, 1 x 8 B").c_str(), submit);
    std::printf("%-40s %10.1f ns\n", (std::string(transport) + ": submit read, 64 x 8 B").c_str(), submit64);
    std::printf("%-40s %10.1f ns\n", (std::string(transport) + ": read 8 B + wait (round trip)").c_str(), rt);
  }
  return sink ? 0 : 0;
}
