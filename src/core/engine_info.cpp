#include "core/engine_info.hpp"

#include <climits>
#include <string_view>

#include "bootstrap/messages.hpp"
#include "sluice/error.hpp"
#include "sluice/version.hpp"

namespace sluice::detail {

using nlohmann::json;

json region_to_json(const PeerRegion& r) {
  json jr = {{"id", r.info.id},
             {"addr", r.info.addr},
             {"length", r.info.length},
             {"location", r.info.location.to_string()},
             {"name", r.info.name}};
  if (r.info.shareable) jr["shareable"] = true;
  if (!r.transport_data.empty()) {
    json td = json::object();
    for (const auto& [k, v] : r.transport_data) td[k] = v;
    jr["transports"] = std::move(td);
  }
  return jr;
}

json EngineInfo::to_json() const {
  json regs = json::array();
  for (const auto& r : regions) regs.push_back(region_to_json(r));
  json tr = json::object();
  for (const auto& [k, v] : transports) tr[k] = v;
  json j = {{"sluice", wire_version},
            {"engine_id", engine_id},
            {"host_id", host_id},
            {"listen", listen_address()},
            {"transports", tr},
            {"regions", regs}};
  if (!name.empty()) j["name"] = name;
  return j;
}

namespace {

using bootstrap::require_array;
using bootstrap::require_int;
using bootstrap::require_object;
using bootstrap::require_string;
using bootstrap::require_u64;

// Device numbers a peer may name; CUDA hosts have far fewer, and an unbounded number would
// only reach code that indexes per-device tables.
constexpr int kMaxDevice = 1024;
// A peer's transport table names a handful of transports.
constexpr size_t kMaxTransports = 32;

// Strictly "host", "cpu" or "cuda:N" (0 <= N < kMaxDevice, digits only).
Location parse_location(const json& jr) {
  std::string text = require_string(jr, "location", "region", 64);
  if (text == "host" || text == "cpu") return Location::host();
  std::string_view rest(text);
  if (rest.substr(0, 5) == "cuda:" && rest.size() > 5 && rest.size() <= 9 &&
      rest.substr(5).find_first_not_of("0123456789") == std::string_view::npos) {
    int dev = std::stoi(std::string(rest.substr(5)));
    if (dev < kMaxDevice) return Location::cuda(dev);
  }
  throw Error(ErrorCode::kProtocol, "region: field 'location' must be \"host\", \"cpu\" or \"cuda:N\" with 0 <= N < " +
                                        std::to_string(kMaxDevice) + ", got \"" + text + "\"");
}

}  // namespace

PeerRegion region_from_json(const json& jr) {
  if (!jr.is_object()) throw Error(ErrorCode::kProtocol, "engine info: a 'regions' entry is not an object");
  PeerRegion r;
  r.info.id = require_u64(jr, "id", "region");
  r.info.addr = require_u64(jr, "addr", "region");
  r.info.length = require_u64(jr, "length", "region", UINT64_MAX - r.info.addr);  // addr + length must not wrap
  r.info.location = parse_location(jr);
  r.info.name = require_string(jr, "name", "region");
  if (jr.contains("shareable")) {
    if (!jr["shareable"].is_boolean()) throw Error(ErrorCode::kProtocol, "region: field 'shareable' must be a boolean");
    r.info.shareable = jr["shareable"].get<bool>();
  }
  if (jr.contains("transports")) {
    const json& td = require_object(jr, "transports", "region");
    if (td.size() > kMaxTransports)
      throw Error(ErrorCode::kProtocol, "region: field 'transports' names more than " + std::to_string(kMaxTransports) +
                                            " transports");
    for (auto it = td.begin(); it != td.end(); ++it) {
      if (it.key().size() > 64) throw Error(ErrorCode::kProtocol, "region: a transport name is longer than 64 bytes");
      r.transport_data[it.key()] = it.value();
    }
  }
  return r;
}

EngineInfo EngineInfo::from_json(const json& j) {
  if (!j.is_object()) throw Error(ErrorCode::kProtocol, "engine info is not a JSON object");
  const char* where = "engine info";
  EngineInfo e;
  e.wire_version = static_cast<int>(require_int(j, "sluice", where, 0, INT32_MAX));
  if (e.wire_version != kWireVersion)
    throw Error(ErrorCode::kProtocol, "engine info has wire version " + std::to_string(e.wire_version) +
                                          ", this build speaks " + std::to_string(kWireVersion));
  e.engine_id = require_string(j, "engine_id", where, 256);
  if (j.contains("name")) e.name = require_string(j, "name", where, 128);
  e.host_id = require_string(j, "host_id", where);
  std::string listen = require_string(j, "listen", where, 512);
  try {
    auto [h, p] = split_host_port(listen);
    e.listen_host = h;
    e.listen_port = p;
  } catch (const Error& err) {
    throw Error(ErrorCode::kProtocol, std::string("engine info: field 'listen': ") + err.what());
  }
  const json& tr = require_object(j, "transports", where);
  if (tr.size() > kMaxTransports)
    throw Error(ErrorCode::kProtocol, "engine info: field 'transports' lists " + std::to_string(tr.size()) +
                                          " transports, at most " + std::to_string(kMaxTransports) + " expected");
  for (auto it = tr.begin(); it != tr.end(); ++it) {
    if (it.key().size() > 64) throw Error(ErrorCode::kProtocol, "engine info: a transport name is longer than 64 bytes");
    e.transports[it.key()] = it.value();
  }
  for (const auto& jr : require_array(j, "regions", where)) e.regions.push_back(region_from_json(jr));
  return e;
}

EngineInfo EngineInfo::parse(const std::string& text) {
  bootstrap::check_json_depth(text, "engine info");
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
