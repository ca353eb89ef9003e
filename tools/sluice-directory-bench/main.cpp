// sluice-directory-bench: how a directory store takes a cluster registering at once
// (docs/cluster.md, "Measured"). N simulated engines each get their own store directory,
// made by the same factory an Engine uses (make_directory: etcd lease + create-if-absent
// transaction, or Redis SET NX PX; its own connection and heartbeat thread), and publish
// concurrently a copy of a real engine's record under their own name. No listener,
// transport or registry per simulated engine: only the directory path is exercised.
//
// Then, with two real engines on loopback tcp, connect() by name against connect() by
// "host:port" (--connect-rounds of each, interleaved so that host load hits both alike).
//
//   sluice-directory-bench --directory URL [--engines 1000] [--concurrency 100]
//                          [--ttl-ms 10000] [--hold-s 0] [--connect-rounds 200]
//                          [--register-timeout-ms 5000] [--request-timeout-ms 2000]
//
// Prints the time until all are registered, per-publish latency, a check that every name
// resolves to its own engine (again after --hold-s seconds of heartbeats), the time to
// withdraw all, and the connect times. Exit status 1 if any engine failed to register,
// resolve or withdraw, or a connect failed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/engine_info.hpp"
#include "directory/directory_url.hpp"
#include "directory/peer_directory.hpp"
#include "directory/store_directory.hpp"
#include "sluice/sluice.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using sluice::detail::EngineInfo;
using sluice::detail::PeerDirectory;

struct Options {
  std::string directory;
  int engines = 1000;
  int concurrency = 100;
  int ttl_ms = 10000;
  int hold_s = 0;
  int connect_rounds = 200;
  int register_timeout_ms = 5000;  // EngineConfig::connect_timeout: bounds the first publish
  int request_timeout_ms = 2000;   // directory.request_timeout_ms: one store request
};

[[noreturn]] void usage(const char* argv0, const char* why) {
  std::fprintf(stderr,
               "%s: %s\nusage: %s --directory URL [--engines N] [--concurrency C] [--ttl-ms MS] [--hold-s S] [--connect-rounds R] [--register-timeout-ms MS] [--request-timeout-ms MS]\n",
               argv0, why, argv0);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage(argv[0], ("missing value for " + a).c_str());
    const char* v = argv[++i];
    auto num = [&](int lo) {
      char* end = nullptr;
      long n = std::strtol(v, &end, 10);
      if (*v == '\0' || *end != '\0' || n < lo || n > 1000000) usage(argv[0], (a + ": not a number >= " + std::to_string(lo)).c_str());
      return static_cast<int>(n);
    };
    if (a == "--directory") o.directory = v;
    else if (a == "--engines") o.engines = num(1);
    else if (a == "--concurrency") o.concurrency = num(1);
    else if (a == "--ttl-ms") o.ttl_ms = num(1000);
    else if (a == "--hold-s") o.hold_s = num(0);
    else if (a == "--connect-rounds") o.connect_rounds = num(0);
    else if (a == "--register-timeout-ms") o.register_timeout_ms = num(100);
    else if (a == "--request-timeout-ms") o.request_timeout_ms = num(100);
    else usage(argv[0], ("unknown option " + a).c_str());
  }
  if (o.directory.empty()) usage(argv[0], "--directory is required");
  return o;
}

// Runs fn(i) for i in [0, n) on `threads` threads; returns the wall time.
template <class Fn>
double run_parallel(int n, int threads, Fn fn) {
  std::atomic<int> next{0};
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < std::min(threads, n); ++t)
    ts.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < n;) fn(i);
    });
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

// How many names resolve, through one client directory, to the engine that registered them.
int count_resolving(PeerDirectory& client, const std::vector<EngineInfo>& infos, int threads, std::string* first_error) {
  std::atomic<int> ok{0};
  std::mutex mu;
  run_parallel(static_cast<int>(infos.size()), threads, [&](int i) {
    try {
      if (client.lookup(infos[i].name, Clock::now() + std::chrono::seconds(5)).engine_id == infos[i].engine_id) ++ok;
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(mu);
      if (first_error->empty()) *first_error = e.what();
    }
  });
  return ok.load();
}

// connect() by "host:port" (the engine asks the peer's listener for its info) against
// connect() by name (the info comes from the store), between two engines on loopback tcp.
void connect_overhead(const sluice::EngineConfig& base, int rounds, const std::string& run) {
  sluice::EngineConfig c = base;
  c.channels = 1;
  c.name = "ovh-server-" + run;
  sluice::Engine server(c);
  c.name = "ovh-client-" + run;
  sluice::Engine client(c);
  std::vector<double> by_addr, by_name;
  for (int i = 0; i < rounds; ++i) {
    for (int which = 0; which < 2; ++which) {
      auto t0 = Clock::now();
      sluice::Endpoint ep = client.connect(which == 0 ? server.listen_address() : "ovh-server-" + run);
      double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      (which == 0 ? by_addr : by_name).push_back(us);
      ep.close();
      server.accept(std::chrono::milliseconds(1000));
    }
  }
  std::printf("connect by address: median %.0f us p90 %.0f us (n=%d)\n", pct(by_addr, 0.5), pct(by_addr, 0.9), rounds);
  std::printf("connect by name:    median %.0f us p90 %.0f us; median overhead %+.0f us\n", pct(by_name, 0.5),
              pct(by_name, 0.9), pct(by_name, 0.5) - pct(by_addr, 0.5));
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  sluice::EngineConfig cfg;
  cfg.transports = {"tcp"};
  cfg.directory = o.directory;
  cfg.set("directory.ttl_ms", std::to_string(o.ttl_ms));
  cfg.connect_timeout = std::chrono::milliseconds(o.register_timeout_ms);
  cfg.set("directory.request_timeout_ms", std::to_string(o.request_timeout_ms));

  // The record each simulated engine publishes: a real engine's info (tcp, two regions), so
  // the store sees values of the size a cluster would write.
  std::string tmpl_text;
  std::vector<uint8_t> a(4096), b(1 << 20);
  {
    sluice::EngineConfig plain;
    plain.transports = {"tcp"};
    sluice::Engine e(plain);
    e.register_memory(a.data(), a.size(), sluice::Location::host(), "kv-cache");
    e.register_memory(b.data(), b.size(), sluice::Location::host(), "staging");
    tmpl_text = e.local_info();
  }
  const EngineInfo tmpl = EngineInfo::parse(tmpl_text);

  std::mt19937_64 rng(std::random_device{}());
  const std::string run = std::to_string(rng() % 100000);
  std::vector<EngineInfo> infos(o.engines, tmpl);
  std::vector<std::shared_ptr<PeerDirectory>> dirs(o.engines);
  for (int i = 0; i < o.engines; ++i) {
    char id[17];
    std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(rng()));
    infos[i].engine_id = id;
    infos[i].name = "bench-" + run + "-" + std::to_string(i);
    dirs[i] = sluice::detail::make_directory(cfg);  // what Engine's constructor does
  }
  std::printf("directory %s: %d engines, %d concurrent, engine info %zu bytes, ttl %d ms\n", o.directory.c_str(),
              o.engines, o.concurrency, tmpl_text.size(), o.ttl_ms);

  std::vector<double> lat_ms(o.engines, -1);
  std::atomic<int> failed{0};
  std::mutex mu;
  std::string first_error;
  double reg_s = run_parallel(o.engines, o.concurrency, [&](int i) {
    auto t0 = Clock::now();
    try {
      dirs[i]->publish(infos[i]);
      lat_ms[i] = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    } catch (const std::exception& e) {
      ++failed;
      std::lock_guard<std::mutex> lk(mu);
      if (first_error.empty()) first_error = e.what();
    }
  });
  lat_ms.erase(std::remove(lat_ms.begin(), lat_ms.end(), -1.0), lat_ms.end());
  std::printf("register: %d of %d in %.3f s (%.0f/s); per publish median %.1f ms p99 %.1f ms max %.1f ms\n",
              o.engines - failed.load(), o.engines, reg_s, o.engines / reg_s, pct(lat_ms, 0.5), pct(lat_ms, 0.99),
              pct(lat_ms, 1.0));
  if (!first_error.empty()) std::printf("  first failure: %s\n", first_error.c_str());

  auto client = sluice::detail::make_directory(cfg);
  int rc = failed.load() == 0 ? 0 : 1;
  auto check = [&](const char* when) {
    std::string err;
    auto t0 = Clock::now();
    // The check reads from one process: a bounded number of lookups at a time, as a real
    // client would, so that it measures the store and not a thousand-thread lookup storm.
    int ok = count_resolving(*client, infos, std::min(o.concurrency, 64), &err);
    double s = std::chrono::duration<double>(Clock::now() - t0).count();
    std::printf("resolve %s: %d of %d names lead to their engine (%.3f s)\n", when, ok, o.engines, s);
    if (!err.empty()) std::printf("  first failure: %s\n", err.c_str());
    if (ok != o.engines) rc = 1;
  };
  check("after registering");
  if (o.hold_s > 0) {
    std::this_thread::sleep_for(std::chrono::seconds(o.hold_s));
    check(("after " + std::to_string(o.hold_s) + " s of heartbeats").c_str());
  }

  double wd_s = run_parallel(o.engines, o.concurrency, [&](int i) { dirs[i]->withdraw(infos[i].engine_id); });
  // Gone = the store itself answers "absent" (read with the bare store operations: a lookup
  // would wait for the name to come back).
  auto url = sluice::detail::parse_directory_url(o.directory);
  auto store = sluice::detail::make_store_backend(url, std::chrono::milliseconds(o.ttl_ms));
  std::atomic<int> left{0};
  run_parallel(o.engines, o.concurrency, [&](int i) {
    try {
      if (store->get(url.prefix + "/" + infos[i].name, Clock::now() + std::chrono::seconds(5))) ++left;
    } catch (const std::exception&) {
      ++left;  // unknown counts as left
    }
  });
  std::printf("withdraw: %d engines in %.3f s; %d names still resolve\n", o.engines, wd_s, left.load());
  if (left.load() != 0) rc = 1;
  dirs.clear();

  if (o.connect_rounds > 0) {
    try {
      connect_overhead(cfg, o.connect_rounds, run);
    } catch (const std::exception& e) {
      std::printf("connect: failed: %s\n", e.what());
      rc = 1;
    }
  }
  return rc;
}
