// A directory kept in a key-value store whose entries expire (etcd leases, Redis TTLs).
// Everything the store-backed directories share lives here: the record an engine publishes,
// first registration (create-if-absent: a name has one owner), the heartbeat thread that
// keeps the entry alive and publishes it again after the store lost it, withdraw on close,
// and lookups that wait for a missing name until their deadline. A backend (etcd, Redis)
// supplies only the store operations (StoreBackend).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "directory/peer_directory.hpp"

namespace sluice::detail {

// The operations a store must offer, each bounded by `deadline`. They throw Error when the
// store cannot be reached or answers nonsense (the directory retries or reports it); "not
// ours" and "absent" are answers, not errors. Called from the engine's threads and the
// heartbeat thread at once: implementations are thread-safe.
class StoreBackend {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~StoreBackend() = default;
  // Sets `key` to `value`, to expire after the TTL unless kept alive, only if the key is
  // absent. Returns std::nullopt when created, else the value that holds the key.
  virtual std::optional<std::string> create(const std::string& key, const std::string& value,
                                            Clock::time_point deadline) = 0;
  // Replaces this backend's own entry; false when the key is no longer ours (it expired, the
  // store restarted empty, or another engine holds it now).
  virtual bool update(const std::string& key, const std::string& value, Clock::time_point deadline) = 0;
  // Extends the life of our entry; false when it is gone.
  virtual bool keep_alive(const std::string& key, Clock::time_point deadline) = 0;
  virtual std::optional<std::string> get(const std::string& key, Clock::time_point deadline) = 0;
  // Deletes our entry, never another engine's.
  virtual void remove(const std::string& key, Clock::time_point deadline) = 0;
};

struct StoreDirectoryOptions {
  std::string display;  // the store's URL (no password), named in every message
  std::string prefix;   // keys are <prefix>/<name>
  std::chrono::milliseconds ttl{10000};
  std::chrono::milliseconds request_timeout{2000};   // one store request
  std::chrono::milliseconds register_timeout{5000};  // the first publish, retries included
  std::chrono::milliseconds watch{0};                // watch_period(); 0 = not watched
};

class StoreDirectory : public PeerDirectory {
 public:
  StoreDirectory(std::unique_ptr<StoreBackend> backend, StoreDirectoryOptions options);
  // Stops the heartbeat without withdrawing: the entry expires after the TTL, as a crashed
  // engine's does.
  ~StoreDirectory() override;

  // The first call registers the engine's name (kInvalidArgument when another live engine
  // holds it, kTimeout when the store did not answer within register_timeout) and starts the
  // heartbeat; later calls replace the entry (a failure there is logged and retried by the
  // heartbeat: registering a region does not fail because the store is down).
  void publish(const EngineInfo& self) override;
  void withdraw(const std::string& engine_id) override;
  // `ref` is an engine name; a "host:port" is asked of its listener instead. Waits while the
  // name is absent or the store unreachable, until `deadline` (then kTimeout saying which).
  EngineInfo lookup(const std::string& ref, Clock::time_point deadline) override;
  std::string ref_for(const EngineInfo& peer) const override;
  std::chrono::milliseconds watch_period() const override { return opt_.watch; }
  std::optional<std::string> owner_of(const std::string& ref, Clock::time_point deadline) override;

  const std::string& display() const { return opt_.display; }
  // Tests: heartbeats sent since the start (a stopped heartbeat shows as no progress).
  uint64_t heartbeats() const;

  // The record stored under a name, and its inverse (kProtocol naming `key` when malformed).
  static std::string encode(const EngineInfo& info);
  static EngineInfo decode(const std::string& key, const std::string& value);
  static std::string name_of(const EngineInfo& info) { return info.name.empty() ? info.engine_id : info.name; }

 private:
  std::string key_for(const std::string& name) const { return opt_.prefix + "/" + name; }
  void register_first(const std::string& key, const std::string& value, const std::string& engine_id);
  // Puts our current record back (update, else create); false when another engine holds the
  // name. Throws Error when the store is unreachable.
  bool republish();
  void heartbeat_loop();
  void stop_heartbeat();
  Clock::time_point request_deadline(Clock::time_point limit = Clock::time_point::max()) const;

  std::unique_ptr<StoreBackend> backend_;
  StoreDirectoryOptions opt_;
  std::mutex publish_mu_;  // one publish at a time (first registration included)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string key_;        // set by the first publish
  std::string value_;      // the latest record
  std::string engine_id_;  // our incarnation
  bool registered_ = false;
  bool dirty_ = false;  // value_ may not be in the store
  bool stop_ = false;
  uint64_t heartbeats_ = 0;
  std::thread heartbeat_;
};

}  // namespace sluice::detail
