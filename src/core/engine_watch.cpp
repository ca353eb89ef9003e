// Watching names (issue 19: "watchers notice a peer that re-registers with a new
// incarnation"). A peer that hangs, or whose host dies without closing its connections,
// leaves our endpoint waiting until op_timeout (30 s by default), the opaque hang users of
// other engines complain of. Its directory entry expires one TTL after its last heartbeat;
// once another engine holds the name, the old connection cannot be the one the caller
// meant. Dropping it then fails its pending operations with kPeerLost at once, and an
// endpoint that reconnects moves to the new engine on its next operation.
//
// Polling, one store read per distinct dialed name per period, on one thread per engine:
// simple and the same for etcd and Redis; its cost is in docs/cluster.md ("Watching names").
#include <map>
#include <string>
#include <vector>

#include "core/engine_impl.hpp"
#include "core/log.hpp"

namespace sluice::detail {

void EngineImpl::watch_names() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!closed_) {
    auto dir = directory();
    const auto period = dir->watch_period();
    if (period.count() <= 0) {  // use_directory() installed one that is not watched
      cv_.wait(lk, [&] { return closed_; });
      break;
    }
    cv_.wait_for(lk, period, [&] { return closed_; });
    if (closed_) break;
    // Endpoints we dialed by name that are still up, by name.
    std::map<std::string, std::vector<std::shared_ptr<EndpointImpl>>> by_name;
    for (const auto& ep : endpoints_) {
      if (!ep->connected()) continue;
      std::string ref = ep->peer_ref();
      if (!ref.empty() && ref.find(':') == std::string::npos) by_name[ref].push_back(ep);
    }
    lk.unlock();
    for (auto& [name, eps] : by_name) {
      {
        std::lock_guard<std::mutex> c(mu_);
        if (closed_) break;
      }
      // One request, bounded by the period: a store that does not answer is asked again
      // next time, and never holds the engine's close() for long.
      auto owner = dir->owner_of(name, PeerDirectory::Clock::now() + period);
      if (!owner) continue;  // absent or unknown: not a replacement
      for (auto& ep : eps) {
        const std::string was = ep->peer_engine_id();
        if (was == *owner) continue;
        Status why{ErrorCode::kPeerLost, "peer '" + name + "' is now engine " + *owner + ": the connection to engine " +
                                             was + " (replaced: it restarted, or hung and its entry expired) is dropped"};
        SLUICE_LOG(kWarn, why.message);
        ep->close(why);
      }
    }
    by_name.clear();
    lk.lock();
  }
}

}  // namespace sluice::detail
