// The engine's private state: registry, transports, listener, endpoints and the watchdog.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bootstrap/listener.hpp"
#include "bootstrap/messages.hpp"
#include "core/endpoint_impl.hpp"
#include "core/engine_info.hpp"
#include "core/registry.hpp"
#include "directory/peer_directory.hpp"
#include "sluice/engine.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {

class EngineImpl : public std::enable_shared_from_this<EngineImpl> {
 public:
  explicit EngineImpl(EngineConfig config);
  ~EngineImpl();
  void start();
  void close();

  const EngineConfig& config() const { return config_; }
  Registry& registry() { return registry_; }
  EngineInfo info() const;
  std::string listen_address() const;
  std::vector<std::string> transport_names() const;

  MemoryHandle register_memory(void* ptr, uint64_t length, Location location, const std::string& name);
  void unregister_memory(MemoryHandle h);
  Allocation allocate(uint64_t length, Location location, const std::string& name);
  void free(const Allocation& a);

  // `counters`: an endpoint that reconnects passes its own, so that its metrics go on.
  std::shared_ptr<EndpointImpl> connect(const std::string& target, const ConnectOptions& options,
                                        std::shared_ptr<EndpointCounters> counters = nullptr);
  std::shared_ptr<EndpointImpl> accept(std::chrono::milliseconds timeout);
  // The peer `ref` names, through the engine's directory (the listener INFO query unless
  // use_directory() chose another).
  EngineInfo lookup_peer(const std::string& ref, std::chrono::milliseconds timeout);
  // The ref under which the directory finds `peer` again.
  std::string peer_ref(const EngineInfo& peer) const;
  // Internal API (no EngineConfig field yet): publish through `dir` from now on and resolve
  // connect() targets that are not info blobs there. The engine publishes at once.
  void use_directory(std::shared_ptr<PeerDirectory> dir);
  void forget(EndpointImpl* ep);
  // The counters of every open endpoint (metrics.cpp).
  std::vector<EndpointMetrics> endpoint_metrics();
  const std::string& engine_id() const { return engine_id_; }
  // Connections our listener has taken (INFO, HELLO, channels): tests check with it that
  // nothing dials the listener on the submit path.
  uint64_t listener_connections() const { return listener_connections_.load(); }

 private:
  // A connection to a peer's listener and the absolute deadline of the exchange on it.
  struct Exchange {
    net::Socket sock;
    bootstrap::Clock::time_point deadline;
  };
  Exchange open_exchange(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);
  std::shared_ptr<PeerDirectory> directory() const;
  // Hands the directory this engine's current info (after its regions changed).
  void publish();
  // Logs a refused handshake: one warning per second at most, the rest at debug level.
  void refused(const char* what, const std::string& why);
  // Throws kRemoteError when max_pending_accepts endpoints already wait; needs mu_.
  void check_accept_room() const;
  Transport* find_transport(const std::string& name) const;
  Transport* choose_transport(const EngineInfo& peer, const std::string& forced, const std::vector<std::string>& avoid = {});
  void handle_connection(net::Socket sock);
  void handle_hello(net::Socket& sock, const nlohmann::json& body);
  void handle_channel(net::Socket& sock, const nlohmann::json& body, bootstrap::Clock::time_point deadline);
  void watchdog();
  void release_owned(const RegionEntry& e);  // frees engine-allocated memory
  // Tells every transport about a region the registry just took, then publishes it (a peer
  // never sees a region some transport has not prepared). Undoes the add on failure.
  MemoryHandle announce(MemoryHandle h);
  // Unpublishes the region, removes it from the registry (waiting for its pins) and returns
  // once no transport lets a peer reach it.
  std::shared_ptr<RegionEntry> withdraw_region(uint64_t id);

  EngineConfig config_;
  std::string engine_id_;
  std::string host_id_;
  Registry registry_;
  std::vector<std::unique_ptr<Transport>> transports_;  // fastest first
  bootstrap::Listener listener_;
  mutable std::mutex dir_mu_;  // guards directory_ (swapped by use_directory)
  std::shared_ptr<PeerDirectory> directory_;
  std::atomic<uint64_t> listener_connections_{0};
  // Regions every transport has been told of, with what each returned for peers; info()
  // publishes only these.
  mutable std::mutex regions_mu_;
  std::unordered_map<uint64_t, std::map<std::string, nlohmann::json>> region_data_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  std::vector<std::shared_ptr<EndpointImpl>> endpoints_;
  struct Passive {
    std::shared_ptr<EndpointImpl> ep;
    std::chrono::steady_clock::time_point since;
  };
  std::unordered_map<uint64_t, Passive> passive_;  // token -> said hello, channels not all attached
  std::deque<std::shared_ptr<EndpointImpl>> accept_queue_;
  std::thread watchdog_;
  // Checks that the names our endpoints dialed still lead to their engines (engine_watch.cpp);
  // started only for a directory with a watch_period().
  void watch_names();
  std::thread name_watch_;
  bootstrap::LogLimiter refusal_log_;
};

}  // namespace sluice::detail
