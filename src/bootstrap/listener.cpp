#include "bootstrap/listener.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "core/log.hpp"
#include "sluice/error.hpp"

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

void Listener::start(const std::string& host, uint16_t port, Handler handler, int max_handshakes) {
  max_handshakes_ = max_handshakes < 1 ? 1 : max_handshakes;
  sock_ = net::listen_tcp(host, port);
  port_ = net::local_port(sock_.fd());
  handler_ = std::move(handler);
  if (::pipe2(wake_, O_CLOEXEC) != 0) throw Error(ErrorCode::kSystem, "pipe: " + net::errno_text(errno));
  thread_ = std::thread([this] { loop(); });
}

void Listener::stop() {
  if (stopping_.exchange(true)) return;
  if (wake_[1] >= 0) {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  reap(true);
  for (int& fd : wake_)
    if (fd >= 0) ::close(std::exchange(fd, -1));
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

void Listener::loop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{sock_.fd(), POLLIN, 0}, {wake_[0], POLLIN, 0}};
    int rc = ::poll(fds, 2, 1000);
    reap(false);
    if (rc <= 0 || (fds[1].revents & POLLIN)) continue;
    net::Socket conn = net::accept_tcp(sock_.fd());
    if (!conn.valid()) {
      // Out of descriptors: the pending connection keeps the socket readable; back off
      // instead of spinning until handshakes in flight finish.
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    if (active_.load() >= max_handshakes_) {
      // Closing at once (rather than queueing) keeps both threads and descriptors bounded;
      // an honest peer sees a reset and retries.
      uint64_t held = 0;
      if (busy_log_.allow(&held))
        SLUICE_LOG(kWarn, "listener: " << max_handshakes_ << " handshakes in flight (max_handshakes); closed a new "
                                       << "connection at once" << (held ? " (and " + std::to_string(held) +
                                       " more since the last report)" : std::string()));
      continue;
    }
    active_.fetch_add(1);
    std::lock_guard<std::mutex> lk(mu_);
    workers_.emplace_back();
    Worker& w = workers_.back();
    try {
      w.thread = std::thread([this, &w, s = std::move(conn)]() mutable {
        try {
          handler_(std::move(s));
        } catch (const std::exception& e) {
          SLUICE_LOG(kWarn, "listener: dropped a connection: " << e.what());
        }
        active_.fetch_sub(1);
        w.done.store(true);
      });
    } catch (const std::system_error& e) {
      // No thread for it (resource limit): the connection is closed, the listener goes on.
      active_.fetch_sub(1);
      workers_.pop_back();
      SLUICE_LOG(kWarn, "listener: cannot start a handshake thread: " << e.what());
    }
  }
}

}  // namespace sluice::bootstrap
