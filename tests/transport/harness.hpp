// Test harness for multi-process tests: a forked child process runs its own Engine (created
// only after fork), registers memory, passes its info blob to the parent over a pipe and then
// serves simple commands (checksums, fills, recvs, imm_recv) over a second pipe.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/common/frame.hpp"
#include "sluice/sluice.hpp"

namespace sluice_test {

using namespace std::chrono_literals;

inline uint64_t fnv(const uint8_t* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// Deterministic pattern: byte i of a region filled with `seed`.
inline void fill_pattern(uint8_t* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(x >> (8 * (i % 8)));
}

inline void fill_random(uint8_t* p, uint64_t n, std::mt19937_64& rng) {
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

inline bool write_all(int fd, const void* buf, size_t n) {
  auto* p = static_cast<const char*>(buf);
  while (n) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes or fails (EOF, error, or `timeout` without data).
inline bool read_all(int fd, void* buf, size_t n, std::chrono::milliseconds timeout = 60s) {
  auto* p = static_cast<char*>(buf);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pf{fd, POLLIN, 0};
    int rc = ::poll(&pf, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return false;
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A raw same-host peer that authenticated on a shm endpoint's socket gets the endpoint's
// credit grant for eager SENDs first (shm.eager_max, shm.eager_credit), before any answer to
// its own frames. Returns it (type kCredit: op_id = bytes, region = the largest message).
inline sluice::detail::FrameHeader read_credit_grant(int fd) {
  sluice::detail::FrameHeader h{};
  if (!read_all(fd, &h, sizeof(h), std::chrono::seconds(5))) h.type = 0;
  return h;
}

// Commands the parent sends to a child.
enum class Cmd : uint32_t {
  kQuit = 0,
  kChecksum = 1,   // region, offset, length -> fnv of child memory
  kFill = 2,       // region, seed -> 0   (fill the whole region with fill_pattern(seed))
  kRecv = 3,       // region, offset, length -> posts a recv on endpoint 0, waits; returns code, bytes, fnv
  kImmRecv = 4,    // -> waits for the next imm on endpoint 0: code, imm, then fnv of (region, off, len)
  kSend = 5,       // region, offset, length -> send on endpoint 0 and wait; returns code
  kPostRecvs = 6,  // a = count: post `count` recvs of (b) bytes each at offsets c + i*b (async); returns 0
  kWaitRecvs = 7,  // wait for the posted recvs; returns for each: code, bytes
  kEndpoints = 8,  // -> number of endpoints accepted so far
};

struct CmdMsg {
  Cmd cmd;
  uint32_t region;
  uint64_t a, b, c;
};

struct ChildConfig {
  std::string transport = "tcp";
  int channels = 2;
  std::chrono::milliseconds op_timeout{30000};
  uint64_t heap_bytes = 8ull << 20;   // register_memory'd heap buffer, name "heap"  (region 0)
  uint64_t alloc_bytes = 8ull << 20;  // Engine::allocate'd buffer, name "alloc"      (region 1)
  uint64_t seed = 1;                  // both regions start filled with fill_pattern(seed + region)
};

inline sluice::EngineConfig engine_config(const std::string& transport, int channels = 2,
                                          std::chrono::milliseconds op_timeout = 30s) {
  sluice::EngineConfig c;
  c.transports = {transport};
  c.channels = channels;
  c.op_timeout = op_timeout;
  c.connect_timeout = 5s;
  return c;
}

// The body of the child process. Never returns.
[[noreturn]] inline void child_main(const ChildConfig& cfg, int to_parent, int from_parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  int rc = 0;
  try {
    sluice::Engine engine(engine_config(cfg.transport, cfg.channels, cfg.op_timeout));
    std::vector<uint8_t> heap(cfg.heap_bytes);
    fill_pattern(heap.data(), heap.size(), cfg.seed + 0);
    auto heap_h = engine.register_memory(heap.data(), heap.size(), sluice::Location::host(), "heap");
    auto alloc = engine.allocate(cfg.alloc_bytes, sluice::Location::host(), "alloc");
    fill_pattern(static_cast<uint8_t*>(alloc.ptr), alloc.length, cfg.seed + 1);
    struct Region {
      sluice::MemoryHandle h;
      uint8_t* p;
      uint64_t n;
    } regions[2] = {{heap_h, heap.data(), heap.size()}, {alloc.handle, static_cast<uint8_t*>(alloc.ptr), alloc.length}};

    std::mutex mu;
    std::vector<sluice::Endpoint> eps;
    std::atomic<bool> stop{false};
    std::thread acceptor([&] {
      while (!stop.load()) {
        auto ep = engine.accept(100ms);
        if (ep) {
          std::lock_guard<std::mutex> lk(mu);
          eps.push_back(*ep);
        }
      }
    });
    auto ep0 = [&]() -> sluice::Endpoint {
      for (int i = 0; i < 1000; ++i) {
        {
          std::lock_guard<std::mutex> lk(mu);
          if (!eps.empty()) return eps[0];
        }
        std::this_thread::sleep_for(10ms);
      }
      throw sluice::Error(sluice::ErrorCode::kTimeout, "child: no endpoint accepted");
    };

    std::string blob = engine.local_info();
    uint64_t len = blob.size();
    write_all(to_parent, &len, sizeof(len));
    write_all(to_parent, blob.data(), blob.size());

    std::vector<sluice::Future> posted;
    for (;;) {
      CmdMsg m{};
      if (!read_all(from_parent, &m, sizeof(m), std::chrono::hours(1))) break;
      if (m.cmd == Cmd::kQuit) break;
      Region& r = regions[m.region % 2];
      std::vector<uint64_t> out;
      switch (m.cmd) {
        case Cmd::kChecksum:
          out.push_back(m.a + m.b <= r.n ? fnv(r.p + m.a, m.b) : 0);
          break;
        case Cmd::kFill:
          fill_pattern(r.p, r.n, m.a);
          out.push_back(0);
          break;
        case Cmd::kRecv: {
          auto f = ep0().recv(r.h, m.a, m.b);
          auto st = f.wait();
          out = {static_cast<uint64_t>(st.code), f.bytes(), fnv(r.p + m.a, m.b)};
          break;
        }
        case Cmd::kImmRecv: {
          auto f = ep0().imm_recv();
          auto st = f.wait();
          // Checksum right away: the bytes must already be there when the imm arrives.
          uint64_t h = m.a + m.b <= r.n ? fnv(r.p + m.a, m.b) : 0;
          out = {static_cast<uint64_t>(st.code), f.imm(), h};
          break;
        }
        case Cmd::kSend: {
          auto st = ep0().send(r.h, m.a, m.b).wait();
          out.push_back(static_cast<uint64_t>(st.code));
          break;
        }
        case Cmd::kPostRecvs: {
          auto ep = ep0();
          for (uint64_t i = 0; i < m.a; ++i) posted.push_back(ep.recv(r.h, m.c + i * m.b, m.b));
          out.push_back(0);
          break;
        }
        case Cmd::kWaitRecvs:
          for (auto& f : posted) {
            auto st = f.wait();
            out.push_back(static_cast<uint64_t>(st.code));
            out.push_back(f.bytes());
          }
          posted.clear();
          break;
        case Cmd::kEndpoints: {
          std::lock_guard<std::mutex> lk(mu);
          out.push_back(eps.size());
          break;
        }
        default:
          out.push_back(~0ull);
      }
      uint64_t n = out.size();
      write_all(to_parent, &n, sizeof(n));
      write_all(to_parent, out.data(), n * sizeof(uint64_t));
    }
    stop = true;
    acceptor.join();
    {
      std::lock_guard<std::mutex> lk(mu);
      eps.clear();
    }
    engine.close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
    rc = 3;
  }
  std::fflush(stderr);
  ::_exit(rc);
}

// A forked child and the parent's end of its pipes.
class Child {
 public:
  explicit Child(const ChildConfig& cfg) : cfg_(cfg) {
    int up[2], down[2];
    if (::pipe(up) != 0 || ::pipe(down) != 0) std::abort();
    std::fflush(stdout);
    std::fflush(stderr);
    pid_ = ::fork();
    if (pid_ < 0) std::abort();
    if (pid_ == 0) {
      ::close(up[0]);
      ::close(down[1]);
      child_main(cfg, up[1], down[0]);
    }
    ::close(up[1]);
    ::close(down[0]);
    from_ = up[0];
    to_ = down[1];
  }
  ~Child() {
    quit();
    if (from_ >= 0) ::close(from_);
    if (to_ >= 0) ::close(to_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // The child's info blob (read once; empty if the child failed to start).
  const std::string& blob() {
    if (!blob_read_) {
      blob_read_ = true;
      uint64_t n = 0;
      if (read_all(from_, &n, sizeof(n), 30s) && n < (1u << 24)) {
        blob_.resize(n);
        if (!read_all(from_, blob_.data(), n, 30s)) blob_.clear();
      }
    }
    return blob_;
  }

  std::vector<uint64_t> call(Cmd cmd, uint32_t region = 0, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0,
                             std::chrono::milliseconds timeout = 60s) {
    CmdMsg m{cmd, region, a, b, c};
    if (!write_all(to_, &m, sizeof(m))) return {};
    uint64_t n = 0;
    if (!read_all(from_, &n, sizeof(n), timeout) || n > (1u << 24)) return {};
    std::vector<uint64_t> out(n);
    if (n && !read_all(from_, out.data(), n * sizeof(uint64_t), timeout)) return {};
    return out;
  }

  uint64_t checksum(uint32_t region, uint64_t offset, uint64_t length) {
    auto r = call(Cmd::kChecksum, region, offset, length);
    return r.size() == 1 ? r[0] : 0xdeadull;
  }

  // Ask the child to exit and reap it (SIGKILL after a grace period). Returns its exit status.
  int quit(std::chrono::milliseconds grace = 10s) {
    if (pid_ <= 0) return status_;
    CmdMsg m{Cmd::kQuit, 0, 0, 0, 0};
    write_all(to_, &m, sizeof(m));
    auto deadline = std::chrono::steady_clock::now() + grace;
    for (;;) {
      int st = 0;
      pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        status_ = st;
        pid_ = -1;
        return status_;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        status_ = st;
        pid_ = -1;
        return status_;
      }
      std::this_thread::sleep_for(5ms);
    }
  }

  void kill(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  // SIGSTOP, then wait until every thread of the child is really stopped (delivery is
  // asynchronous: a thread running on another core may still make progress for a moment).
  bool stop(std::chrono::milliseconds timeout = 5s) {
    if (pid_ <= 0) return false;
    ::kill(pid_, SIGSTOP);
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      bool all = true, any = false;
      std::string dir = "/proc/" + std::to_string(pid_) + "/task";
      if (DIR* d = ::opendir(dir.c_str())) {
        while (dirent* e = ::readdir(d)) {
          if (e->d_name[0] == '.') continue;
          std::FILE* f = std::fopen((dir + "/" + e->d_name + "/stat").c_str(), "r");
          if (!f) continue;
          char buf[512] = {};
          size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
          std::fclose(f);
          const char* close_paren = std::strrchr(buf, ')');
          if (n == 0 || !close_paren || close_paren[1] == 0) continue;
          char state = close_paren[2];
          any = true;
          if (state != 'T' && state != 't') all = false;
        }
        ::closedir(d);
      }
      if (any && all) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  }
  void reap_killed() {
    if (pid_ > 0) {
      int st = 0;
      ::waitpid(pid_, &st, 0);
      status_ = st;
      pid_ = -1;
    }
  }
  pid_t pid() const { return pid_; }
  const ChildConfig& config() const { return cfg_; }

 private:
  ChildConfig cfg_;
  pid_t pid_ = -1;
  int from_ = -1, to_ = -1;
  std::string blob_;
  bool blob_read_ = false;
  int status_ = 0;
};

inline std::string transport_name(const testing::TestParamInfo<std::string>& info) { return info.param; }

}  // namespace sluice_test
