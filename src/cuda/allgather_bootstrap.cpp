// AllGather::bootstrap: exchange handles through rank 0 over TCP.
#include <thread>

#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "sluice/allgather.hpp"
#include "sluice/error.hpp"

namespace sluice::cuda {
namespace {

void put_str(int fd, const std::string& s) {
  uint32_t n = static_cast<uint32_t>(s.size());
  if (!net::write_full(fd, &n, 4) || !net::write_full(fd, s.data(), n))
    throw Error(ErrorCode::kPeerLost, "AllGather bootstrap: write failed");
}

std::string get_str(int fd) {
  uint32_t n = 0;
  if (!net::read_full(fd, &n, 4) || n > (1u << 20)) throw Error(ErrorCode::kPeerLost, "AllGather bootstrap: read failed");
  std::string s(n, '\0');
  if (n && !net::read_full(fd, s.data(), n)) throw Error(ErrorCode::kPeerLost, "AllGather bootstrap: read failed");
  return s;
}

}  // namespace

void AllGather::bootstrap(const std::string& root, std::chrono::milliseconds timeout) {
  auto [host, port] = detail::split_host_port(root);
  const int world = world_size(), me = rank();
  std::vector<std::string> all(world);
  all[me] = handle();
  if (world == 1) return connect(all);
  if (me == 0) {
    net::Socket ls = net::listen_tcp(host, port);
    std::vector<net::Socket> peers;
    for (int i = 1; i < world; ++i) {
      net::Socket s = net::accept_tcp(ls.fd());
      net::set_io_timeout(s.fd(), timeout);
      uint32_t r = 0;
      if (!net::read_full(s.fd(), &r, 4) || r == 0 || r >= static_cast<uint32_t>(world) || !all[r].empty())
        throw Error(ErrorCode::kProtocol, "AllGather bootstrap: bad or duplicate rank");
      all[r] = get_str(s.fd());
      peers.push_back(std::move(s));
    }
    for (auto& s : peers)
      for (auto& h : all) put_str(s.fd(), h);
  } else {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    net::Socket s;
    for (;;) {
      try {
        s = net::connect_tcp(host, port, std::chrono::milliseconds(1000));
        break;
      } catch (const Error&) {
        if (std::chrono::steady_clock::now() > deadline) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    net::set_io_timeout(s.fd(), timeout);
    uint32_t r = static_cast<uint32_t>(me);
    if (!net::write_full(s.fd(), &r, 4)) throw Error(ErrorCode::kPeerLost, "AllGather bootstrap: write failed");
    put_str(s.fd(), all[me]);
    for (int i = 0; i < world; ++i) all[i] = get_str(s.fd());
  }
  connect(all);
}

}  // namespace sluice::cuda
