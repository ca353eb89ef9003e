// The engine's handshake listener: accepts connections and hands each one, on its own short
// lived thread, to a handler (so a slow or garbage peer never blocks the others). At most
// `max_handshakes` handler threads run at once: a connection beyond that is closed at once
// (a flood of trickling peers cannot make the engine hold a thread each).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
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
  void start(const std::string& host, uint16_t port, Handler handler, int max_handshakes = 64);
  void stop();
  uint16_t port() const { return port_; }
  int active() const { return active_.load(); }

 private:
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void loop();
  void reap(bool all);

  net::Socket sock_;
  int wake_[2] = {-1, -1};
  uint16_t port_ = 0;
  int max_handshakes_ = 64;
  Handler handler_;
  std::thread thread_;
  std::mutex mu_;
  std::list<Worker> workers_;
  std::atomic<int> active_{0};  // handler threads not yet finished
  std::atomic<bool> stopping_{false};
  LogLimiter busy_log_;
};

}  // namespace sluice::bootstrap
