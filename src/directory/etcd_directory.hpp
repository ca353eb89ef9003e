// The etcd directory: engines publish under <prefix>/<name> in etcd v3, through its JSON
// gateway (/v3/lease/grant, /v3/kv/txn, /v3/kv/range, /v3/lease/keepalive, /v3/lease/revoke;
// keys and values base64) with libcurl. Each engine's entry is attached to its own lease, kept
// alive by the heartbeat, so a crashed engine's entry disappears when the lease's TTL runs out.
// Built only when libcurl is found (SLUICE_HAVE_ETCD).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "directory/store_directory.hpp"

namespace sluice::detail {

struct EtcdEndpoints {
  std::vector<std::pair<std::string, uint16_t>> hosts;  // tried in order; the last good one first
  std::chrono::milliseconds ttl{10000};                  // the lease's TTL (etcd rounds up to seconds)
  // Connecting to one endpoint: a dead one is given up after this, and the next tried.
  std::chrono::milliseconds connect_timeout{2000};
};

// The store operations over etcd; StoreDirectory does the rest.
std::unique_ptr<StoreBackend> make_etcd_backend(EtcdEndpoints endpoints);

}  // namespace sluice::detail
