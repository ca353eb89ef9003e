// Sluice through its C++ API, for bench/peers (issue 16): the same cells as every adapter,
// without Python between the caller and the engine (Open MPI's adapter is C too, so the two
// rows compare engines, not language bindings).
//   sluice_peer CELLS_FILE FOOTPRINT TRANSPORT CHANNELS MEMFD(0|1)
// CELLS_FILE: one cell a line, "op size batch conc iters" (op: read | write | send).
// Forks the target (a listening engine with a FOOTPRINT region named "peers" holding the base
// pattern); the parent is the initiator. The work, the slots, the warm-up, the timing and the
// byte check follow common.py (timed_loop, slot_offsets, pattern, check_seed) and
// engines/sluice_peer.py line for line. Prints one RESULT line per cell (the initiator) and one
// CHECK line per SEND cell (the target), as common.emit and native/mpi_peer.c do.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "sluice/sluice.hpp"

extern "C" {
#include "peers_mem.h"
}

namespace {

constexpr const char* kName = "peers";

struct Cell {
  std::string op;
  uint64_t size = 0;
  int batch = 0, conc = 0, iters = 0;
};

void fill(uint8_t* p, uint64_t n, uint64_t seed) {  // = common.pattern
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t j = i + seed;
    p[i] = static_cast<uint8_t>(((j * 2654435761ull) >> 13) + (j >> 21));
  }
}
uint64_t check_seed(const Cell& c) { return c.size * 7 + 1 + (c.op == "write" ? 1 : c.op == "send" ? 2 : 0); }
int warmup(const Cell& c) { return std::min(c.iters / 10 + 1, 8); }
uint64_t slot_offset(const Cell& c, uint64_t foot, uint64_t i, int j) {  // message j of batch i
  uint64_t slots = std::max<uint64_t>(1, foot / c.size);
  return ((i * c.batch + j) % slots) * c.size;
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "sluice_peer: %s\n", what.c_str());
  std::exit(2);
}
void must(const sluice::Status& st, const char* what) {
  if (!st.ok()) throw sluice::Error(st.code, std::string(what) + ": " + st.to_string());
}

// Memory of one side: engine-allocated (memfd, shareable) or plain and registered.
struct Buffer {
  sluice::Engine& e;
  sluice::Allocation alloc;
  std::unique_ptr<void, decltype(&std::free)> own{nullptr, &std::free};
  uint8_t* ptr = nullptr;
  sluice::MemoryHandle handle;
  Buffer(sluice::Engine& eng, uint64_t len, bool memfd, const std::string& name) : e(eng) {
    if (memfd) {
      alloc = e.allocate(len, sluice::Location::host(), name);
      ptr = static_cast<uint8_t*>(alloc.ptr);
      handle = alloc.handle;
    } else {
      own.reset(peers_alloc(len));
      if (!own) throw std::runtime_error("cannot allocate " + std::to_string(len) + " bytes");
      ptr = static_cast<uint8_t*>(own.get());
      handle = e.register_memory(ptr, len, sluice::Location::host(), name);
    }
  }
};

sluice::EngineConfig config(const std::string& transport, int channels) {
  sluice::EngineConfig c;
  c.transports = {transport};
  c.channels = channels;
  return c;
}

// SEND cells are synchronised with the target where native/mpi_peer.c has its barriers: the
// timed loop starts once the target has taken the warm-up messages, and the next cell once it
// has taken this cell's messages and checked them. Without that an eager SEND cell started
// while the target was still taking the previous cell's messages (up to shm.eager_credit of
// them), which only this adapter's rows paid. The target writes a byte to `cell_fd` at each point.
void cell_signal(int fd) {
  char b = 1;
  if (::write(fd, &b, 1) != 1) die("target: cell pipe");
}
void cell_wait(int fd) {
  char b;
  if (::read(fd, &b, 1) != 1) throw std::runtime_error("the target exited in the middle of a SEND cell");
}

// The target: receives every SEND cell's messages in order (a window of receives kept posted
// ahead), then the check batch, and prints one CHECK line per SEND cell.
int target(const std::vector<Cell>& cells, uint64_t foot, const std::string& transport, int channels, bool memfd,
           int addr_fd, int done_fd, int cell_fd) {
  sluice::EngineConfig c = config(transport, channels);
  c.listen_host = "127.0.0.1";
  c.listen_port = 0;
  c.recv_timeout = std::chrono::milliseconds(0);  // receives wait until the endpoint closes
  c.max_unexpected_bytes = 16 * foot;             // as engines/sluice_peer.py: a bound, not an allocation
  sluice::Engine engine(c);
  Buffer buf(engine, foot, memfd, kName);
  fill(buf.ptr, foot, 0);
  std::string addr = engine.listen_address() + "\n";
  if (::write(addr_fd, addr.data(), addr.size()) != static_cast<ssize_t>(addr.size())) die("target: address pipe");
  ::close(addr_fd);
  auto ep = engine.accept(std::chrono::seconds(60));
  if (!ep) die("target: no initiator connected within 60 s");
  std::vector<uint8_t> want(foot);
  for (size_t i = 0; i < cells.size(); ++i) {
    const Cell& cl = cells[i];
    if (cl.op != "send") continue;
    const uint64_t warm = static_cast<uint64_t>(warmup(cl)), total = warm + cl.iters;
    const size_t depth = static_cast<size_t>(cl.batch) * cl.conc * 2;
    std::deque<sluice::Future> pending;
    for (uint64_t b = 0; b < warm; ++b)
      for (int j = 0; j < cl.batch; ++j) pending.push_back(ep->recv(buf.handle, slot_offset(cl, foot, b, j), cl.size));
    for (auto& f : pending) must(f.wait(), "recv");
    pending.clear();
    // The first window of receives is posted before the initiator is told to start.
    bool signalled = false;
    for (uint64_t b = warm; b < total; ++b)
      for (int j = 0; j < cl.batch; ++j) {
        if (pending.size() >= depth) {
          if (!signalled) cell_signal(cell_fd);  // the warm-up arrived: the initiator starts its clock
          signalled = true;
          must(pending.front().wait(), "recv");
          pending.pop_front();
        }
        pending.push_back(ep->recv(buf.handle, slot_offset(cl, foot, b, j), cl.size));
      }
    if (!signalled) cell_signal(cell_fd);
    for (auto& f : pending) must(f.wait(), "recv");
    const uint64_t n = std::min<uint64_t>(cl.batch, std::max<uint64_t>(1, foot / cl.size));
    std::vector<sluice::Future> fs;
    for (uint64_t j = 0; j < n; ++j) fs.push_back(ep->recv(buf.handle, j * cl.size, cl.size));
    for (auto& f : fs) must(f.wait(), "recv");
    fill(want.data(), n * cl.size, check_seed(cl));
    bool ok = std::memcmp(buf.ptr, want.data(), n * cl.size) == 0;
    bool later_rma = std::any_of(cells.begin() + i + 1, cells.end(), [](const Cell& d) { return d.op != "send"; });
    if (later_rma) fill(buf.ptr, n * cl.size, 0);  // the base pattern again, for later reads
    std::printf("CHECK {\"key\": \"%s/%llu/%d/%d\", \"ok\": %s}\n", cl.op.c_str(), (unsigned long long)cl.size,
                cl.batch, cl.conc, ok ? "true" : "false");
    std::fflush(stdout);
    cell_signal(cell_fd);  // taken and checked: the initiator may start its next cell
  }
  char ch;
  while (::read(done_fd, &ch, 1) > 0) {
  }
  engine.close();
  return 0;
}

// One cell on the initiator: the timed loop of common.timed_loop, then the byte check of
// engines/sluice_peer.py. Returns false if the check failed.
bool run_cell(sluice::Endpoint& ep, const Cell& c, uint64_t foot, Buffer& local, Buffer& check,
              sluice::RemoteHandle remote, int cell_fd, double* secs, double* lat_ms) {
  const bool send = c.op == "send", rd = c.op == "read";
  auto submit = [&](uint64_t i) {
    std::vector<sluice::Future> fs;
    if (send) {
      for (int j = 0; j < c.batch; ++j) fs.push_back(ep.send(local.handle, slot_offset(c, foot, i, j), c.size));
      return fs;
    }
    sluice::Batch b;
    b.reserve(c.batch);
    for (int j = 0; j < c.batch; ++j) {
      uint64_t off = slot_offset(c, foot, i, j);
      b.push_back({local.handle, off, remote, off, c.size});
    }
    fs.push_back(rd ? ep.read(b) : ep.write(b));
    return fs;
  };
  struct Inflight {
    std::vector<sluice::Future> fs;
    double t;
  };
  std::deque<Inflight> inflight;
  double lat = 0;
  auto drain_one = [&] {
    for (auto& f : inflight.front().fs) must(f.wait(), c.op.c_str());
    lat += now() - inflight.front().t;
    inflight.pop_front();
  };
  auto post = [&](uint64_t i) {
    double t = now();  // before submit: posting is part of an operation's latency
    inflight.push_back({submit(i), t});
  };
  const int warm = warmup(c);
  for (int i = 0; i < warm; ++i) {
    if (static_cast<int>(inflight.size()) >= c.conc) drain_one();
    post(i);
  }
  while (!inflight.empty()) drain_one();
  if (send) cell_wait(cell_fd);  // the target took the warm-up (mpi_peer.c: MPI_Barrier)
  lat = 0;
  double t0 = now();
  for (int i = 0; i < c.iters; ++i) {
    if (static_cast<int>(inflight.size()) >= c.conc) drain_one();
    post(warm + i);
  }
  while (!inflight.empty()) drain_one();
  *secs = now() - t0;
  *lat_ms = lat / c.iters * 1e3;

  const uint64_t n = std::min<uint64_t>(c.batch, std::max<uint64_t>(1, foot / c.size));
  sluice::Batch same, into_check;
  for (uint64_t j = 0; j < n; ++j) {
    same.push_back({local.handle, j * c.size, remote, j * c.size, c.size});
    into_check.push_back({check.handle, j * c.size, remote, j * c.size, c.size});
  }
  bool ok = true;
  if (rd) {  // the target's region holds the base pattern
    must(ep.read(into_check).wait(), "check read");
    std::vector<uint8_t> want(n * c.size);
    fill(want.data(), want.size(), 0);
    ok = std::memcmp(check.ptr, want.data(), want.size()) == 0;
  } else {
    fill(local.ptr, n * c.size, check_seed(c));
    if (send) {
      std::vector<sluice::Future> fs;
      for (uint64_t j = 0; j < n; ++j) fs.push_back(ep.send(local.handle, j * c.size, c.size));
      for (auto& f : fs) must(f.wait(), "check send");  // the target checks and prints CHECK
      cell_wait(cell_fd);  // ... and has taken every message of this cell
    } else {
      must(ep.write(same).wait(), "check write");
      must(ep.read(into_check).wait(), "check read back");
      ok = std::memcmp(check.ptr, local.ptr, n * c.size) == 0;
    }
    fill(local.ptr, n * c.size, 0);
    if (!send) must(ep.write(same).wait(), "restore");  // the base pattern again, for later reads
  }
  return ok;
}

int initiator(const std::vector<Cell>& cells, uint64_t foot, const std::string& transport, int channels, bool memfd,
              const std::string& address, int cell_fd) {
  sluice::Engine engine(config(transport, channels));
  sluice::ConnectOptions co;
  co.transport = transport;
  sluice::Endpoint ep = engine.connect(address, co);
  auto remote = ep.remote_region(kName);
  if (!remote) die("the target has no region named 'peers'");
  Buffer local(engine, foot, memfd, "");
  Buffer check(engine, foot, false, "");
  fill(local.ptr, foot, 0);
  int bad = 0;
  for (const Cell& c : cells) {
    double secs = 0, lat = 0;
    std::string error;
    bool ok = false;
    try {
      ok = run_cell(ep, c, foot, local, check, *remote, cell_fd, &secs, &lat);
      if (!ok) error = "byte check failed";
    } catch (const std::exception& e) {
      error = std::string("Error: ") + e.what();
      for (char& ch : error)
        if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
      error.resize(std::min<size_t>(error.size(), 300));
    }
    bad += !ok;
    if (error.empty() || error == "byte check failed")
      std::printf("RESULT {\"op\": \"%s\", \"size\": %llu, \"batch\": %d, \"conc\": %d, \"iters\": %d, \"secs\": %.9f, "
                  "\"lat_ms\": %.9f, \"checked\": %s, \"error\": \"%s\", \"mbps\": %.3f}\n",
                  c.op.c_str(), (unsigned long long)c.size, c.batch, c.conc, c.iters, secs, lat, ok ? "true" : "false",
                  error.c_str(), double(c.size) * c.batch * c.iters / secs / 1e6);
    else
      std::printf("RESULT {\"op\": \"%s\", \"size\": %llu, \"batch\": %d, \"conc\": %d, \"iters\": %d, \"secs\": null, "
                  "\"lat_ms\": null, \"checked\": null, \"error\": \"%s\"}\n",
                  c.op.c_str(), (unsigned long long)c.size, c.batch, c.conc, c.iters, error.c_str());
    std::fflush(stdout);
  }
  engine.close();
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) die("usage: sluice_peer CELLS_FILE FOOTPRINT TRANSPORT CHANNELS MEMFD(0|1)");
  std::vector<Cell> cells;
  if (FILE* f = std::fopen(argv[1], "r")) {
    char op[16];
    unsigned long long size;
    int batch, conc, iters;
    while (std::fscanf(f, "%15s %llu %d %d %d", op, &size, &batch, &conc, &iters) == 5)
      cells.push_back({op, size, batch, conc, iters});
    std::fclose(f);
  } else {
    die(std::string("cannot open ") + argv[1]);
  }
  // The driver's time limit kills the worker that started us: nothing of ours outlives it.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const uint64_t foot = std::strtoull(argv[2], nullptr, 0);
  const std::string transport = argv[3];
  const int channels = std::atoi(argv[4]);
  const bool memfd = std::atoi(argv[5]) != 0;
  int addr[2], done[2], cell[2];
  if (::pipe(addr) != 0 || ::pipe(done) != 0 || ::pipe(cell) != 0) die("pipe");
  std::fflush(stdout);
  pid_t child = ::fork();
  if (child < 0) die("fork");
  if (child == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // and the target dies with the initiator
    ::close(addr[0]);
    ::close(done[1]);
    ::close(cell[0]);
    try {
      std::_Exit(target(cells, foot, transport, channels, memfd, addr[1], done[0], cell[1]));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sluice_peer target: %s\n", e.what());
      std::_Exit(2);
    }
  }
  ::close(addr[1]);
  ::close(done[0]);
  ::close(cell[1]);
  std::string address;
  char ch;
  while (::read(addr[0], &ch, 1) == 1 && ch != '\n') address += ch;
  if (address.empty()) die("the target did not start");
  int rc = 2;
  try {
    rc = initiator(cells, foot, transport, channels, memfd, address, cell[0]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sluice_peer initiator: %s\n", e.what());
  }
  ::close(done[1]);  // the target exits on EOF
  int status = 0;
  ::waitpid(child, &status, 0);
  return rc;
}
