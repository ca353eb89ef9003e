// The serialisable description of an engine (the "info blob" of Engine::local_info()).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sluice/types.hpp"

namespace sluice::detail {

// Same-host details (a region's memfd, its lease slot, the owner's pid and lease table) are
// not here: same-host transports get them from the owner over its proven socket.
struct PeerRegion {
  RegionInfo info;
  // Per transport, what Transport::region_added() returned for it (rdma: rkeys by rail).
  std::map<std::string, nlohmann::json> transport_data;
};

// One region as the info blob carries it (and Engine::region_descriptor hands it out);
// region_from_json checks every field as strictly as the blob's parser (kProtocol).
nlohmann::json region_to_json(const PeerRegion& r);
PeerRegion region_from_json(const nlohmann::json& jr);

struct EngineInfo {
  int wire_version = 0;
  std::string engine_id;
  std::string name;  // the engine's directory name; empty = none (optional on the wire)
  std::string host_id;
  std::string listen_host;
  uint16_t listen_port = 0;
  std::map<std::string, nlohmann::json> transports;  // name -> transport-specific address
  std::vector<PeerRegion> regions;

  std::string listen_address() const { return listen_host + ":" + std::to_string(listen_port); }
  nlohmann::json to_json() const;
  std::string dump() const { return to_json().dump(); }
  // Throws Error(kProtocol) naming the first missing or mistyped field.
  static EngineInfo from_json(const nlohmann::json& j);
  static EngineInfo parse(const std::string& text);
  const PeerRegion* find_region(uint64_t id) const;
};

// "host:port" -> pair; throws Error(kInvalidArgument).
std::pair<std::string, uint16_t> split_host_port(const std::string& text);

}  // namespace sluice::detail
