#include "transport/common/same_host.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "transport/common/lease_table.hpp"
#include "core/log.hpp"
#include "sluice/error.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail::same_host {
namespace {

constexpr auto kRequestDeadline = std::chrono::milliseconds(1000);

socklen_t abstract_addr(const std::string& name, sockaddr_un* a) {
  if (name.empty() || name.size() + 1 > sizeof(a->sun_path))
    throw Error(ErrorCode::kInvalidArgument, "same-host socket name of " + std::to_string(name.size()) + " bytes");
  std::memset(a, 0, sizeof(*a));
  a->sun_family = AF_UNIX;
  std::memcpy(a->sun_path + 1, name.data(), name.size());  // leading NUL: abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// Keeps the first descriptor a received message carried in *fd_out (if it has none yet) and
// closes any others: one descriptor per message; more are a peer's mistake.
void take_descriptors(msghdr& msg, int* fd_out) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (*fd_out < 0) *fd_out = got;
      else ::close(got);
    }
  }
}

// Waits until fd is readable or the deadline passes; false on timeout.
bool wait_readable(int fd, Clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) return true;  // let the read report the error
  }
}

// Reads exactly n bytes before the deadline; the first read may carry one descriptor.
void read_exact(int fd, void* buf, size_t n, Clock::time_point deadline, int* fd_out) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    if (!wait_readable(fd, deadline)) throw Error(ErrorCode::kTimeout, "same-host peer did not answer in time");
    iovec iov{p, n};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd_out) {
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
    }
    ssize_t r = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw Error(ErrorCode::kPeerLost, "same-host socket: " + net::errno_text(errno));
    }
    if (r == 0) throw Error(ErrorCode::kPeerLost, "same-host peer closed the connection");
    if (fd_out) {
      take_descriptors(msg, fd_out);
      fd_out = nullptr;  // descriptors only ride on a message's first byte
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
}

}  // namespace

PeerCred peer_cred(int fd) {
  ucred c{};
  socklen_t len = sizeof(c);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0)
    throw Error(ErrorCode::kSystem, "SO_PEERCRED: " + net::errno_text(errno));
  if (c.pid <= 0) throw Error(ErrorCode::kUnsupported, "the kernel does not name the peer process (another pid namespace?)");
  return {c.pid, c.uid};
}

void send(int fd, const nlohmann::json& body, int pass_fd) {
  std::string text = body.dump();
  if (text.size() > kMaxMessage) throw Error(ErrorCode::kInternal, "same-host message too large");
  uint8_t len[4];
  for (int i = 0; i < 4; ++i) len[i] = static_cast<uint8_t>(text.size() >> (8 * i));
  iovec iov[2] = {{len, 4}, {text.data(), text.size()}};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  if (pass_fd >= 0) {
    msg.msg_control = cbuf;
    msg.msg_controllen = sizeof(cbuf);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  size_t total = 4 + text.size(), sent = 0;
  while (sent < total) {
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      throw Error(ErrorCode::kPeerLost, "same-host socket: " + net::errno_text(errno));
    }
    sent += static_cast<size_t>(w);
    // The rest goes without the descriptor (it rode on the first byte).
    msg.msg_control = nullptr;
    msg.msg_controllen = 0;
    size_t skip = static_cast<size_t>(w);
    while (msg.msg_iovlen > 0 && skip >= msg.msg_iov[0].iov_len) {
      skip -= msg.msg_iov[0].iov_len;
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov[0].iov_base = static_cast<uint8_t*>(msg.msg_iov[0].iov_base) + skip;
      msg.msg_iov[0].iov_len -= skip;
    }
  }
}

nlohmann::json recv(int fd, Clock::time_point deadline, int* fd_out) {
  if (fd_out) *fd_out = -1;
  try {
    uint8_t len[4];
    read_exact(fd, len, 4, deadline, fd_out);
    uint32_t n = uint32_t(len[0]) | uint32_t(len[1]) << 8 | uint32_t(len[2]) << 16 | uint32_t(len[3]) << 24;
    if (n > kMaxMessage) throw Error(ErrorCode::kProtocol, "same-host message of " + std::to_string(n) + " bytes (limit 64 KiB)");
    std::string text(n, '\0');
    read_exact(fd, text.data(), n, deadline, nullptr);
    auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kProtocol, "same-host message is not a JSON object");
    return j;
  } catch (...) {
    if (fd_out && *fd_out >= 0) ::close(std::exchange(*fd_out, -1));
    throw;
  }
}

bool is_memfd(int fd, uint64_t min_bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (static_cast<uint64_t>(st.st_size) < min_bytes) return false;
  // Only shmem-backed files (memfd_create) answer F_GET_SEALS; files on disk do not. And only
  // a file sealed against shrinking is mapped: its owner could otherwise truncate it under
  // our mapping, and our next load from it would raise SIGBUS in this process.
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & F_SEAL_SHRINK) != 0;
}

net::Socket connect(const std::string& name) {
  sockaddr_un a;
  socklen_t len = abstract_addr(name, &a);
  net::Socket s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) throw Error(ErrorCode::kSystem, "socket(AF_UNIX): " + net::errno_text(errno));
  // A Unix-socket connect does not wait for the peer to accept: it fails at once when no one
  // listens (or the backlog is full).
  if (::connect(s.fd(), reinterpret_cast<sockaddr*>(&a), len) != 0)
    throw Error(ErrorCode::kUnsupported, "cannot reach the peer's same-host socket (another host or network "
                                         "namespace, or the peer is gone): " + net::errno_text(errno));
  return s;
}

Proof prove(const std::string& name, uint64_t token, const std::string& engine_id, int our_lease_fd,
            const std::string& expect_engine, Clock::time_point deadline, const char* transport) {
  Proof p;
  p.sock = connect(name);
  p.cred = peer_cred(p.sock.fd());
  send(p.sock.fd(), {{"op", "auth"}, {"token", token}, {"engine", engine_id}}, our_lease_fd);
  nlohmann::json reply = recv(p.sock.fd(), deadline, &p.lease_fd);
  struct Guard {
    int& fd;
    bool keep = false;
    ~Guard() {
      if (!keep && fd >= 0) ::close(std::exchange(fd, -1));
    }
  } guard{p.lease_fd};
  if (reply.contains("error"))
    throw Error(ErrorCode::kRemoteError, std::string(transport) + ": the peer refused us on its same-host socket: " +
                                             reply["error"].dump());
  if (p.lease_fd < 0 || !is_memfd(p.lease_fd, sizeof(LeaseSlot)))
    throw Error(ErrorCode::kProtocol, std::string(transport) + ": the peer did not pass a lease table (a memfd sealed against shrinking) on its same-host socket");
  auto engine = reply.find("engine");
  if (!expect_engine.empty() && (engine == reply.end() || !engine->is_string() || engine->get<std::string>() != expect_engine))
    throw Error(ErrorCode::kProtocol, std::string(transport) + ": the same-host socket named in the peer's info is served by engine " +
                                          (engine == reply.end() ? std::string("(none)") : engine->dump()) +
                                          ", not by the peer " + expect_engine);
  guard.keep = true;
  return p;
}

nlohmann::json ask(const std::string& name, pid_t pid, const nlohmann::json& req, Clock::time_point deadline, int* fd_out) {
  if (fd_out) *fd_out = -1;
  net::Socket sock = connect(name);
  if (peer_cred(sock.fd()).pid != pid)
    throw Error(ErrorCode::kPeerLost, "the peer's same-host socket is now served by another process");
  send(sock.fd(), req);
  return recv(sock.fd(), deadline, fd_out);
}

void Service::start(const std::string& prefix, Handler handler) {
  std::random_device rd;
  char suffix[17];
  std::snprintf(suffix, sizeof(suffix), "%08x%08x", rd(), rd());
  name_ = prefix + "-" + suffix;
  handler_ = std::move(handler);
  sockaddr_un a;
  socklen_t len = abstract_addr(name_, &a);
  listen_ = net::Socket(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listen_.valid()) throw Error(ErrorCode::kSystem, "socket(AF_UNIX): " + net::errno_text(errno));
  if (::bind(listen_.fd(), reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(listen_.fd(), 64) != 0)
    throw Error(ErrorCode::kSystem, "same-host socket " + name_ + ": " + net::errno_text(errno));
  if (::pipe2(wake_, O_CLOEXEC) != 0) throw Error(ErrorCode::kSystem, "pipe: " + net::errno_text(errno));
  thread_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-samehost");
    loop();
  });
}

void Service::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_[1] >= 0) {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  for (int& fd : wake_)
    if (fd >= 0) ::close(std::exchange(fd, -1));
  listen_.close();
}

bool recv_some(int fd, std::string& buf, int* fd_slot) {
  for (;;) {
    size_t want = 4;
    if (buf.size() >= 4) {
      uint32_t n = uint32_t(uint8_t(buf[0])) | uint32_t(uint8_t(buf[1])) << 8 | uint32_t(uint8_t(buf[2])) << 16 |
                   uint32_t(uint8_t(buf[3])) << 24;
      if (n > kMaxMessage) throw Error(ErrorCode::kProtocol, "same-host message of " + std::to_string(n) + " bytes (limit 64 KiB)");
      want = 4 + n;
    }
    if (buf.size() >= 4 && buf.size() == want) return true;
    char chunk[4096];
    iovec iov{chunk, std::min(sizeof(chunk), want - buf.size())};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    const bool first = buf.empty();
    if (first) {
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof(cbuf);
    }
    ssize_t r = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw Error(ErrorCode::kPeerLost, "same-host socket: " + net::errno_text(errno));
    }
    if (r == 0) throw Error(ErrorCode::kPeerLost, "same-host socket closed before the whole message arrived");
    if (first) take_descriptors(msg, fd_slot);
    buf.append(chunk, static_cast<size_t>(r));
  }
}

nlohmann::json parse_message(const std::string& buf) {
  auto j = nlohmann::json::parse(buf.begin() + 4, buf.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kProtocol, "same-host message is not a JSON object");
  return j;
}

net::Socket ask_start(const std::string& name, pid_t pid, const nlohmann::json& req) {
  // Non-blocking: a blocking Unix connect waits while the listener's backlog is full (a
  // stalled peer), and the caller is a reactor that must not wait.
  sockaddr_un a;
  socklen_t len = abstract_addr(name, &a);
  net::Socket sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock.valid()) throw Error(ErrorCode::kSystem, "socket(AF_UNIX): " + net::errno_text(errno));
  if (::connect(sock.fd(), reinterpret_cast<sockaddr*>(&a), len) != 0) {
    const int err = errno;
    if (err == EAGAIN)
      throw Error(ErrorCode::kTimeout, "the peer's same-host socket accepts no more connections (a stalled peer?)");
    throw Error(ErrorCode::kUnsupported, "cannot reach the peer's same-host socket (another host or network "
                                         "namespace, or the peer is gone): " + net::errno_text(err));
  }
  if (peer_cred(sock.fd()).pid != pid)
    throw Error(ErrorCode::kPeerLost, "the peer's same-host socket is now served by another process");
  send(sock.fd(), req);
  return sock;
}

namespace {

// A connection whose one request is still arriving. Many can be pending at once, each with its
// own deadline, so a client that connects and trickles (or says nothing) delays nobody.
struct Pending {
  net::Socket sock;
  PeerCred cred;
  std::string buf;  // the 4-byte length and the body, as far as they arrived
  int fd = -1;      // a descriptor that came with the first byte
  Clock::time_point deadline;
  ~Pending() {
    if (fd >= 0) ::close(fd);
  }
};
constexpr size_t kMaxPending = 64;

bool pull(Pending& p) { return recv_some(p.sock.fd(), p.buf, &p.fd); }

}  // namespace

void Service::loop() {
  std::vector<std::unique_ptr<Pending>> pending;
  auto last_full_log = Clock::time_point{};
  while (!stopping_.load()) {
    std::vector<pollfd> fds = {{listen_.fd(), POLLIN, 0}, {wake_[0], POLLIN, 0}};
    auto now = Clock::now();
    auto next = now + std::chrono::seconds(1);
    for (auto& p : pending) {
      fds.push_back({p->sock.fd(), POLLIN, 0});
      next = std::min(next, p->deadline);
    }
    int wait_ms = static_cast<int>(std::max<long long>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1));
    int rc = ::poll(fds.data(), fds.size(), wait_ms);
    if (rc < 0 && errno != EINTR) break;
    if (fds[1].revents & POLLIN) continue;  // stop() woke us
    std::vector<std::unique_ptr<Pending>> ready;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (!pending[i]) continue;
      if (!(fds[2 + i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      try {
        if (pull(*pending[i])) ready.push_back(std::move(pending[i]));
      } catch (const Error& e) {
        SLUICE_LOG(kDebug, "same-host socket " << name_ << ": dropped a request: " << e.what());
        pending[i].reset();
      }
    }
    now = Clock::now();
    std::erase_if(pending, [&](const auto& p) { return !p || p->deadline <= now; });
    if (fds[0].revents & POLLIN) {
      net::Socket conn(::accept4(listen_.fd(), nullptr, nullptr, SOCK_CLOEXEC));
      if (conn.valid()) {
        if (pending.size() >= kMaxPending) {
          if (now - last_full_log > std::chrono::seconds(1)) {
            SLUICE_LOG(kWarn, "same-host socket " << name_ << ": " << kMaxPending
                                                  << " requests pending; refusing more (a local process flooding it?)");
            last_full_log = now;
          }
        } else {
          try {
            auto p = std::make_unique<Pending>();
            p->cred = peer_cred(conn.fd());
            p->sock = std::move(conn);
            p->deadline = now + kRequestDeadline;
            pending.push_back(std::move(p));
          } catch (const Error& e) {
            SLUICE_LOG(kDebug, "same-host socket " << name_ << ": " << e.what());
          }
        }
      }
    }
    // Requests are handled here, one after another; handlers answer at once.
    for (auto& p : ready) {
      try {
        nlohmann::json j = parse_message(p->buf);
        handler_(p->sock, p->cred, j, std::exchange(p->fd, -1));
      } catch (const std::exception& e) {
        SLUICE_LOG(kDebug, "same-host socket " << name_ << ": dropped a request: " << e.what());
        if (p->sock.valid()) {
          try {
            send(p->sock.fd(), {{"error", e.what()}});
          } catch (const Error&) {
          }
        }
      }
    }
  }
}

std::string service_of(const std::map<std::string, nlohmann::json>& transports, const char* transport) {
  auto it = transports.find(transport);
  if (it == transports.end() || !it->second.is_object()) return {};
  auto s = it->second.find("socket");
  return s != it->second.end() && s->is_string() ? s->get<std::string>() : std::string();
}

bool service_usable(const std::string& name, const std::string& own, const char* transport, std::string* why) {
  if (name.empty()) {
    *why = std::string("the peer's ") + transport + " address names no same-host socket";
    return false;
  }
  if (name == own) {
    *why = "the peer's same-host socket is this engine's own";
    return false;
  }
  return true;
}

std::string require_service(const std::map<std::string, nlohmann::json>& transports, const char* transport) {
  std::string name = service_of(transports, transport);
  if (name.empty())
    throw Error(ErrorCode::kProtocol, std::string(transport) + ": the peer's info names no same-host socket");
  return name;
}

}  // namespace sluice::detail::same_host
