// Real etcd and redis-server processes for the directory tests: each on free loopback ports,
// in its own temp dir, stopped and restarted at will, killed with the test process (parent
// death signal) so that none outlives a crashed test.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace sluice::test {

enum class StoreKind { kEtcd, kRedis };

class StoreServer {
 public:
  explicit StoreServer(StoreKind kind);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The server binary on PATH, or "" when it is not installed.
  static std::string binary(StoreKind kind);
  // Starts the server and waits until it answers (throws std::runtime_error naming its log
  // after 20 s). `wipe`: start with an empty data dir (a store that lost its data).
  void start(bool wipe = false);
  // SIGTERM, then SIGKILL after 5 s; waits for the process.
  void stop();
  bool running() const { return pid_ > 0; }

  uint16_t port() const { return port_; }
  // etcd://127.0.0.1:port/<prefix> or redis://127.0.0.1:port/0?prefix=<prefix>
  std::string url(const std::string& prefix) const;
  StoreKind kind() const { return kind_; }
  const std::string& log_path() const { return log_; }

 private:
  void wait_ready();

  StoreKind kind_;
  std::string dir_;
  std::string log_;
  uint16_t port_ = 0;
  uint16_t peer_port_ = 0;  // etcd's raft port
  pid_t pid_ = -1;
};

// A loopback port that nothing listens on (bound, read and released).
uint16_t free_port();
const char* kind_name(StoreKind kind);

}  // namespace sluice::test
