// The Redis directory: engines publish under <prefix>/<name> with SET NX PX (a name has one
// owner) and refresh the TTL from the heartbeat; updates, refreshes and deletes run as small
// Lua scripts that act only while the key still holds this engine's own value, so an engine
// never overwrites or deletes an entry another engine took after ours expired. Through
// hiredis; built only when it is found (SLUICE_HAVE_REDIS).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "directory/store_directory.hpp"

namespace sluice::detail {

struct RedisServer {
  std::string host;
  uint16_t port = 6379;
  int db = 0;
  std::string password;
  std::chrono::milliseconds ttl{10000};
};

std::unique_ptr<StoreBackend> make_redis_backend(RedisServer server);

}  // namespace sluice::detail
