// sluice-scale: what one engine costs per peer. A hub engine, alone in its process, accepts P
// peers (engines in forked child processes, P/K per child), writes a few bytes to each to
// prove the endpoints work, then reports the hub's thread count and resident memory from
// /proc/self/status. Public API only.
//
//   sluice-scale [--transports tcp,shm] [--peers 1,16,64,256] [--children K] [--channels N]
//                [--json | --csv]
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "sluice/sluice.hpp"

using namespace std::chrono_literals;

namespace {

constexpr const char* kRegion = "scale";
constexpr uint64_t kRegionBytes = 4096;

struct Row {
  std::string transport;
  int peers = 0;
  int channels = 0;
  long threads_idle = 0;  // the hub engine before any peer
  long threads = 0;       // connected, after one write to each peer
  long rss_kib_idle = 0;
  long rss_kib = 0;
  double connect_s = 0;
  std::string error;      // a limit hit or a failure, empty when the row is complete
};

long proc_status(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  size_t n = std::strlen(key);
  while (std::getline(f, line))
    if (line.compare(0, n, key) == 0 && line.size() > n && line[n] == ':') return std::atol(line.c_str() + n + 1);
  return -1;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Each child engine is a peer: it connects to the hub, registers a region the hub writes to,
// and lives until the hub closes the pipe.
[[noreturn]] void child(int cmd_fd, int ack_fd, int engines, const std::string& transport, int channels) {
  // The hub's info blob, one line.
  std::string addr;
  char ch;
  ssize_t got = 0;
  while ((got = ::read(cmd_fd, &ch, 1)) == 1 && ch != '\n') addr.push_back(ch);
  got = addr.empty() ? 0 : 1;
  std::string status = "ok";
  std::vector<std::unique_ptr<sluice::Engine>> keep;
  std::vector<sluice::Endpoint> eps;
  std::vector<sluice::Allocation> regions;
  try {
    if (got <= 0) throw std::runtime_error("no hub address");
    for (int i = 0; i < engines; ++i) {
      sluice::EngineConfig c;
      c.transports = {transport};
      c.channels = channels;
      keep.push_back(std::make_unique<sluice::Engine>(c));
      regions.push_back(keep.back()->allocate(kRegionBytes, sluice::Location::host(), kRegion));
      eps.push_back(keep.back()->connect(addr));
    }
  } catch (const std::exception& e) {
    status = std::string("child: ") + e.what();
  }
  status += "\n";
  (void)!::write(ack_fd, status.data(), status.size());
  char c;
  while (::read(cmd_fd, &c, 1) > 0) {
  }
  std::_Exit(0);  // skip destructors: the hub is measured, not our teardown
}

Row measure(const std::string& transport, int peers, int children, int channels) {
  Row row;
  row.transport = transport;
  row.peers = peers;
  row.channels = channels;
  children = std::max(1, std::min(children, peers));
  struct Kid {
    pid_t pid;
    int cmd, ack;
    int engines;
  };
  std::vector<Kid> kids;
  // Children first: they must not inherit a live engine's threads.
  for (int k = 0; k < children; ++k) {
    int cmd[2], ack[2];
    if (::pipe(cmd) || ::pipe(ack)) {
      row.error = "pipe: " + std::string(std::strerror(errno));
      break;
    }
    int n = peers / children + (k < peers % children ? 1 : 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(cmd[1]);
      ::close(ack[0]);
      for (auto& o : kids) {
        ::close(o.cmd);
        ::close(o.ack);
      }
      child(cmd[0], ack[1], n, transport, channels);
    }
    ::close(cmd[0]);
    ::close(ack[1]);
    kids.push_back({pid, cmd[1], ack[0], n});
  }
  {
    sluice::EngineConfig c;
    c.transports = {transport};
    c.channels = channels;
    c.max_pending_accepts = std::max(c.max_pending_accepts, peers + 16);
    std::optional<sluice::Engine> hub;
    std::vector<sluice::Endpoint> eps;
    try {
      hub.emplace(c);
      auto region = hub->allocate(kRegionBytes, sluice::Location::host(), "hub");
      std::memset(region.ptr, 0x5a, kRegionBytes);
      row.threads_idle = proc_status("Threads");
      row.rss_kib_idle = proc_status("VmRSS");
      // The hub's port: listen_port in the config is 0 (pick one); local_info() has the real one.
      std::string info = hub->local_info() + "\n";
      auto t0 = std::chrono::steady_clock::now();
      for (auto& kid : kids) (void)!::write(kid.cmd, info.data(), info.size());
      for (auto& kid : kids) {
        char buf[512] = {};
        ssize_t r = ::read(kid.ack, buf, sizeof(buf) - 1);
        std::string s = r > 0 ? std::string(buf, static_cast<size_t>(r)) : "child died";
        while (!s.empty() && s.back() == '\n') s.pop_back();
        if (s != "ok" && row.error.empty()) row.error = s;
      }
      while (static_cast<int>(eps.size()) < peers) {
        auto ep = hub->accept(10s);
        if (!ep) {
          if (row.error.empty()) row.error = "accepted only " + std::to_string(eps.size()) + " peers";
          break;
        }
        eps.push_back(std::move(*ep));
      }
      row.connect_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // One small write to every peer proves each endpoint moves data.
      std::vector<sluice::Future> writes;
      for (auto& ep : eps) {
        auto remote = ep.remote_region(kRegion);
        if (!remote) {
          row.error = "a peer has no region '" + std::string(kRegion) + "'";
          break;
        }
        writes.push_back(ep.write({{region.handle, 0, *remote, 0, 64}}));
      }
      for (auto& f : writes) {
        auto st = f.wait();
        if (!st.ok() && row.error.empty()) row.error = "write: " + st.message;
      }
      row.threads = proc_status("Threads");
      row.rss_kib = proc_status("VmRSS");
      eps.clear();
      hub->free(region);
    } catch (const std::exception& e) {
      row.error = e.what();
      row.threads = proc_status("Threads");
      row.rss_kib = proc_status("VmRSS");
    }
  }
  for (auto& kid : kids) {
    ::close(kid.cmd);
    ::close(kid.ack);
  }
  for (auto& kid : kids) {
    int st;
    ::waitpid(kid.pid, &st, 0);
  }
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> transports = {"tcp", "shm"};
  std::vector<int> peers = {1, 16, 64, 256};
  int children = 16, channels = 2;
  bool json = false, csv = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--transports") transports = split(next());
    else if (a == "--peers") {
      peers.clear();
      for (auto& p : split(next())) peers.push_back(std::stoi(p));
    } else if (a == "--children") children = std::stoi(next());
    else if (a == "--channels") channels = std::stoi(next());
    else if (a == "--json") json = true;
    else if (a == "--csv") csv = true;
    else {
      std::cerr << "usage: sluice-scale [--transports tcp,shm] [--peers 1,16,64,256] [--children K] "
                   "[--channels N] [--json|--csv]\n";
      return a == "--help" ? 0 : 2;
    }
  }
  // Every peer costs the hub `channels` sockets plus handshake descriptors: raise the soft
  // limit to the hard one and say so if even that is too few.
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &rl);
  ::getrlimit(RLIMIT_NOFILE, &rl);
  int maxp = 0;
  for (int p : peers) maxp = std::max(maxp, p);
  uint64_t need = static_cast<uint64_t>(maxp) * (channels + 4) + 64;
  if (rl.rlim_cur < need)
    std::cerr << "sluice-scale: RLIMIT_NOFILE is " << rl.rlim_cur << ", " << maxp << " peers may need ~" << need
              << " descriptors: large rows may fail\n";
  ::signal(SIGPIPE, SIG_IGN);
  const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);

  std::vector<Row> rows;
  for (auto& t : transports)
    for (int p : peers) rows.push_back(measure(t, p, children, channels));

  if (json) {
    std::cout << "{\"cores\": " << cores << ", \"nofile\": " << rl.rlim_cur << ", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::cout << (i ? ",\n " : "\n ") << "{\"transport\": \"" << r.transport << "\", \"peers\": " << r.peers
                << ", \"channels\": " << r.channels << ", \"threads_idle\": " << r.threads_idle
                << ", \"threads\": " << r.threads << ", \"rss_kib_idle\": " << r.rss_kib_idle
                << ", \"rss_kib\": " << r.rss_kib << ", \"connect_s\": " << r.connect_s << ", \"error\": \"";
      for (char c : r.error) std::cout << (c == '"' || c == '\\' ? "\\" : "") << c;
      std::cout << "\"}";
    }
    std::cout << "\n]}\n";
  } else if (csv) {
    std::cout << "transport,peers,channels,threads_idle,threads,rss_kib_idle,rss_kib,connect_s,error\n";
    for (const Row& r : rows)
      std::cout << r.transport << ',' << r.peers << ',' << r.channels << ',' << r.threads_idle << ',' << r.threads
                << ',' << r.rss_kib_idle << ',' << r.rss_kib << ',' << r.connect_s << ",\"" << r.error << "\"\n";
  } else {
    std::printf("cores %ld, RLIMIT_NOFILE %llu\n", cores, static_cast<unsigned long long>(rl.rlim_cur));
    std::printf("%-9s %6s %4s %13s %8s %13s %10s %9s  %s\n", "transport", "peers", "ch", "threads(idle)", "threads",
                "RSS idle KiB", "RSS KiB", "connect s", "error");
    for (const Row& r : rows)
      std::printf("%-9s %6d %4d %13ld %8ld %13ld %10ld %9.2f  %s\n", r.transport.c_str(), r.peers, r.channels,
                  r.threads_idle, r.threads, r.rss_kib_idle, r.rss_kib, r.connect_s, r.error.c_str());
  }
  bool bad = false;
  for (const Row& r : rows) bad |= !r.error.empty();
  return bad ? 1 : 0;
}
