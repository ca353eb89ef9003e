#include "bootstrap/socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/params.hpp"
#include "sluice/error.hpp"

namespace sluice::net {

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

std::string errno_text(int err) { return std::strerror(err); }

namespace {

addrinfo* resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string p = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), p.c_str(), &hints, &res);
  if (rc != 0)
    throw Error(ErrorCode::kInvalidArgument, "cannot resolve '" + host + "': " + gai_strerror(rc));
  return res;
}

}  // namespace

namespace {

// Connected (or definitely not) after `pfd` reported: 0, else the socket's error.
int connect_error(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

const detail::Param<int> kRetryMs{
    "connect.retry_ms", "SLUICE_CONNECT_RETRY_MS", 200, detail::int_in(0, 60000),
    "a TCP connection attempt to a peer's listener not established after this long is joined by a fresh one "
    "(a lost SYN is resent by the kernel only after 1 s); 0 = one attempt per address",
    detail::ParamScope::kProcess};

// Attempts to one address run side by side, at most this many (each holds a socket).
constexpr size_t kMaxAttempts = 8;

// One address, for `timeout`. A lost SYN is resent by the kernel only after 1 s (then 3,
// 7 s), so with `retry_after` > 0 an attempt still pending after it is joined by a fresh
// socket, whose SYN leaves at once; the first to connect wins and the others are closed (a
// listener that accepted one sees it close before any request). A refusal or other error
// ends the address: no new attempt is started after one.
Socket dial(const addrinfo* ai, std::chrono::milliseconds timeout, std::chrono::milliseconds retry_after,
            std::string* last, ErrorCode* code) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  std::vector<Socket> pending;
  bool refused = false;
  auto next_start = Clock::now();
  for (;;) {
    auto now = Clock::now();
    if (!refused && now >= next_start && pending.size() < kMaxAttempts && (pending.empty() || retry_after.count() > 0)) {
      Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
      if (!s.valid()) {
        *last = errno_text(errno);
        refused = true;
      } else if (::connect(s.fd(), ai->ai_addr, ai->ai_addrlen) == 0) {
        return s;
      } else if (errno == EINPROGRESS) {
        pending.push_back(std::move(s));
      } else {
        *last = errno_text(errno);
        refused = true;
      }
      next_start = now + retry_after;
    }
    if (pending.empty()) return Socket();
    if (now >= deadline) {
      *last = "timed out after " + std::to_string(timeout.count()) + " ms";
      *code = ErrorCode::kTimeout;
      return Socket();
    }
    auto until = deadline;
    if (!refused && retry_after.count() > 0 && pending.size() < kMaxAttempts) until = std::min(until, next_start);
    auto wait = std::chrono::ceil<std::chrono::milliseconds>(until - now);
    std::vector<pollfd> pfds;
    for (const auto& s : pending) pfds.push_back({s.fd(), POLLOUT, 0});
    int rc = ::poll(pfds.data(), pfds.size(), static_cast<int>(std::max<int64_t>(0, wait.count())));
    if (rc <= 0) continue;  // EINTR, or time for the next attempt or the deadline
    std::vector<Socket> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (!pfds[i].revents) {
        still.push_back(std::move(pending[i]));
        continue;
      }
      int err = connect_error(pending[i].fd());
      if (err == 0) return std::move(pending[i]);  // the rest close with `pending`
      *last = errno_text(err);
      refused = true;
    }
    pending.swap(still);
  }
}

}  // namespace

Socket connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  const std::chrono::milliseconds retry_after(kRetryMs.read());
  addrinfo* res = resolve(host, port, false);
  std::string last = "no address";
  ErrorCode code = ErrorCode::kPeerLost;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Socket s = dial(ai, timeout, retry_after, &last, &code);  // each address gets the whole timeout, as before
    if (!s.valid()) continue;
    int flags = ::fcntl(s.fd(), F_GETFL);
    ::fcntl(s.fd(), F_SETFL, flags & ~O_NONBLOCK);
    int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    ::freeaddrinfo(res);
    return s;
  }
  ::freeaddrinfo(res);
  throw Error(code, "cannot connect to " + host + ":" + std::to_string(port) + ": " + last);
}

Socket listen_tcp(const std::string& host, uint16_t port, int backlog) {
  addrinfo* res = resolve(host, port, true);
  std::string last = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!s.valid()) continue;
    int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.fd(), backlog) != 0) {
      last = errno_text(errno);
      continue;
    }
    ::freeaddrinfo(res);
    return s;
  }
  ::freeaddrinfo(res);
  throw Error(ErrorCode::kSystem, "cannot listen on " + host + ":" + std::to_string(port) + ": " + last);
}

uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

Socket accept_tcp(int listen_fd) {
  int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  return Socket(fd);
}

void tune_stream(int fd, int buffer_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
}

void set_nonblocking(int fd) {
  int fl = ::fcntl(fd, F_GETFL, 0);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) throw Error(ErrorCode::kSystem, "fcntl(O_NONBLOCK): " + errno_text(errno));
}

void set_io_timeout(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

bool read_full(int fd, void* buf, size_t n) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      errno = ECONNRESET;
      return false;
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool write_full(int fd, const void* buf, size_t n) {
  auto* p = static_cast<const uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = ::send(fd, p, n, MSG_NOSIGNAL);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r < 0 && errno != EINTR) {
      return false;
    }
  }
  return true;
}

}  // namespace sluice::net
