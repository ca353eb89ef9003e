// wire_peer: the rdma transport across a real (emulated) wire. tests/rdma/two-guests.sh runs
// the server in one SoftRoCE guest and the client in another, the guests joined by a QEMU
// socket network, so every byte crosses two rxe devices, two virtio NICs and a "cable".
// Only the public C++ API is used.
//
//   wire_peer server --listen 10.0.0.1:PORT [--timeout S]
//   wire_peer client --connect 10.0.0.1:PORT [--bind IP] [--seconds S] [--measure-seconds S]
//                    [--timeout S] [--seed N]
//
// The server registers a 16 MiB region named "wire" (the client finds it with
// Endpoint::remote_region("wire")) and serves one client: it receives commands by send/recv
// (a fixed header plus a list of pieces {offset, length, seed, group}) and checks, with its
// own CPU, what the client did to its memory; contents are generated from the seed on both
// sides, so neither side trusts the transport to report what it wrote. Commands:
//   CHECK  pieces hold gen(seed)            FILL  write gen(seed) into the pieces
//   IMM    expect one imm per group, base+g, in group order; check the group's bytes on arrival
//   RECV   receive one message per piece at its offset (capacity len + slack), check size + bytes
//   SEND   send one message per piece (gen(seed)) to the client
//   QUIT   no imm beyond the ones announced may arrive (exactly once), then exit
// The client, forced to rdma (EngineConfig::transports and ConnectOptions::transport), runs:
// random-size (1 B - 4 MiB) random-offset write + read-back + server CHECK for --seconds, a
// measurement (64 B write latency, 1 MiB write rate for --measure-seconds; printed, not judged),
// server FILL + client read, single-lane write_with_imm batches (ordered, exactly one imm
// each), striped multi-piece batches over the endpoint's QPs (SLUICE_CHANNELS, default 2)
// with write, read and write_with_imm (also several at once: imms in submission order), and
// send/recv in both directions; then prints a
// PASS/FAIL summary. Exit: 0 all passed, 1 a check failed, 2 usage/setup error, 3 total
// timeout (--timeout, default 150 s: neither role hangs when its peer is gone).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "sluice/sluice.hpp"

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using namespace sluice;

namespace {

constexpr uint64_t kBuf = 16ull << 20;   // server "wire" region; client src and dst halves
constexpr uint64_t kMaxMsg = 4ull << 20;  // largest piece
constexpr uint64_t kCtl = 64ull << 10;    // control region (commands in, replies out)
constexpr uint32_t kMagic = 0x57495245;   // "WIRE"
constexpr int kMaxPieces = 512;
constexpr auto kOpWait = 60s;             // one operation's wait bound

enum Op : uint32_t { kCheck = 1, kFill, kImm, kRecv, kSend, kQuit };
const char* op_name(uint32_t op) {
  static const char* names[] = {"?", "CHECK", "FILL", "IMM", "RECV", "SEND", "QUIT"};
  return op <= kQuit ? names[op] : "?";
}

struct Piece {
  uint64_t off, len, seed, group;
};
struct Cmd {
  uint32_t magic, op, n, slack;
  uint64_t imm_base;
  Piece p[kMaxPieces];
};
constexpr uint64_t kHdr = offsetof(Cmd, p);
struct Reply {
  uint32_t magic, ok;
  char msg[248];
};

// Deterministic bytes from (seed, position): both sides generate the same content.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
void gen(uint8_t* p, uint64_t len, uint64_t seed) {
  uint64_t i = 0, w = 0;
  for (; i + 8 <= len; i += 8, ++w) {
    uint64_t v = mix(seed * 0x100000001b3ull + w);
    std::memcpy(p + i, &v, 8);
  }
  if (i < len) {
    uint64_t v = mix(seed * 0x100000001b3ull + w);
    std::memcpy(p + i, &v, len - i);
  }
}
// Index of the first byte that differs from gen(seed), or -1.
int64_t verify(const uint8_t* p, uint64_t len, uint64_t seed) {
  uint8_t tmp[4096];
  for (uint64_t at = 0; at < len; at += sizeof tmp) {
    uint64_t n = std::min<uint64_t>(sizeof tmp, len - at);
    // gen is defined per 8-byte word: generate from the aligned word.
    uint64_t w0 = at / 8;
    for (uint64_t i = 0; i < n; i += 8) {
      uint64_t v = mix(seed * 0x100000001b3ull + w0 + i / 8);
      std::memcpy(tmp + i, &v, std::min<uint64_t>(8, n - i));
    }
    if (std::memcmp(p + at, tmp, n) != 0) {
      for (uint64_t i = 0; i < n; ++i)
        if (p[at + i] != tmp[i]) return static_cast<int64_t>(at + i);
    }
  }
  return -1;
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char b[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(b, sizeof b, f, ap);
  va_end(ap);
  return b;
}

// A check that failed. fatal: an operation itself failed or timed out, so the command
// protocol with the server may be out of step: end the run.
struct Failure : std::runtime_error {
  explicit Failure(const std::string& what, bool fatal_ = false) : std::runtime_error(what), fatal(fatal_) {}
  bool fatal;
};

Status wait_op(const Future& f, const char* what) {
  if (!f.wait_for(kOpWait)) return {ErrorCode::kTimeout, std::string(what) + ": no completion within 60 s"};
  return f.status();
}
void must(const Future& f, const char* what) {
  Status s = wait_op(f, what);
  if (!s.ok()) throw Failure(std::string(what) + ": " + s.to_string(), true);
}

void start_watchdog(int seconds, const char* role) {
  std::thread([seconds, role] {
    std::this_thread::sleep_for(std::chrono::seconds(seconds));
    std::fprintf(stderr, "wire_peer %s: FAIL: total timeout (%d s) - peer gone or stuck\n", role, seconds);
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(3);
  }).detach();
}

// rdma; SLUICE_TEST_TRANSPORT=tcp validates the checks themselves on a host without a device.
std::string transport_name() {
  const char* t = std::getenv("SLUICE_TEST_TRANSPORT");
  return t && *t ? t : "rdma";
}

EngineConfig make_config(const std::string& host, uint16_t port) {
  EngineConfig c;
  c.transports = {transport_name()};
  c.listen_host = host;
  c.listen_port = port;
  c.connect_timeout = 10s;
  c.op_timeout = 30s;
  return c;
}

bool split_hostport(const std::string& s, std::string* host, uint16_t* port) {
  auto c = s.rfind(':');
  if (c == std::string::npos) return false;
  *host = s.substr(0, c);
  *port = static_cast<uint16_t>(std::atoi(s.c_str() + c + 1));
  return !host->empty();
}

// ------------------------------------------------------------------------------- server
// On a failure, while this side's queue pairs still exist: their state and PSNs as the kernel
// sees them (which side's requester or responder stopped), the neighbour table (rxe resolves
// the peer's MAC through it for every packet) and the last kernel messages (a NIC watchdog).
// Diagnostics only; the exit status says pass or fail.
void dump_queue_pairs(const char* role) {
  std::fflush(stdout);
  std::string cmd = std::string("{ rdma resource show qp 2>&1 | grep -v GSI; ip neigh show 2>&1; "
                                "dmesg 2>/dev/null | tail -8; } | sed 's/^/wire_peer ") + role + ": at failure: /'";
  if (std::system(cmd.c_str()) != 0) std::printf("wire_peer %s: (no queue pair listing)\n", role);
  std::fflush(stdout);
}

int run_server(const std::string& listen, int timeout_s) {
  start_watchdog(timeout_s, "server");
  std::string host;
  uint16_t port = 0;
  if (!split_hostport(listen, &host, &port)) {
    std::fprintf(stderr, "wire_peer server: bad --listen %s\n", listen.c_str());
    return 2;
  }
  Engine engine(make_config(host, port));
  std::vector<uint8_t> wire(kBuf, 0), ctl(kCtl, 0);
  auto hw = engine.register_memory(wire.data(), wire.size(), Location::host(), "wire");
  auto hc = engine.register_memory(ctl.data(), ctl.size(), Location::host(), "sctl");
  std::printf("wire_peer server: listening on %s (transports:", engine.listen_address().c_str());
  for (auto& t : engine.transports()) std::printf(" %s", t.c_str());
  std::printf(")\n");
  std::fflush(stdout);
  std::optional<Endpoint> got;
  while (!(got = engine.accept(1s))) {
  }
  Endpoint ep = *got;
  std::printf("wire_peer server: client %s connected over %s, %d channel(s)\n", ep.peer_engine_id().c_str(),
              ep.transport().c_str(), ep.channels());
  std::fflush(stdout);
  int server_failures = 0;
  uint64_t imms_expected = 0;
  auto* cmd = reinterpret_cast<Cmd*>(ctl.data());
  auto* rep = reinterpret_cast<Reply*>(ctl.data() + kCtl / 2);
  static_assert(sizeof(Cmd) <= kCtl / 2);
  try {
    for (;;) {
      auto r = ep.recv(hc, 0, sizeof(Cmd));
      must(r, "recv command");
      if (r.bytes() < kHdr || cmd->magic != kMagic || cmd->n > kMaxPieces || r.bytes() != kHdr + cmd->n * sizeof(Piece))
        throw Failure(fmt("malformed command (%" PRIu64 " bytes)", r.bytes()));
      for (uint32_t i = 0; i < cmd->n; ++i)
        if (cmd->p[i].off > kBuf || cmd->p[i].len > kBuf - cmd->p[i].off)
          throw Failure("command piece out of range");
      std::string err;
      switch (cmd->op) {
        case kCheck:
          for (uint32_t i = 0; i < cmd->n && err.empty(); ++i) {
            auto& p = cmd->p[i];
            int64_t bad = verify(wire.data() + p.off, p.len, p.seed);
            if (bad >= 0)
              err = fmt("piece %u (off %" PRIu64 " len %" PRIu64 "): server memory differs at byte %" PRId64, i, p.off,
                        p.len, bad);
          }
          break;
        case kFill:
          for (uint32_t i = 0; i < cmd->n; ++i) gen(wire.data() + cmd->p[i].off, cmd->p[i].len, cmd->p[i].seed);
          break;
        case kImm: {
          uint64_t groups = 0;
          for (uint32_t i = 0; i < cmd->n; ++i) groups = std::max(groups, cmd->p[i].group + 1);
          // rdma promises submission order for single-lane batches (their imm rides on QP 0);
          // other transports (SLUICE_TEST_TRANSPORT) only exactly-once. Every announced imm is
          // consumed even after a failure, so the command stream stays in step.
          const bool ordered = ep.transport() == "rdma";
          std::vector<bool> seen(groups, false);
          for (uint64_t g = 0; g < groups; ++g) {
            auto f = ep.imm_recv();
            Status s = wait_op(f, "imm_recv");
            if (!s.ok()) {
              if (err.empty()) err = fmt("imm %" PRIu64 ": %s", g, s.to_string().c_str());
              break;
            }
            uint64_t k = f.imm() - cmd->imm_base;  // the group this imm announces
            if (f.imm() < cmd->imm_base || k >= groups || seen[k] || (ordered && k != g)) {
              if (err.empty())
                err = fmt("imm #%" PRIu64 " of the command: got %u, expected %" PRIu64 " (%s)", g, f.imm(), cmd->imm_base + g,
                          k < groups && seen[k] ? "duplicate" : ordered ? "out of order or unknown" : "unknown");
              if (k >= groups || seen[k]) continue;
            }
            seen[k] = true;
            for (uint32_t i = 0; i < cmd->n && err.empty(); ++i) {
              auto& p = cmd->p[i];
              if (p.group != k) continue;
              int64_t bad = verify(wire.data() + p.off, p.len, p.seed);
              if (bad >= 0)
                err = fmt("imm %u arrived before its bytes: piece %u (off %" PRIu64 " len %" PRIu64 ") differs at %" PRId64,
                          f.imm(), i, p.off, p.len, bad);
            }
          }
          imms_expected += groups;
          break;
        }
        case kRecv: {
          std::vector<Future> rs;
          for (uint32_t i = 0; i < cmd->n; ++i) rs.push_back(ep.recv(hw, cmd->p[i].off, std::min<uint64_t>(cmd->p[i].len + cmd->slack, kBuf - cmd->p[i].off)));
          for (uint32_t i = 0; i < cmd->n && err.empty(); ++i) {
            auto& p = cmd->p[i];
            Status s = wait_op(rs[i], "recv");
            if (!s.ok()) err = fmt("recv %u: %s", i, s.to_string().c_str());
            else if (rs[i].bytes() != p.len)
              err = fmt("recv %u: %" PRIu64 " bytes, expected %" PRIu64, i, rs[i].bytes(), p.len);
            else if (int64_t bad = verify(wire.data() + p.off, p.len, p.seed); bad >= 0)
              err = fmt("recv %u (len %" PRIu64 "): differs at byte %" PRId64, i, p.len, bad);
          }
          break;
        }
        case kSend: {
          std::vector<Future> ss;
          for (uint32_t i = 0; i < cmd->n; ++i) {
            gen(wire.data() + cmd->p[i].off, cmd->p[i].len, cmd->p[i].seed);
            ss.push_back(ep.send(hw, cmd->p[i].off, cmd->p[i].len));
          }
          for (uint32_t i = 0; i < cmd->n && err.empty(); ++i) {
            Status s = wait_op(ss[i], "send");
            if (!s.ok()) err = fmt("send %u: %s", i, s.to_string().c_str());
          }
          break;
        }
        case kQuit: {
          auto extra = ep.imm_recv();
          if (extra.wait_for(500ms))
            err = fmt("an imm beyond the %" PRIu64 " announced arrived (%u): not exactly once", imms_expected, extra.imm());
          break;
        }
        default:
          err = fmt("unknown command %u", cmd->op);
      }
      if (!err.empty()) {
        ++server_failures;
        std::printf("wire_peer server: %s FAILED: %s\n", op_name(cmd->op), err.c_str());
        dump_queue_pairs("server");
      }
      rep->magic = kMagic;
      rep->ok = err.empty();
      std::snprintf(rep->msg, sizeof rep->msg, "%s", err.c_str());
      uint32_t op = cmd->op;
      must(ep.send(hc, kCtl / 2, sizeof(Reply)), "send reply");
      if (op == kQuit) break;
    }
  } catch (const std::exception& e) {
    std::printf("wire_peer server: FAIL: %s\n", e.what());
    dump_queue_pairs("server");
    engine.close();
    return 1;
  }
  // Our QUIT reply's send completed (the client holds it): close first. (The other order
  // races: a receiver that closes as soon as its recv completed may shut the endpoint before
  // the rendezvous FIN reaches the sender, whose send then fails with kPeerLost.)
  engine.close();
  std::printf("wire_peer server: %s (%d server-side check(s) failed)\n", server_failures ? "FAIL" : "PASS",
              server_failures);
  return server_failures ? 1 : 0;
}

// ------------------------------------------------------------------------------- client
struct Client {
  Engine& engine;
  Endpoint ep;
  std::vector<uint8_t> mem;  // [0, kBuf) source, [kBuf, 2 kBuf) destination
  std::vector<uint8_t> ctl;
  MemoryHandle hm, hc;
  RemoteHandle wire;
  std::mt19937_64 rng;
  std::map<std::string, std::pair<int, int>> tally;  // phase -> (passed, failed)
  std::vector<std::string> failures;

  uint8_t* src(uint64_t off) { return mem.data() + off; }
  uint8_t* dst(uint64_t off) { return mem.data() + kBuf + off; }
  uint64_t rnd(uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); }
  uint64_t rnd_len(int cls) {  // 1..64, 1..64 KiB, 1..4 MiB
    return rnd(1, cls == 0 ? 64 : cls == 1 ? 65536 : kMaxMsg);
  }

  // Send a command; `before_reply` runs after the command is sent and before the reply is
  // awaited (the data operations the command announces).
  void command(uint32_t op, const std::vector<Piece>& ps, uint64_t imm_base = 0, uint32_t slack = 0,
               const std::function<void()>& before_reply = {}) {
    if (ps.size() > kMaxPieces) throw Failure("too many pieces");
    auto* c = reinterpret_cast<Cmd*>(ctl.data());
    c->magic = kMagic;
    c->op = op;
    c->n = static_cast<uint32_t>(ps.size());
    c->slack = slack;
    c->imm_base = imm_base;
    std::copy(ps.begin(), ps.end(), c->p);
    must(ep.send(hc, 0, kHdr + ps.size() * sizeof(Piece)), (std::string("send ") + op_name(op)).c_str());
    if (before_reply) before_reply();
    auto r = ep.recv(hc, kCtl / 2, sizeof(Reply));
    must(r, (std::string("reply to ") + op_name(op)).c_str());
    auto* rep = reinterpret_cast<Reply*>(ctl.data() + kCtl / 2);
    if (r.bytes() != sizeof(Reply) || rep->magic != kMagic) throw Failure("malformed reply");
    if (!rep->ok) throw Failure(std::string("server: ") + op_name(op) + ": " + rep->msg);
  }

  // Run one check of a phase; a Failure counts it and goes on, anything else ends the run.
  template <class F>
  void check(const std::string& phase, F&& body) {
    try {
      body();
      tally[phase].first++;
    } catch (const Failure& e) {
      tally[phase].second++;
      if (failures.size() < 20) failures.push_back(phase + ": " + e.what());
      std::printf("wire_peer client: [%s] FAIL: %s\n", phase.c_str(), e.what());
      dump_queue_pairs("client");
      if (e.fatal || !ep.connected()) throw;
    }
  }

  void expect_bytes(const uint8_t* p, uint64_t len, uint64_t seed, const std::string& what) {
    int64_t bad = verify(p, len, seed);
    if (bad >= 0) throw Failure(fmt("%s (len %" PRIu64 "): differs at byte %" PRId64, what.c_str(), len, bad));
  }

  // Disjoint random pieces inside [0, kBuf): n pieces of 1..max_len bytes, shuffled order.
  std::vector<Piece> layout(int n, uint64_t max_len, uint64_t group = 0, uint64_t min_len = 1) {
    std::vector<Piece> ps;
    uint64_t at = rnd(0, 4096);
    for (int i = 0; i < n; ++i) {
      uint64_t len = rnd(min_len, max_len);
      if (at + len > kBuf) break;
      ps.push_back({at, len, rng(), group});
      at += len + rnd(0, 300);
    }
    std::shuffle(ps.begin(), ps.end(), rng);
    return ps;
  }

  void random_write_read(double seconds) {
    auto until = Clock::now() + std::chrono::duration<double>(seconds);
    uint64_t bytes = 0;
    int i = 0;
    for (; Clock::now() < until || i < 6; ++i) {
      check("write+read random", [&] {
        uint64_t len = rnd_len(i % 3), lo = rnd(0, kBuf - len), ro = rnd(0, kBuf - len), seed = rng();
        gen(src(lo), len, seed);
        must(ep.write({{hm, lo, wire, ro, len}}), "write");
        command(kCheck, {{ro, len, seed, 0}});  // the server's own view of its memory
        uint64_t back = rnd(0, kBuf - len);
        std::memset(dst(back), 0, len);
        must(ep.read({{hm, kBuf + back, wire, ro, len}}), "read");
        expect_bytes(dst(back), len, seed, fmt("read-back of %" PRIu64 " at remote %" PRIu64, len, ro));
        bytes += 2 * len;
      });
      if (i % 4 == 3)
        check("server fill + read", [&] {
          uint64_t len = rnd_len(i % 3), ro = rnd(0, kBuf - len), seed = rng(), back = rnd(0, kBuf - len);
          command(kFill, {{ro, len, seed, 0}});
          must(ep.read({{hm, kBuf + back, wire, ro, len}}), "read");
          expect_bytes(dst(back), len, seed, "read of server-filled bytes");
        });
    }
    std::printf("wire_peer client: random write/read: %d rounds, %.1f MiB moved\n", i, bytes / 1048576.0);
  }

  // What the round's wire costs (reported, never asserted: the guests are emulated and share
  // a noisy host): the latency of a 64 B write (median and p90 of 200 waited one at a time)
  // and the rate of 1 MiB writes, 4 in flight, for about `seconds`; the bytes of the last
  // 4 MiB written are checked by the server.
  void measure(double seconds) {
    check("measure: 64 B latency, 1 MiB rate", [&] {
      std::vector<double> us;
      gen(src(0), 64, rng());
      for (int i = 0; i < 200; ++i) {
        auto t = Clock::now();
        must(ep.write({{hm, 0, wire, 0, 64}}), "write 64 B");
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t).count());
      }
      std::sort(us.begin(), us.end());
      constexpr uint64_t kPiece = 1 << 20, kSpan = 4 * kPiece;
      const uint64_t seed = rng();
      gen(src(0), kSpan, seed);
      std::vector<Future> inflight;
      uint64_t n = 0;
      const auto t0 = Clock::now();
      const auto until = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
      while (Clock::now() < until || n % 4 != 0) {
        if (inflight.size() == 4) {
          must(inflight.front(), "write 1 MiB");
          inflight.erase(inflight.begin());
        }
        const uint64_t off = (n++ % 4) * kPiece;
        inflight.push_back(ep.write({{hm, off, wire, off, kPiece}}));
      }
      for (auto& f : inflight) must(f, "write 1 MiB");
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      command(kCheck, {{0, kSpan, seed, 0}});
      std::printf("wire_peer client: measure: 64 B write latency median %.0f us, p90 %.0f us; "
                  "1 MiB writes (4 in flight): %.1f MiB/s (%" PRIu64 " MiB in %.2f s)\n",
                  us[us.size() / 2], us[us.size() * 9 / 10], n / secs, n, secs);
      std::fflush(stdout);
    });
  }

  void imm_single_lane() {
    // 64 single-lane batches (small: below the stripe threshold) submitted back to back:
    // imms must arrive in submission order, exactly once, each after its batch's bytes.
    check("write_with_imm single-lane order", [&] {
      std::vector<Piece> ps;
      uint64_t at = 0;
      const int batches = 64;
      for (int g = 0; g < batches; ++g) {
        int k = static_cast<int>(rnd(1, 3));
        for (int j = 0; j < k; ++j) {
          uint64_t len = rnd(1, 12000);
          ps.push_back({at, len, rng(), uint64_t(g)});
          at += len + rnd(0, 64);
        }
      }
      for (auto& p : ps) gen(src(p.off), p.len, p.seed);
      uint32_t base = static_cast<uint32_t>(rnd(1, 1u << 30));
      std::vector<Future> fs;
      command(kImm, ps, base, 0, [&] {
        for (int g = 0; g < batches; ++g) {
          Batch b;
          for (auto& p : ps)
            if (p.group == uint64_t(g)) b.push_back({hm, p.off, wire, p.off, p.len});
          fs.push_back(ep.write_with_imm(b, base + g));
        }
        for (auto& f : fs) must(f, "write_with_imm");
      });
    });
  }

  void striped() {
    // Multi-piece batches larger than the stripe threshold: spread over the QPs.
    for (int round = 0; round < 6; ++round) {
      check(fmt("striped batch %d QPs", ep.channels()), [&] {
        auto ps = layout(static_cast<int>(rnd(2, 40)), 256 << 10);
        // local layout differs from the remote one: local offsets packed in a new order
        std::vector<uint64_t> loc(ps.size());
        uint64_t at = rnd(0, 100);
        for (size_t i = 0; i < ps.size(); ++i) {
          loc[i] = at;
          at += ps[i].len + rnd(0, 50);
        }
        if (at > kBuf) throw Failure("layout overflow");
        Batch w, r;
        for (size_t i = 0; i < ps.size(); ++i) {
          gen(src(loc[i]), ps[i].len, ps[i].seed);
          w.push_back({hm, loc[i], wire, ps[i].off, ps[i].len});
          r.push_back({hm, kBuf + loc[i], wire, ps[i].off, ps[i].len});
          std::memset(dst(loc[i]), 0, ps[i].len);
        }
        if (round % 2 == 0) {
          must(ep.write(w), "striped write");
          command(kCheck, ps);
        } else {  // one imm for the whole striped batch, after all its bytes
          uint32_t base = 500000 + round;
          command(kImm, ps, base, 0, [&] { must(ep.write_with_imm(w, base), "striped write_with_imm"); });
        }
        must(ep.read(r), "striped read");
        for (size_t i = 0; i < ps.size(); ++i) expect_bytes(dst(loc[i]), ps[i].len, ps[i].seed, fmt("striped read piece %zu", i));
      });
    }
  }

  void imm_striped_concurrent() {
    // Several striped batches (8 pieces of 64-128 KiB each: above the stripe threshold, so
    // spread over the QPs) submitted back to back: one imm each, after all of the batch's
    // bytes, and in submission order.
    check("write_with_imm striped, concurrent", [&] {
      const uint64_t batches = 4;
      auto ps = layout(static_cast<int>(8 * batches), 128 << 10, 0, 64 << 10);
      for (size_t i = 0; i < ps.size(); ++i) ps[i].group = i % batches;
      for (auto& p : ps) gen(src(p.off), p.len, p.seed);
      uint32_t base = static_cast<uint32_t>(rnd(1, 1u << 30));
      command(kImm, ps, base, 0, [&] {
        std::vector<Future> fs;
        for (uint64_t g = 0; g < batches; ++g) {
          Batch b;
          for (auto& p : ps)
            if (p.group == g) b.push_back({hm, p.off, wire, p.off, p.len});
          fs.push_back(ep.write_with_imm(b, base + static_cast<uint32_t>(g)));
        }
        for (auto& f : fs) must(f, "striped write_with_imm");
      });
    });
  }

  void send_recv() {
    for (int round = 0; round < 3; ++round) {
      check("send client->server", [&] {
        auto ps = layout(round == 0 ? 3 : 8, round == 0 ? kMaxMsg : 100000);
        for (auto& p : ps) gen(src(p.off), p.len, p.seed);
        command(kRecv, ps, 0, static_cast<uint32_t>(rnd(0, 100)), [&] {
          std::vector<Future> ss;
          for (auto& p : ps) ss.push_back(ep.send(hm, p.off, p.len));
          for (auto& f : ss) must(f, "send");
        });
      });
      check("send server->client", [&] {
        auto ps = layout(round == 0 ? 3 : 8, round == 0 ? kMaxMsg : 100000);
        uint32_t slack = static_cast<uint32_t>(rnd(0, 100));
        std::vector<Future> rs;
        for (auto& p : ps) rs.push_back(ep.recv(hm, kBuf + p.off, p.len + std::min<uint64_t>(slack, kBuf - p.off - p.len)));
        command(kSend, ps);
        for (size_t i = 0; i < ps.size(); ++i) {
          must(rs[i], "recv");
          if (rs[i].bytes() != ps[i].len) throw Failure(fmt("recv %zu: %" PRIu64 " bytes, expected %" PRIu64, i, rs[i].bytes(), ps[i].len));
          expect_bytes(dst(ps[i].off), ps[i].len, ps[i].seed, fmt("received message %zu", i));
        }
      });
    }
  }
};

int run_client(const std::string& connect, const std::string& bind, double seconds, double measure_s, int timeout_s,
               uint64_t seed) {
  start_watchdog(timeout_s, "client");
  auto t0 = Clock::now();
  Engine engine(make_config(bind, 0));
  Client c{engine, {}, std::vector<uint8_t>(2 * kBuf, 0), std::vector<uint8_t>(kCtl, 0), {}, {}, {}, std::mt19937_64(seed), {}, {}};
  c.hm = engine.register_memory(c.mem.data(), c.mem.size(), Location::host(), "cmem");
  c.hc = engine.register_memory(c.ctl.data(), c.ctl.size(), Location::host(), "cctl");
  ConnectOptions opt;
  opt.transport = transport_name();
  // The server's guest may still be booting: retry until the total deadline.
  std::string last;
  for (int attempt = 1;; ++attempt) {
    try {
      c.ep = engine.connect(connect, opt);
      break;
    } catch (const Error& e) {
      if (last != e.what()) std::printf("wire_peer client: connect %s: %s (retrying)\n", connect.c_str(), e.what());
      last = e.what();
      std::fflush(stdout);
      if (e.code() == ErrorCode::kNoDevice || e.code() == ErrorCode::kUnsupported) return 2;
      std::this_thread::sleep_for(500ms);
    }
  }
  auto wire = c.ep.remote_region("wire");
  if (!wire) {
    std::printf("wire_peer client: FAIL: the server advertises no region \"wire\"\n");
    return 1;
  }
  c.wire = *wire;
  std::printf("wire_peer client: connected to %s over %s, %d QP(s), seed %" PRIu64 "\n", connect.c_str(),
              c.ep.transport().c_str(), c.ep.channels(), seed);
  std::fflush(stdout);
  int rc = 0;
  if (c.ep.transport() != transport_name()) {
    std::printf("wire_peer client: FAIL: transport is %s, not %s\n", c.ep.transport().c_str(), transport_name().c_str());
    rc = 1;
  } else {
    try {
      c.random_write_read(seconds);
      c.measure(measure_s);
      c.imm_single_lane();
      c.striped();
      c.imm_striped_concurrent();
      c.send_recv();
      c.check("quit (exactly-once imms)", [&] { c.command(kQuit, {}); });
    } catch (const std::exception& e) {
      c.failures.push_back(std::string("aborted: ") + e.what());
      std::printf("wire_peer client: aborted: %s\n", e.what());
      rc = 1;
    }
  }
  // The server closes first once its QUIT reply is delivered: wait (bounded) for that.
  for (int i = 0; i < 50 && c.ep.connected(); ++i) std::this_thread::sleep_for(100ms);
  c.ep.close();
  engine.close();
  int passed = 0, failed = 0;
  std::printf("wire_peer client: summary\n");
  for (auto& [phase, pf] : c.tally) {
    std::printf("  %-36s %4d passed %4d failed\n", phase.c_str(), pf.first, pf.second);
    passed += pf.first;
    failed += pf.second;
  }
  for (auto& f : c.failures) std::printf("  failure: %s\n", f.c_str());
  if (failed) rc = 1;
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("wire_peer client: %s: %d checks passed, %d failed (%.1f s)\n", rc ? "FAIL" : "PASS", passed, failed, secs);
  return rc;
}

[[noreturn]] void usage() {
  std::fprintf(stderr,
               "usage: wire_peer server --listen IP:PORT [--timeout S]\n"
               "       wire_peer client --connect IP:PORT [--bind IP] [--seconds S] [--measure-seconds S] [--timeout S] [--seed N]\n");
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) usage();
  std::string role = argv[1], listen, connect, bind = "0.0.0.0";
  double seconds = 4;
  double measure_s = 1;
  int timeout_s = 150;
  uint64_t seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage();
      return argv[++i];
    };
    if (a == "--listen") listen = val();
    else if (a == "--connect") connect = val();
    else if (a == "--bind") bind = val();
    else if (a == "--seconds") seconds = std::atof(val().c_str());
    else if (a == "--measure-seconds") measure_s = std::atof(val().c_str());
    else if (a == "--timeout") timeout_s = std::atoi(val().c_str());
    else if (a == "--seed") seed = std::strtoull(val().c_str(), nullptr, 0);
    else usage();
  }
  if (timeout_s <= 0) usage();
  try {
    if (role == "server" && !listen.empty()) return run_server(listen, timeout_s);
    if (role == "client" && !connect.empty()) return run_client(connect, bind, seconds, measure_s, timeout_s, seed);
  } catch (const std::exception& e) {
    std::printf("wire_peer %s: FAIL: %s\n", role.c_str(), e.what());
    return 2;
  }
  usage();
}
