#include "core/engine_info.hpp"

#include "sluice/error.hpp"
#include "sluice/version.hpp"

namespace sluice::detail {

using nlohmann::json;

json EngineInfo::to_json() const {
  json regs = json::array();
  for (const auto& r : regions) {
    json jr = {{"id", r.info.id},
               {"addr", r.info.addr},
               {"length", r.info.length},
               {"location", r.info.location.to_string()},
               {"name", r.info.name}};
    if (r.info.shareable) jr["memfd"] = r.memfd;
    if (r.lease_slot != 0xffffffffu) jr["lease"] = r.lease_slot;
    regs.push_back(std::move(jr));
  }
  json tr = json::object();
  for (const auto& [k, v] : transports) tr[k] = v;
  return {{"sluice", wire_version},
          {"engine_id", engine_id},
          {"host_id", host_id},
          {"pid", pid},
          {"listen", listen_address()},
          {"transports", tr},
          {"leases", {{"memfd", lease_memfd}, {"slots", lease_slots}}},
          {"regions", regs}};
}

namespace {
template <typename T>
T field(const json& j, const char* key, const char* where) {
  auto it = j.find(key);
  if (it == j.end())
    throw Error(ErrorCode::kProtocol, std::string(where) + ": missing field '" + key + "'");
  try {
    return it->get<T>();
  } catch (const std::exception&) {
    throw Error(ErrorCode::kProtocol, std::string(where) + ": field '" + key + "' has the wrong type");
  }
}
}  // namespace

EngineInfo EngineInfo::from_json(const json& j) {
  if (!j.is_object()) throw Error(ErrorCode::kProtocol, "engine info is not a JSON object");
  EngineInfo e;
  e.wire_version = field<int>(j, "sluice", "engine info");
  if (e.wire_version != kWireVersion)
    throw Error(ErrorCode::kProtocol, "engine info has wire version " + std::to_string(e.wire_version) +
                                          ", this build speaks " + std::to_string(kWireVersion));
  e.engine_id = field<std::string>(j, "engine_id", "engine info");
  e.host_id = field<std::string>(j, "host_id", "engine info");
  e.pid = field<int>(j, "pid", "engine info");
  try {
    auto [h, p] = split_host_port(field<std::string>(j, "listen", "engine info"));
    e.listen_host = h;
    e.listen_port = p;
  } catch (const Error& err) {
    if (err.code() == ErrorCode::kProtocol) throw;
    throw Error(ErrorCode::kProtocol, std::string("engine info: field 'listen': ") + err.what());
  }
  auto tr = field<json>(j, "transports", "engine info");
  if (!tr.is_object()) throw Error(ErrorCode::kProtocol, "engine info: 'transports' is not an object");
  for (auto it = tr.begin(); it != tr.end(); ++it) e.transports[it.key()] = it.value();
  if (j.contains("leases")) {
    auto l = field<json>(j, "leases", "engine info");
    e.lease_memfd = field<int>(l, "memfd", "leases");
    e.lease_slots = field<uint32_t>(l, "slots", "leases");
  }
  auto regs = field<json>(j, "regions", "engine info");
  if (!regs.is_array()) throw Error(ErrorCode::kProtocol, "engine info: 'regions' is not an array");
  for (const auto& jr : regs) {
    PeerRegion r;
    r.info.id = field<uint64_t>(jr, "id", "region");
    r.info.addr = field<uint64_t>(jr, "addr", "region");
    r.info.length = field<uint64_t>(jr, "length", "region");
    try {
      r.info.location = Location::parse(field<std::string>(jr, "location", "region"));
    } catch (const Error& err) {
      throw Error(ErrorCode::kProtocol, std::string("region: ") + err.what());
    }
    r.info.name = field<std::string>(jr, "name", "region");
    if (jr.contains("lease")) r.lease_slot = field<uint32_t>(jr, "lease", "region");
    if (jr.contains("memfd")) {
      r.memfd = field<int>(jr, "memfd", "region");
      r.info.shareable = true;
    }
    e.regions.push_back(std::move(r));
  }
  return e;
}

EngineInfo EngineInfo::parse(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(ErrorCode::kProtocol, "engine info is not valid JSON");
  return from_json(j);
}

const PeerRegion* EngineInfo::find_region(uint64_t id) const {
  for (const auto& r : regions)
    if (r.info.id == id) return &r;
  return nullptr;
}

std::pair<std::string, uint16_t> split_host_port(const std::string& text) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size())
    throw Error(ErrorCode::kInvalidArgument, "'" + text + "' is not host:port");
  std::string host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  unsigned long port = 0;
  try {
    size_t used = 0;
    port = std::stoul(text.substr(colon + 1), &used);
    if (used != text.size() - colon - 1) throw std::invalid_argument("trailing");
  } catch (const std::exception&) {
    throw Error(ErrorCode::kInvalidArgument, "'" + text + "' has no valid port");
  }
  if (port == 0 || port > 65535) throw Error(ErrorCode::kInvalidArgument, "'" + text + "': port out of range");
  return {host, static_cast<uint16_t>(port)};
}

}  // namespace sluice::detail
