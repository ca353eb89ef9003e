// Which directory an engine uses, chosen by URL (EngineConfig::directory, SLUICE_DIRECTORY):
//   ""                                  the listener directory: a peer is named by "host:port"
//   etcd://h1:2379,h2:2379[/prefix]     etcd v3 (JSON gateway), endpoints tried in order
//   redis://[:password@]host:6379[/db][?prefix=p]
// docs/cluster.md describes the layout in the stores.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "directory/peer_directory.hpp"
#include "sluice/config.hpp"

namespace sluice::detail {

struct DirectoryUrl {
  enum class Kind { kListener, kEtcd, kRedis };
  Kind kind = Kind::kListener;
  std::vector<std::pair<std::string, uint16_t>> endpoints;  // etcd: one or more; redis: one
  std::string prefix = "sluice";  // keys are <prefix>/<name>; no leading or trailing '/'
  int db = 0;                     // redis
  std::string password;           // redis (AUTH); never printed
  std::string display;            // the URL without its password, for messages
};

// Throws Error(kInvalidArgument) naming what does not parse.
DirectoryUrl parse_directory_url(const std::string& url);

// Engine names in a store: 1..128 of [A-Za-z0-9._:-] (no '/', so one name is one key).
// Throws Error(kInvalidArgument) naming `where`.
void check_engine_name(const std::string& where, const std::string& name);

class StoreBackend;
// The store operations alone for an etcd or Redis URL (no heartbeat, no record): what
// make_directory wraps, and what tools use to read the store as it is (get() answers
// "absent" at once, where a lookup waits for the name). kUnsupported as make_directory.
std::unique_ptr<StoreBackend> make_store_backend(const DirectoryUrl& url, std::chrono::milliseconds ttl,
                                                 std::chrono::milliseconds request_timeout = std::chrono::milliseconds(2000));

// The directory `config.directory` names, with the directory.* options of `config`. Throws
// kInvalidArgument for a bad URL, kUnsupported for a backend this build does not have.
std::shared_ptr<PeerDirectory> make_directory(const EngineConfig& config);

}  // namespace sluice::detail
