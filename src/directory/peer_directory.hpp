// How an engine makes itself findable and finds its peers. The engine publishes its info
// here and looks peers up here (connect by name, refresh_remote_regions); transports never
// see it, so a discovery store (etcd, Redis, a torch Store) plugs in without touching them.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "core/engine_info.hpp"

namespace sluice::detail {

class PeerDirectory {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~PeerDirectory() = default;

  // Make `self` findable (the engine calls this when it starts and whenever its info changes:
  // a region registered or unregistered).
  virtual void publish(const EngineInfo& self) = 0;
  // The engine is closing: stop handing its info out.
  virtual void withdraw(const std::string& engine_id) {}
  // The current info of the peer that `ref` names. Its listen address is where the engine
  // sends its hello and channels. Throws Error: kTimeout when `deadline` passes first,
  // kInvalidArgument for a ref this directory cannot read.
  virtual EngineInfo lookup(const std::string& ref, Clock::time_point deadline) = 0;
  // The ref under which lookup() finds `peer` again (refresh of an endpoint the peer opened,
  // or one opened from an info blob).
  virtual std::string ref_for(const EngineInfo& peer) const { return peer.engine_id; }
  // False when the directory reads the engine live (the listener answers INFO from the
  // engine itself), so publish() on every change would only cost time.
  virtual bool wants_updates() const { return true; }

  // Watching (EngineImpl::watch_names): every watch_period() the engine asks owner_of() for
  // each name its endpoints dialed, and drops an endpoint whose name now leads to another
  // engine (its peer was replaced: a hung one whose entry expired, a restart the connection
  // did not show). 0 = this directory is not watched.
  virtual std::chrono::milliseconds watch_period() const { return {}; }
  // The engine id that `ref` leads to now, in one request bounded by `deadline`; nullopt
  // when it is not a name, is absent, or the directory did not answer (none means "replaced").
  virtual std::optional<std::string> owner_of(const std::string& ref, Clock::time_point deadline) {
    return std::nullopt;
  }
};

}  // namespace sluice::detail
