// The endpoints of one same-host transport (shm, nvlink), found by token, and the requests on
// its Unix socket (same_host.hpp): "probe", "auth" (a peer proves itself for the passive
// endpoint it said hello for) and "describe" (the proven peer asks about one of our regions).
// Both transports answer them the same way; only what an endpoint does with a proof and how it
// describes a region differ.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "transport/common/same_host.hpp"

namespace sluice::detail::same_host {

class ProvenEndpoint {
 public:
  virtual ~ProvenEndpoint() = default;
  // Passive side: the process `cred` proved itself for this endpoint on our socket, passing its
  // lease table (`lease_fd`, to close) and naming its engine (`engine`). May take `sock` as the
  // endpoint's control channel. Throws Error to refuse.
  virtual void authenticate(net::Socket& sock, const PeerCred& cred, int lease_fd, const std::string& engine) = 0;
  // Answers the proven peer's question about our region `id` (*fd_out: a descriptor to pass
  // with the answer, or -1). Throws Error to refuse.
  virtual nlohmann::json describe_local(uint64_t id, const PeerCred& cred, int* fd_out) const = 0;
};

class Endpoints {
 public:
  ~Endpoints() { stop(); }
  // Starts the transport's socket; `probe` returns the fields of a probe's answer beside
  // "engine" (shm: the word a peer reads to check cross-process access).
  void start(const std::string& prefix, const std::string& engine_id, std::function<nlohmann::json()> probe);
  void stop() { service_.stop(); }
  const std::string& name() const { return service_.name(); }

  void add(uint64_t token, bool active, const std::shared_ptr<ProvenEndpoint>& ep);
  // Drops entries of endpoints that no longer exist.
  void forget();

 private:
  std::shared_ptr<ProvenEndpoint> find(uint64_t token, bool passive);
  void serve(net::Socket& sock, const PeerCred& cred, const nlohmann::json& req, int fd);
  void handle(net::Socket& sock, const PeerCred& cred, const nlohmann::json& req, int& fd);

  std::string engine_id_;
  std::function<nlohmann::json()> probe_;
  std::mutex mu_;
  std::unordered_map<uint64_t, std::weak_ptr<ProvenEndpoint>> active_, passive_;
  Service service_;  // last: stopped (in ~Endpoints) before the maps go
};

}  // namespace sluice::detail::same_host
