// The engine's handshake listener. Accepted connections wait in an epoll set, costing a
// descriptor and no thread, until their first bytes arrive; only then does a short-lived
// handler thread take one (so a slow or garbage peer never blocks the others). At most
// `max_handshakes` handler threads run at once; readable connections beyond that wait their
// turn. A connection silent past the idle deadline is closed, and at most
// `max_connections` are held at all: at the bound the oldest silent one makes room for a new
// one, so a flood of idle connections cannot shut an honest peer out.
//
// Tunables (read by start(), parsed strictly):
//   SLUICE_LISTEN_MAX_CONNECTIONS  connections held, silent or being handshaken (default 1024)
//   SLUICE_LISTEN_IDLE_MS          how long an accepted connection may stay silent (default: the
//                                  engine's connect_timeout, the handshake deadline)
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <deque>
#include <list>
#include <unordered_map>
#include <mutex>
#include <string>
#include <thread>

#include "bootstrap/socket.hpp"

namespace sluice::bootstrap {

// Lets one log line through per interval and counts the ones it held back, so that a peer
// flooding the listener cannot flood the log.
class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::milliseconds interval = std::chrono::seconds(1)) : interval_(interval) {}
  // True when a line may be logged now; *held_back: lines suppressed since the last one.
  bool allow(uint64_t* held_back);

 private:
  std::mutex mu_;
  std::chrono::milliseconds interval_;
  std::chrono::steady_clock::time_point last_{};
  uint64_t held_ = 0;
};

class Listener {
 public:
  using Handler = std::function<void(net::Socket)>;
  ~Listener() { stop(); }
  // `idle`: how long an accepted connection may stay silent (the engine passes its handshake
  // deadline, connect_timeout); SLUICE_LISTEN_IDLE_MS overrides it.
  void start(const std::string& host, uint16_t port, Handler handler, int max_handshakes = 64,
             std::chrono::milliseconds idle = std::chrono::milliseconds(10000));
  void stop();
  uint16_t port() const { return port_; }
  int active() const { return active_.load(); }
  // Accepted connections not yet handed to a handler (silent or waiting for a thread).
  int held() const { return held_.load(); }
  // Override the tunables (tests); call before start().
  void set_limits(int max_connections, std::chrono::milliseconds idle) {
    max_connections_ = max_connections;
    idle_ = idle;
    limits_set_ = true;
  }

 private:
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  struct Held {
    net::Socket sock;
    std::chrono::steady_clock::time_point deadline;
    bool readable = false;
    uint64_t seq = 0;
  };
  void loop();
  void reap(bool all);
  void accept_all();
  void dispatch();
  void expire(std::chrono::steady_clock::time_point now);
  void drop(int fd);

  net::Socket sock_;
  int wake_[2] = {-1, -1};
  uint16_t port_ = 0;
  int max_handshakes_ = 64;
  int max_connections_ = 1024;
  std::chrono::milliseconds idle_{10000};
  bool limits_set_ = false;
  int epfd_ = -1;
  // Listener thread only: accepted connections by descriptor, and their order of arrival
  // (oldest first; a closed one's descriptor stays until popped and is skipped).
  std::unordered_map<int, Held> conns_;
  std::deque<std::pair<int, uint64_t>> order_;  // (descriptor, Held::seq)
  uint64_t seq_ = 0;
  std::atomic<int> held_{0};
  Handler handler_;
  std::thread thread_;
  std::mutex mu_;
  std::list<Worker> workers_;
  std::atomic<int> active_{0};  // handler threads not yet finished
  std::atomic<bool> stopping_{false};
  LogLimiter busy_log_;
};

}  // namespace sluice::bootstrap
