// The serialisable description of an engine (the "info blob" of Engine::local_info()).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sluice/types.hpp"

namespace sluice::detail {

struct PeerRegion {
  RegionInfo info;
  int memfd = -1;  // the owner's descriptor number for shareable memory
  uint32_t lease_slot = 0xffffffffu;  // its slot in the owner's lease table
  // Per transport, what Transport::region_added() returned for it (rdma: rkeys by rail).
  std::map<std::string, nlohmann::json> transport_data;
};

struct EngineInfo {
  int wire_version = 0;
  std::string engine_id;
  std::string host_id;
  int pid = 0;
  std::string listen_host;
  uint16_t listen_port = 0;
  std::map<std::string, nlohmann::json> transports;  // name -> transport-specific address
  int lease_memfd = -1;  // the owner's lease table (see core/lease_table.hpp)
  uint32_t lease_slots = 0;
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
