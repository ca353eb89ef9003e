// sluice-bench: a transfer benchmark in the spirit of DLSlime's agg_transfer_bench.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "baseline.hpp"
#include "options.hpp"
#include "sluice/sluice.hpp"

using namespace std::chrono_literals;
using bench::Options;

namespace {

constexpr uint64_t kMaxRegion = 256ull << 20;
constexpr const char* kRegionName = "bench";
constexpr const char* kInitiatorRegion = "bench-initiator";  // pingpong: where the target writes back

uint64_t region_length(const Options& o) {
  uint64_t want = o.max_size * static_cast<uint64_t>(o.batch);
  uint64_t n = std::max(o.max_size, std::min(want, kMaxRegion));
  // post: a counter page after the data (measure_post).
  return o.op == "post" ? std::max<uint64_t>(n + 4096, 8192) : n;
}

uint8_t pattern(uint64_t offset, uint64_t seed) {
  return static_cast<uint8_t>(((offset + seed) * 2654435761ull) >> 13);
}

// Memory for the benchmark: engine-allocated (shareable) or plain and registered.
struct Buffer {
  sluice::Engine* engine = nullptr;
  sluice::Allocation alloc;
  uint8_t* ptr = nullptr;
  uint64_t length = 0;
  sluice::MemoryHandle handle;
  Buffer(sluice::Engine& e, uint64_t len, bool memfd, const std::string& name) : engine(&e), length(len) {
    if (memfd) {
      alloc = e.allocate(len, sluice::Location::host(), name);
      ptr = static_cast<uint8_t*>(alloc.ptr);
      handle = alloc.handle;
    } else {
      ptr = static_cast<uint8_t*>(std::aligned_alloc(4096, (len + 4095) / 4096 * 4096));
      std::memset(ptr, 0, len);
      handle = e.register_memory(ptr, len, sluice::Location::host(), name);
    }
  }
  ~Buffer() {
    if (alloc.ptr) {
      engine->free(alloc);
    } else {
      engine->unregister_memory(handle);
      std::free(ptr);
    }
  }
};

sluice::EngineConfig engine_config(const Options& o, bool listen) {
  sluice::EngineConfig c;
  c.channels = o.channels;
  if (!o.transport.empty()) c.transports = {o.transport};
  if (listen) {
    auto colon = o.listen.rfind(':');
    c.listen_host = o.listen.substr(0, colon);
    c.listen_port = static_cast<uint16_t>(std::stoi(o.listen.substr(colon + 1)));
  }
  return c;
}

// ---------------------------------------------------------------- target

std::atomic<bool> g_stop{false};

constexpr uint32_t kFlagPhase = 0x80000000u;  // pingpong imm: a flag phase of this size follows

uint8_t flag_value(uint64_t i) { return static_cast<uint8_t>(i % 255 + 1); }

// Spins until *flag == want; false after 10 s or when the endpoint is gone. Yields after
// 200 us, so a transport whose writes land from an engine thread (tcp) still gets a core.
bool spin_for(sluice::Endpoint& ep, const volatile uint8_t* flag, uint8_t want) {
  auto start = std::chrono::steady_clock::now();
  bool yield = false;
  for (uint64_t n = 1; *flag != want; ++n) {
    if (yield) std::this_thread::yield();
    if ((n & 0xff) != 0) continue;
    auto waited = std::chrono::steady_clock::now() - start;
    yield = waited > 200us;
    if (waited > 10s || ((n & 0xffff) == 0 && (!ep.connected() || g_stop))) {
      std::fprintf(stderr, "pingpong: no write arrived (flag %u, waiting for %u)\n", *flag, want);
      return false;
    }
  }
  return true;
}

// Target side of a flag phase: the next imm is the iteration count; ack once the flag is
// cleared, then echo every write (the initiator's bytes, counter included) back at offset size.
bool serve_flag_phase(sluice::Endpoint& ep, Buffer& buf, sluice::RemoteHandle back, uint64_t back_len, uint64_t size) {
  auto n = ep.imm_recv();
  if (!n.wait_for(10s) || !n.status().ok()) return false;
  uint64_t iters = n.imm();
  if (size == 0 || size > buf.length || 2 * size > back_len) {
    std::fprintf(stderr, "pingpong: size %llu does not fit the regions\n", (unsigned long long)size);
    return false;
  }
  volatile uint8_t* flag = buf.ptr + size - 1;
  *flag = 0;
  // The ack copies the cleared byte onto the initiator's flag, clearing it as well.
  if (!ep.write_with_imm({{buf.handle, size - 1, back, 2 * size - 1, 1}}, 0).wait().ok()) return false;
  for (uint64_t i = 0; i < iters; ++i) {
    if (!spin_for(ep, flag, flag_value(i))) return false;
    if (!ep.write({{buf.handle, 0, back, size, size}}).wait().ok()) return false;
  }
  return true;
}

void serve_endpoint(sluice::Endpoint ep, Buffer& buf, const Options& o) {
  if (o.op == "send") {
    std::deque<sluice::Future> window;
    const size_t depth = static_cast<size_t>(o.batch) * o.concurrency * 2;
    while (!g_stop && ep.connected()) {
      while (window.size() < depth) window.push_back(ep.recv(buf.handle, 0, o.max_size));
      if (!window.front().wait_for(200ms)) continue;
      if (!window.front().status().ok()) break;
      window.pop_front();
    }
  } else if (o.op == "pingpong") {
    // imm mode: echo every imm with a write_with_imm of the same size (the imm carries it).
    // flag mode (imm has kFlagPhase set): the initiator announces a size and an iteration
    // count, then each round trip is a plain write whose last byte is a counter, found by
    // spinning on memory, as ib_write_lat does.
    std::optional<sluice::RemoteHandle> back;
    uint64_t back_len = 0;
    while (!g_stop && ep.connected()) {
      auto f = ep.imm_recv();
      while (!f.wait_for(200ms) && !g_stop) {
      }
      if (!f.test() || !f.status().ok()) break;
      uint64_t size = f.imm() & ~kFlagPhase;
      if (!back) {
        ep.refresh_remote_regions();
        back = ep.remote_region(kInitiatorRegion);
        for (auto& r : ep.remote_regions())
          if (back && r.id == back->id) back_len = r.length;
        if (!back) {
          std::fprintf(stderr, "pingpong: the initiator has no region named %s\n", kInitiatorRegion);
          break;
        }
      }
      if (f.imm() & kFlagPhase) {
        if (!serve_flag_phase(ep, buf, *back, back_len, size)) break;
        continue;
      }
      size = std::max<uint64_t>(1, std::min({size, back_len, buf.length}));
      if (!ep.write_with_imm({{buf.handle, 0, *back, 0, size}}, static_cast<uint32_t>(size)).wait().ok()) break;
    }
  } else if (o.op == "write_imm") {
    while (!g_stop && ep.connected()) {
      auto f = ep.imm_recv();
      while (!f.wait_for(200ms) && !g_stop) {
      }
      if (!f.test() || !f.status().ok()) break;
    }
  }
}

int run_target(const Options& o) {
  sluice::Engine engine(engine_config(o, true));
  Buffer buf(engine, region_length(o), o.memfd, kRegionName);
  for (uint64_t i = 0; i < buf.length; ++i) buf.ptr[i] = pattern(i, 0);
  std::printf("SLUICE_TARGET %s\n", engine.listen_address().c_str());
  std::fflush(stdout);
  if (o.role == "target")
    std::fprintf(stderr, "target listening on %s (transports:%s); Ctrl-C to stop\n", engine.listen_address().c_str(),
                 [&] { std::string s; for (auto& t : engine.transports()) s += " " + t; return s; }().c_str());
  std::vector<std::thread> servers;
  // In loopback mode the parent holds our stdin: EOF means it is done.
  std::thread watcher;
  if (o.role == "loopback")
    watcher = std::thread([] {
      char c;
      while (::read(0, &c, 1) > 0) {
      }
      g_stop = true;
    });
  while (!g_stop) {
    auto ep = engine.accept(200ms);
    if (ep) servers.emplace_back([&, e = *ep] { serve_endpoint(e, buf, o); });
  }
  engine.close();  // fails the servers' pending recvs, so they return
  for (auto& t : servers) t.join();
  if (watcher.joinable()) watcher.join();
  return 0;
}

// ---------------------------------------------------------------- initiator

struct Row {
  std::string transport;
  int channels;
  uint64_t size;
  int batch;
  int concurrency;
  double latency_ms;
  double mbps;
  double ceiling_mbps = 0;  // 0 = not measured
  double ceiling_lat_us = 0;
  uint64_t errors = 0;
  bool checked = false;
};

sluice::Batch make_batch(const Options& o, uint64_t size, uint64_t region, sluice::MemoryHandle local,
                         sluice::RemoteHandle remote, uint64_t first) {
  sluice::Batch b;
  // Every batch covers the same (batch x size) window, as the ceilings do.
  uint64_t slots = std::max<uint64_t>(1, std::min<uint64_t>(region, size * o.batch) / size);
  for (int j = 0; j < o.batch; ++j) {
    uint64_t off = ((first + j) % slots) * size;
    b.push_back({local, off, remote, off, size});
  }
  return b;
}

// Submit one unit of work (a batch, or `batch` sends) and return its futures.
std::vector<sluice::Future> submit(sluice::Endpoint& ep, const Options& o, const sluice::Batch& b, uint32_t imm) {
  if (o.op == "read") return {ep.read(b)};
  if (o.op == "write") return {ep.write(b)};
  if (o.op == "write_imm") return {ep.write_with_imm(b, imm)};
  std::vector<sluice::Future> fs;
  for (auto& a : b) fs.push_back(ep.send(a.local, a.local_offset, a.length));
  return fs;
}

bool verify(sluice::Endpoint& ep, const Options& o, uint64_t size, Buffer& local, Buffer& check,
            sluice::RemoteHandle remote, uint64_t region) {
  uint64_t n = std::min<uint64_t>(o.batch, std::max<uint64_t>(1, region / size));
  sluice::Batch b;
  for (uint64_t j = 0; j < n; ++j) b.push_back({check.handle, j * size, remote, j * size, size});
  uint64_t seed = 0;
  if (o.op == "read") {
    if (!ep.read(b).wait().ok()) return false;
  } else if (o.op == "send" || o.op == "pingpong") {
    return true;  // messages overlap in the target's buffer; their lengths were checked
  } else {
    seed = size * 7 + 1;
    for (uint64_t i = 0; i < n * size; ++i) local.ptr[i] = pattern(i, seed);
    sluice::Batch w;
    for (uint64_t j = 0; j < n; ++j) w.push_back({local.handle, j * size, remote, j * size, size});
    if (!ep.write(w).wait().ok() || !ep.read(b).wait().ok()) return false;
  }
  for (uint64_t i = 0; i < n * size; ++i)
    if (check.ptr[i] != pattern(i, seed)) {
      std::fprintf(stderr, "CHECK FAILED at size %s byte %llu\n", bench::size_text(size).c_str(), (unsigned long long)i);
      return false;
    }
  if (o.op != "read")  // restore the target's pattern for later read checks
    for (uint64_t i = 0; i < n * size; ++i) local.ptr[i] = pattern(i, 0);
  return true;
}

// Half round trips. imm mode: write_with_imm there, wait for the target's write_with_imm
// back. flag mode (ib_write_lat's loop): write with a counter in the last byte, wait for the
// write's completion, spin until the target's echo lands at offset size.
Row measure_pingpong(sluice::Endpoint& ep, const Options& o, uint64_t size, Buffer& local, sluice::RemoteHandle remote) {
  int iters = o.iterations > 0 ? o.iterations : 2000;
  const int warm = std::min(iters / 10 + 1, 100);
  uint64_t errors = 0;
  auto fail = [&](const sluice::Status& st) {
    if (!errors) std::fprintf(stderr, "pingpong failed: %s\n", st.to_string().c_str());
    ++errors;
    return false;
  };
  const bool flag_mode = o.notify == "flag";
  volatile uint8_t* echo = local.ptr + 2 * size - 1;
  uint64_t round = 0;
  auto once = [&] {
    if (flag_mode) {
      uint8_t c = flag_value(round++);
      local.ptr[size - 1] = c;
      sluice::Status st = ep.write({{local.handle, 0, remote, 0, size}}).wait();
      if (!st.ok()) return fail(st);
      if (!spin_for(ep, echo, c)) return fail(sluice::Status{sluice::ErrorCode::kTimeout, "no echo"});
      return true;
    }
    auto f = ep.write_with_imm({{local.handle, 0, remote, 0, size}}, static_cast<uint32_t>(size));
    auto back = ep.imm_recv();
    sluice::Status st = back.wait();
    if (st.ok()) st = f.wait();
    return st.ok() || fail(st);
  };
  if (flag_mode) {
    local.ptr[size - 1] = 0;
    sluice::Status st = ep.write_with_imm({{local.handle, 0, remote, 0, size}}, kFlagPhase | static_cast<uint32_t>(size)).wait();
    if (st.ok()) st = ep.write_with_imm({{local.handle, 0, remote, 0, 1}}, static_cast<uint32_t>(warm + iters)).wait();
    auto ack = ep.imm_recv();
    if (st.ok()) st = ack.wait();
    if (!st.ok()) fail(st);
  }
  for (int i = 0; i < warm && errors == 0; ++i) once();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters && errors == 0; ++i) once();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double half_ms = secs * 1e3 / iters / 2;
  Row r{ep.transport(), ep.channels(), size, 1, 1, half_ms, static_cast<double>(size) / (half_ms / 1e3) / 1e6};
  r.errors = errors;
  return r;
}

// The thin post path, the way a proxy drives it: each unit is `batch` post_writes and one
// post_signal on a counter in the target's last 8 bytes; one flush at the end. The counter is
// read back afterwards and must equal the number of signals (errors otherwise).
Row measure_post(sluice::Endpoint& ep, const Options& o, uint64_t size, Buffer& local, Buffer& check,
                 sluice::RemoteHandle remote, uint64_t region) {
  const uint64_t counter = region - 8;
  const uint64_t data = region - 4096;  // writes stay clear of the counter
  const uint64_t per_unit = size * o.batch;
  int iters = o.iterations;
  if (iters <= 0) iters = static_cast<int>(std::clamp<uint64_t>((256ull << 20) / per_unit, 64, 20000));
  uint64_t errors = 0;
  uint64_t cursor = 0;
  auto unit = [&] {
    for (const auto& a : make_batch(o, size, data, local.handle, remote, cursor))
      ep.post_write(a.local, a.local_offset, a.remote, a.remote_offset, a.length);
    ep.post_signal(remote, counter, 1);
    cursor += o.batch;
  };
  // Start the counter from zero (a plain write, completed).
  std::memset(check.ptr, 0, 8);
  if (!ep.write({{check.handle, 0, remote, counter, 8}}).wait().ok()) ++errors;
  const int warm = std::min(iters / 10 + 1, 100);
  try {
    for (int i = 0; i < warm; ++i) unit();
    ep.flush();
  } catch (const sluice::Error& e) {
    std::fprintf(stderr, "post failed: %s\n", e.what());
    ++errors;
  }
  auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < iters; ++i) unit();
    ep.flush();
  } catch (const sluice::Error& e) {
    std::fprintf(stderr, "post failed: %s\n", e.what());
    ++errors;
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ep.read({{check.handle, 0, remote, counter, 8}}).wait().ok()) {
    uint64_t v = 0;
    std::memcpy(&v, check.ptr, 8);
    if (v != static_cast<uint64_t>(warm + iters)) {
      std::fprintf(stderr, "post: the counter reads %llu after %d signals\n", (unsigned long long)v, warm + iters);
      ++errors;
    }
  } else {
    ++errors;
  }
  Row r{ep.transport(), ep.channels(), size, o.batch, 1, secs * 1e3 / iters,
        static_cast<double>(per_unit) * iters / secs / 1e6};
  r.errors = errors;
  return r;
}

Row measure(sluice::Endpoint& ep, const Options& o, uint64_t size, Buffer& local, sluice::RemoteHandle remote,
            uint64_t region) {
  if (o.op == "pingpong") return measure_pingpong(ep, o, size, local, remote);
  const uint64_t per_batch = size * o.batch;
  int iters = o.iterations;
  if (iters <= 0) iters = static_cast<int>(std::clamp<uint64_t>((512ull << 20) / per_batch, 16, 4000));
  const int warm = std::min(iters / 10 + 1, 8);
  std::deque<std::vector<sluice::Future>> inflight;
  double lat_sum = 0;
  uint64_t errors = 0;
  auto drain_one = [&] {
    double worst = 0;
    for (auto& f : inflight.front()) {
      sluice::Status st = f.wait();
      if (!st.ok()) {
        if (!errors) std::fprintf(stderr, "operation failed: %s\n", st.to_string().c_str());
        ++errors;
      }
      worst = std::max(worst, std::chrono::duration<double, std::milli>(f.elapsed()).count());
    }
    lat_sum += worst;
    inflight.pop_front();
  };
  uint64_t cursor = 0;
  for (int i = 0; i < warm; ++i) {
    inflight.push_back(submit(ep, o, make_batch(o, size, region, local.handle, remote, cursor), i));
    cursor += o.batch;
    if (static_cast<int>(inflight.size()) >= o.concurrency) drain_one();
  }
  while (!inflight.empty()) drain_one();
  lat_sum = 0;
  errors = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {
    if (static_cast<int>(inflight.size()) >= o.concurrency) drain_one();
    inflight.push_back(submit(ep, o, make_batch(o, size, region, local.handle, remote, cursor), i));
    cursor += o.batch;
  }
  while (!inflight.empty()) drain_one();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Row r{ep.transport(), ep.channels(), size, o.batch, o.concurrency, lat_sum / iters,
        static_cast<double>(per_batch) * iters / secs / 1e6};
  r.errors = errors;
  return r;
}

void baseline(Row& r, const Options& o, uint64_t moved, uint64_t region) {
  // The same footprint as the engine's batches: (batch x size) wrapped in the region.
  uint64_t footprint = std::min<uint64_t>(region, r.size * static_cast<uint64_t>(o.batch));
  if (r.transport == "tcp") {
    r.ceiling_mbps = bench::tcp_stream_mbps(r.size, std::clamp<uint64_t>(moved, 64ull << 20, 2ull << 30), footprint);
  } else if (r.transport == "shm") {
    int it = static_cast<int>(std::clamp<uint64_t>((1ull << 30) / r.size, 8, 100000));
    r.ceiling_mbps = o.memfd ? bench::memcpy_mbps(r.size, footprint, it) : bench::cma_read_mbps(r.size, footprint, it);
  }
  if (r.transport == "tcp" && o.batch == 1 && o.concurrency == 1)
    r.ceiling_lat_us = bench::tcp_pingpong_us(r.size, static_cast<int>(std::clamp<uint64_t>((64ull << 20) / r.size, 200, 20000)));
}

void print_header(const Options& o) {
  if (o.json) return;
  if (o.csv) {
    std::printf("transport,channels,message_size,batch_size,concurrency,avg_latency_ms,bandwidth_mbps%s\n",
                o.baseline ? ",ceiling_mbps,ratio,ceiling_rtt_us,latency_ratio" : "");
    return;
  }
  std::printf("%-9s %9s %13s %10s %11s %16s %17s", "Transport", "#Channels", "Message Size", "Batch Size",
              "Concurrency", "Avg Latency (ms)", "Bandwidth (MB/s)");
  if (o.baseline) std::printf(" %16s %6s", "Ceiling (MB/s)", "Ratio");
  std::printf("\n");
}

void print_row(const Options& o, const Row& r) {
  if (o.json) return;
  double ratio = r.ceiling_mbps > 0 ? r.mbps / r.ceiling_mbps : 0;
  if (o.csv) {
    std::printf("%s,%d,%llu,%d,%d,%.6f,%.1f", r.transport.c_str(), r.channels, (unsigned long long)r.size, r.batch,
                r.concurrency, r.latency_ms, r.mbps);
    if (o.baseline)
      std::printf(",%.1f,%.3f,%.2f,%.3f", r.ceiling_mbps, ratio, r.ceiling_lat_us,
                  r.ceiling_lat_us > 0 ? r.latency_ms * 1000 / r.ceiling_lat_us : 0.0);
    std::printf("\n");
  } else {
    std::printf("%-9s %9d %13s %10d %11d %16.4f %17.1f", r.transport.c_str(), r.channels, bench::size_text(r.size).c_str(),
                r.batch, r.concurrency, r.latency_ms, r.mbps);
    if (o.baseline) std::printf(" %16.1f %6.2f", r.ceiling_mbps, ratio);
    if (r.ceiling_lat_us > 0)
      std::printf("   latency %.1f us vs raw socket RTT %.1f us (%.2fx)", r.latency_ms * 1000, r.ceiling_lat_us,
                  r.latency_ms * 1000 / r.ceiling_lat_us);
    if (r.errors) std::printf("   %llu ERRORS", (unsigned long long)r.errors);
    if (o.check) std::printf("   %s", r.checked ? "check ok" : "CHECK FAILED");
    std::printf("\n");
  }
  std::fflush(stdout);
}

void print_json(const Options& o, const std::vector<Row>& rows) {
  std::printf("[\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf("  {\"transport\": \"%s\", \"op\": \"%s\", \"channels\": %d, \"message_size\": %llu, \"batch_size\": %d, "
                "\"concurrency\": %d, \"avg_latency_ms\": %.6f, \"bandwidth_mbps\": %.1f, \"errors\": %llu",
                r.transport.c_str(), o.op.c_str(), r.channels, (unsigned long long)r.size, r.batch, r.concurrency,
                r.latency_ms, r.mbps, (unsigned long long)r.errors);
    if (o.baseline)
      std::printf(", \"ceiling_mbps\": %.1f, \"ratio\": %.3f, \"ceiling_rtt_us\": %.2f", r.ceiling_mbps,
                  r.ceiling_mbps > 0 ? r.mbps / r.ceiling_mbps : 0.0, r.ceiling_lat_us);
    if (o.check) std::printf(", \"checked\": %s", r.checked ? "true" : "false");
    std::printf("}%s\n", i + 1 < rows.size() ? "," : "");
  }
  std::printf("]\n");
}

int run_initiator(const Options& o, const std::string& address) {
  sluice::Engine engine(engine_config(o, false));
  sluice::ConnectOptions co;
  co.transport = o.transport;
  sluice::Endpoint ep = engine.connect(address, co);
  auto remote = ep.remote_region(kRegionName);
  if (!remote) {
    std::fprintf(stderr, "target has no region named '%s'\n", kRegionName);
    return 1;
  }
  uint64_t region = 0;
  for (auto& r : ep.remote_regions())
    if (r.id == remote->id) region = r.length;
  region = std::min(region, region_length(o));
  // pingpong: the target's echo lands in the second half.
  Buffer local(engine, o.op == "pingpong" ? 2 * region : region, o.memfd, o.op == "pingpong" ? kInitiatorRegion : "");
  Buffer check(engine, region, false, "");
  for (uint64_t i = 0; i < region; ++i) local.ptr[i] = pattern(i, 0);

  std::vector<uint64_t> sizes;
  for (uint64_t s = o.min_size; s <= o.max_size; s *= 2) sizes.push_back(s);
  if (!o.quiet)
    std::fprintf(stderr, "sluice-bench: %s over %s, %d channel(s), batch %d, concurrency %d, %zu sizes\n", o.op.c_str(),
                 ep.transport().c_str(), ep.channels(), o.batch, o.concurrency, sizes.size());
  print_header(o);
  std::vector<Row> rows;
  bool failed = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!o.quiet) std::fprintf(stderr, "[%zu/%zu] %s ...\r", i + 1, sizes.size(), bench::size_text(sizes[i]).c_str());
    Row r = o.op == "post" ? measure_post(ep, o, sizes[i], local, check, *remote, region)
                           : measure(ep, o, sizes[i], local, *remote, region);
    if (o.check) r.checked = verify(ep, o, sizes[i], local, check, *remote, region);
    if (o.baseline) baseline(r, o, static_cast<uint64_t>(r.mbps * 1e6 * 0.3), region);
    failed |= r.errors > 0 || (o.check && !r.checked);
    print_row(o, r);
    rows.push_back(r);
  }
  if (!o.quiet) std::fprintf(stderr, "done.%30s\n", "");
  if (o.json) print_json(o, rows);
  if (o.metrics) std::fputs(engine.metrics_text().c_str(), stderr);
  return failed ? 2 : 0;
}

int run_loopback(const Options& o, char** argv) {
  int to_child[2], from_child[2];
  if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return 1;
  pid_t child = ::fork();
  if (child == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    ::close(to_child[1]);
    ::close(from_child[0]);
    std::vector<char*> args;
    for (char** a = argv; *a; ++a) args.push_back(*a);
    std::string role = "--role", target = "target-loopback";
    (void)target;
    args.push_back(const_cast<char*>("--role"));
    args.push_back(const_cast<char*>("loopback-target"));
    args.push_back(nullptr);
    ::execv("/proc/self/exe", args.data());
    std::perror("exec");
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  FILE* in = ::fdopen(from_child[0], "r");
  char line[512] = {};
  std::string address;
  while (std::fgets(line, sizeof line, in)) {
    if (std::strncmp(line, "SLUICE_TARGET ", 14) == 0) {
      address = std::string(line + 14);
      while (!address.empty() && (address.back() == '\n' || address.back() == '\r')) address.pop_back();
      break;
    }
  }
  if (address.empty()) {
    std::fprintf(stderr, "the target process did not start\n");
    return 1;
  }
  int rc = run_initiator(o, address);
  ::close(to_child[1]);  // the target exits when its stdin closes
  int status = 0;
  ::waitpid(child, &status, 0);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  // The loopback target is this same binary re-run with an internal role.
  bool loopback_target = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (i + 1 < argc && std::strcmp(argv[i], "--role") == 0 && std::strcmp(argv[i + 1], "loopback-target") == 0) {
      loopback_target = true;
      ++i;
      continue;
    }
    args.push_back(argv[i]);
  }
  try {
    Options o = bench::parse(static_cast<int>(args.size()), args.data());
    if (loopback_target) {
      o.role = "loopback";
      return run_target(o);
    }
    if (o.role == "target") {
      std::signal(SIGINT, [](int) { g_stop = true; });
      std::signal(SIGTERM, [](int) { g_stop = true; });
      return run_target(o);
    }
    if (o.role == "initiator") return run_initiator(o, o.connect);
    args.push_back(nullptr);
    return run_loopback(o, args.data());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sluice-bench: %s\n", e.what());
    return 1;
  }
}
