// The engine's handshake listener: accepts connections and hands each one, on its own short
// lived thread, to a handler (so a slow or garbage peer never blocks the others).
#pragma once

#include <atomic>
#include <functional>
#include <list>
#include <mutex>
#include <string>
#include <thread>

#include "bootstrap/socket.hpp"

namespace sluice::bootstrap {

class Listener {
 public:
  using Handler = std::function<void(net::Socket)>;
  ~Listener() { stop(); }
  void start(const std::string& host, uint16_t port, Handler handler);
  void stop();
  uint16_t port() const { return port_; }

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
  Handler handler_;
  std::thread thread_;
  std::mutex mu_;
  std::list<Worker> workers_;
  std::atomic<bool> stopping_{false};
};

}  // namespace sluice::bootstrap
