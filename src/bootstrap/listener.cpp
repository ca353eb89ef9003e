#include "bootstrap/listener.hpp"

#include "core/params.hpp"

#include <fcntl.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <system_error>
#include <utility>

#include "core/log.hpp"
#include "sluice/error.hpp"
#include "core/thread_name.hpp"

namespace sluice::bootstrap {

bool LogLimiter::allow(uint64_t* held_back) {
  std::lock_guard<std::mutex> lk(mu_);
  auto now = std::chrono::steady_clock::now();
  if (last_ != std::chrono::steady_clock::time_point{} && now - last_ < interval_) {
    ++held_;
    return false;
  }
  last_ = now;
  *held_back = std::exchange(held_, 0);
  return true;
}

namespace {
// Process-wide: the listener is created by the engine but reads these where it starts.
const detail::Param<int> kMaxConnections{
    "listen.max_connections", "SLUICE_LISTEN_MAX_CONNECTIONS", 1024, detail::int_in(1, 1 << 20),
    "handshake connections held at once, silent or being handshaken (at the bound the oldest silent one is closed)",
    detail::ParamScope::kProcess};
const detail::Param<int> kIdleMs{"listen.idle_ms", "SLUICE_LISTEN_IDLE_MS", 0, detail::int_in(0, 3600 * 1000),
                                 "how long an accepted connection may stay silent; 0 = the engine's connect_timeout",
                                 detail::ParamScope::kProcess};
}  // namespace

void Listener::start(const std::string& host, uint16_t port, Handler handler, int max_handshakes,
                     std::chrono::milliseconds idle) {
  max_handshakes_ = max_handshakes < 1 ? 1 : max_handshakes;
  if (!limits_set_) {
    max_connections_ = kMaxConnections.read();
    int idle_ms = kIdleMs.read();
    idle_ = idle_ms > 0 ? std::chrono::milliseconds(idle_ms)
                        : std::chrono::milliseconds(std::max<long>(1, static_cast<long>(idle.count())));
  }
  max_connections_ = std::max(max_connections_, 1);
  sock_ = net::listen_tcp(host, port);
  port_ = net::local_port(sock_.fd());
  net::set_nonblocking(sock_.fd());
  handler_ = std::move(handler);
  if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(ErrorCode::kSystem, "pipe: " + net::errno_text(errno));
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw Error(ErrorCode::kSystem, "epoll_create1: " + net::errno_text(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = sock_.fd();
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, sock_.fd(), &ev);
  ev.data.fd = wake_[0];
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_[0], &ev);
  thread_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-listen");
    loop();
  });
}

void Listener::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_[1] >= 0) {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  reap(true);
  conns_.clear();
  order_.clear();
  held_.store(0);
  for (int& fd : wake_)
    if (fd >= 0) ::close(std::exchange(fd, -1));
  if (epfd_ >= 0) ::close(std::exchange(epfd_, -1));
  sock_.close();
}

void Listener::reap(bool all) {
  std::list<Worker> finished;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = workers_.begin(); it != workers_.end();) {
      if (all || it->done.load()) {
        auto next = std::next(it);
        finished.splice(finished.end(), workers_, it);
        it = next;
      } else {
        ++it;
      }
    }
  }
  for (auto& w : finished)
    if (w.thread.joinable()) w.thread.join();
}

void Listener::drop(int fd) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  if (!it->second.readable) ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  conns_.erase(it);  // closes the socket
  held_.store(static_cast<int>(conns_.size()));
}

void Listener::accept_all() {
  for (;;) {
    net::Socket conn = net::accept_tcp(sock_.fd());
    if (!conn.valid()) {
      // Out of descriptors: the pending connection keeps the socket readable; back off
      // instead of spinning until handshakes in flight finish.
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return;
    }
    if (static_cast<int>(conns_.size()) + active_.load() >= max_connections_) {
      // At the bound: the oldest connection still silent makes room (an idle flood ages out
      // in arrival order, an honest peer speaks at once). With none silent, the new one goes.
      bool evicted = false;
      while (!order_.empty() && !evicted) {
        auto [fd, seq] = order_.front();
        order_.pop_front();
        auto it = conns_.find(fd);
        if (it == conns_.end() || it->second.seq != seq || it->second.readable) continue;
        drop(fd);
        evicted = true;
      }
      uint64_t held = 0;
      if (busy_log_.allow(&held))
        SLUICE_LOG(kWarn, "listener: " << max_connections_ << " connections held (SLUICE_LISTEN_MAX_CONNECTIONS); "
                                       << (evicted ? "closed the oldest silent one" : "closed a new one at once")
                                       << (held ? " (and " + std::to_string(held) + " more since the last report)"
                                                : std::string()));
      if (!evicted) continue;
    }
    const int fd = conn.fd();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) continue;  // closes it
    Held h{std::move(conn), std::chrono::steady_clock::now() + idle_, false, ++seq_};
    order_.emplace_back(fd, h.seq);
    conns_.emplace(fd, std::move(h));
    held_.store(static_cast<int>(conns_.size()));
  }
}

void Listener::expire(std::chrono::steady_clock::time_point now) {
  // Arrival order is deadline order: stop at the first one still in time.
  while (!order_.empty()) {
    auto [fd, seq] = order_.front();
    auto it = conns_.find(fd);
    if (it == conns_.end() || it->second.seq != seq) {
      order_.pop_front();
      continue;
    }
    if (it->second.deadline > now) break;
    order_.pop_front();
    drop(fd);
  }
}

void Listener::dispatch() {
  // Readable connections, oldest first, while handler threads are free.
  for (auto oi = order_.begin(); oi != order_.end() && active_.load() < max_handshakes_;) {
    auto it = conns_.find(oi->first);
    if (it == conns_.end() || it->second.seq != oi->second) {
      oi = order_.erase(oi);
      continue;
    }
    if (!it->second.readable) {
      ++oi;
      continue;
    }
    net::Socket conn = std::move(it->second.sock);
    conns_.erase(it);
    oi = order_.erase(oi);
    held_.store(static_cast<int>(conns_.size()));
    active_.fetch_add(1);
    std::lock_guard<std::mutex> lk(mu_);
    workers_.emplace_back();
    Worker& w = workers_.back();
    try {
      w.thread = std::thread([this, &w, s = std::move(conn)]() mutable {
        ::sluice::detail::name_this_thread("sluice-accept");
        try {
          handler_(std::move(s));
        } catch (const std::exception& e) {
          SLUICE_LOG(kWarn, "listener: dropped a connection: " << e.what());
        }
        active_.fetch_sub(1);
        w.done.store(true);
        char c = 0;
        (void)!::write(wake_[1], &c, 1);  // a slot is free: dispatch the next one
      });
    } catch (const std::system_error& e) {
      // No thread for it (resource limit): the connection is closed, the listener goes on.
      active_.fetch_sub(1);
      workers_.pop_back();
      SLUICE_LOG(kWarn, "listener: cannot start a handshake thread: " << e.what());
    }
  }
}

void Listener::loop() {
  constexpr int kMaxEvents = 64;
  epoll_event evs[kMaxEvents];
  while (!stopping_.load()) {
    int n = ::epoll_wait(epfd_, evs, kMaxEvents, 100);
    reap(false);
    if (stopping_.load()) break;
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == wake_[0]) {
        char buf[64];
        while (::read(wake_[0], buf, sizeof(buf)) > 0) {
        }
      } else if (fd == sock_.fd()) {
        accept_all();
      } else {
        // First bytes (or a hang-up, which the handler reports): ready for a handler thread.
        auto it = conns_.find(fd);
        if (it != conns_.end() && !it->second.readable) {
          it->second.readable = true;
          ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
        }
      }
    }
    expire(std::chrono::steady_clock::now());
    dispatch();
  }
}

}  // namespace sluice::bootstrap
