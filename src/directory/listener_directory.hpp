// The default directory: a peer is named by its listener's "host:port" and asked for its
// info there (an INFO exchange); publishing is the engine's own listener answering.
#pragma once

#include "directory/peer_directory.hpp"

namespace sluice::detail {

class ListenerDirectory final : public PeerDirectory {
 public:
  void publish(const EngineInfo&) override {}
  // `ref` is "host:port". The info returned names that address as the peer's listener,
  // whatever its reply claims: a hostile peer could otherwise name a third party, and we
  // would send it our hello (our full info).
  EngineInfo lookup(const std::string& ref, Clock::time_point deadline) override;
  std::string ref_for(const EngineInfo& peer) const override { return peer.listen_address(); }
  bool wants_updates() const override { return false; }
};

}  // namespace sluice::detail
