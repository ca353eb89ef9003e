#include "transport/rdma/negotiate.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>

#include "sluice/error.hpp"

namespace sluice::detail::rdma {

using nlohmann::json;

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw Error(ErrorCode::kProtocol, "rdma: malformed queue pair address from the peer: " + what);
}

// An unsigned integer field no larger than max (JSON numbers of any other kind, negative or
// fractional, are refused rather than converted).
uint64_t uint_field(const json& j, const char* name, uint64_t max) {
  auto it = j.find(name);
  if (it == j.end()) bad(std::string("field '") + name + "' missing");
  if (!it->is_number_unsigned() && !(it->is_number_integer() && it->get<int64_t>() >= 0))
    bad(std::string("field '") + name + "' is not an unsigned integer");
  uint64_t v = it->get<uint64_t>();
  if (v > max) bad(std::string("field '") + name + "' is " + std::to_string(v) + ", more than " + std::to_string(max));
  return v;
}

// Device names are echoed in error messages and logs: only what kernel device names use.
bool plain_name(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
  });
}

// "GID index 1 ::ffff:10.0.0.1 (IPv4, RoCE v2)"; without the index for a peer that did not
// describe its port.
std::string describe_gid(const PortDesc& p, bool described = true) {
  std::string s = (described ? "GID index " + std::to_string(p.gid_index) + " " : "GID ") + gid_readable(p.gid) + " (" +
                  (gid_ipv4_mapped(p.gid) ? "IPv4" : "IPv6");
  if (described && p.roce_version) s += ", RoCE v" + std::to_string(p.roce_version);
  return s + ")";
}

const char* link_name(bool ethernet) { return ethernet ? "RoCE (Ethernet)" : "InfiniBand"; }

}  // namespace

json QpAddress::to_json() const {
  json j = {{"qpn", qpn}, {"psn", psn}, {"gid", gid_hex(port.gid)}, {"lid", port.lid}, {"mtu", port.mtu}};
  j["dev"] = port.dev;
  j["port"] = port.port;
  j["link"] = port.ethernet ? "eth" : "ib";
  j["gid_index"] = port.gid_index;
  j["roce"] = port.roce_version;
  return j;
}

QpAddress QpAddress::from_json(const json& j) {
  if (!j.is_object()) bad("not an object");
  QpAddress a;
  // Queue pair numbers and PSNs are 24-bit on the wire.
  a.qpn = static_cast<uint32_t>(uint_field(j, "qpn", 0xffffff));
  a.psn = static_cast<uint32_t>(uint_field(j, "psn", 0xffffff));
  a.port.lid = static_cast<uint16_t>(uint_field(j, "lid", 0xffff));
  a.port.mtu = static_cast<int>(uint_field(j, "mtu", kMtu4096));
  if (a.port.mtu < kMtu256) bad("field 'mtu' is 0 (ibv_mtu values are 1 = 256 .. 5 = 4096)");
  auto g = j.find("gid");
  if (g == j.end() || !g->is_string()) bad("field 'gid' missing or not a string");
  if (!parse_gid_hex(g->get_ref<const std::string&>(), &a.port.gid)) bad("field 'gid' is not 32 hex digits");
  // The port description: all of it or none of it (a peer that predates it).
  a.described = j.contains("dev");
  if (!a.described) return a;
  auto d = j.find("dev");
  if (!d->is_string() || !plain_name(d->get_ref<const std::string&>()))
    bad("field 'dev' is not a device name (1-64 letters, digits, '_', '-', '.')");
  a.port.dev = d->get<std::string>();
  a.port.port = static_cast<int>(uint_field(j, "port", 255));
  if (a.port.port < 1) bad("field 'port' is 0 (ports count from 1)");
  auto l = j.find("link");
  if (l == j.end() || !l->is_string() || (*l != "eth" && *l != "ib")) bad("field 'link' is not \"eth\" or \"ib\"");
  a.port.ethernet = *l == "eth";
  a.port.gid_index = static_cast<int>(uint_field(j, "gid_index", 0xffff));
  a.port.roce_version = static_cast<int>(uint_field(j, "roce", 2));
  return a;
}

std::string gid_hex(const Gid& g) {
  char buf[33];
  for (int i = 0; i < 16; ++i) std::snprintf(buf + 2 * i, 3, "%02x", g[i]);
  return buf;
}

bool parse_gid_hex(const std::string& s, Gid* g) {
  // Strict: sscanf("%2x") would take " f", "+f" or "-1".
  if (s.size() != 32) return false;
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Gid out{};
  for (int i = 0; i < 16; ++i) {
    int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  *g = out;
  return true;
}

bool gid_zero(const Gid& g) {
  return std::all_of(g.begin(), g.end(), [](uint8_t b) { return b == 0; });
}

bool gid_ipv4_mapped(const Gid& g) {
  for (int i = 0; i < 10; ++i)
    if (g[i] != 0) return false;
  return g[10] == 0xff && g[11] == 0xff;
}

std::string gid_readable(const Gid& g) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (!::inet_ntop(AF_INET6, g.data(), buf, sizeof buf)) return gid_hex(g);
  return buf;
}

int roce_version_of(const std::string& t) {
  if (t.find("RoCE v2") != std::string::npos) return 2;
  if (t.find("RoCE v1") != std::string::npos) return 1;  // also "IB/RoCE v1"
  return 0;
}

Negotiated negotiate(const PortDesc& local, const QpAddress& remote, int min_mtu_bytes) {
  const PortDesc& r = remote.port;
  const std::string ours = "ours " + local.where(), theirs = "the peer's " + (remote.described ? r.where() : "port");
  if (remote.described && r.ethernet != local.ethernet)
    throw Error(ErrorCode::kUnsupported, "rdma: link layers differ: " + ours + " is " + link_name(local.ethernet) + ", " +
                                             theirs + " is " + link_name(r.ethernet));
  if (local.ethernet) {
    // RoCE routes by GID: both must be addresses of one family and one RoCE version (a v1
    // packet is an Ethernet frame, a v2 packet UDP/IP; an IPv4-mapped GID is sent as IPv4).
    if (gid_zero(r.gid))
      throw Error(ErrorCode::kProtocol, "rdma: " + theirs + " sent an all-zero GID" +
                                            (remote.described ? " (index " + std::to_string(r.gid_index) + ")" : "") +
                                            ": not a usable RoCE address");
    if (gid_ipv4_mapped(local.gid) != gid_ipv4_mapped(r.gid))
      throw Error(ErrorCode::kUnsupported, "rdma: GID families differ: " + ours + " uses " + describe_gid(local) + ", " +
                                               theirs + " uses " + describe_gid(r, remote.described) +
                                               "; choose GIDs of one family (rdma.gid_index)");
    if (remote.described && local.roce_version && r.roce_version && local.roce_version != r.roce_version)
      throw Error(ErrorCode::kUnsupported, "rdma: RoCE versions differ: " + ours + " uses " + describe_gid(local) + ", " +
                                               theirs + " uses " + describe_gid(r) + "; choose GIDs of one type (rdma.gid_index)");
  } else if (r.lid == 0 || r.lid >= 0xc000) {
    // InfiniBand routes by LID: 0 is unassigned, 0xc000 and up are multicast / permissive.
    throw Error(ErrorCode::kProtocol, "rdma: " + theirs + " sent LID " + std::to_string(r.lid) + ", not a unicast LID");
  }
  Negotiated n;
  n.path_mtu = std::min(local.mtu, r.mtu);
  if (min_mtu_bytes > 0 && mtu_bytes(n.path_mtu) < min_mtu_bytes)
    throw Error(ErrorCode::kUnsupported, "rdma: path MTU " + std::to_string(mtu_bytes(n.path_mtu)) +
                                             " is below rdma.min_mtu " + std::to_string(min_mtu_bytes) + ": " + ours +
                                             " has active_mtu " + std::to_string(mtu_bytes(local.mtu)) + ", " + theirs +
                                             " " + std::to_string(mtu_bytes(r.mtu)));
  n.summary = "path MTU " + std::to_string(mtu_bytes(n.path_mtu)) + " (" + ours + " active " +
              std::to_string(mtu_bytes(local.mtu)) + ", " + theirs + " " + std::to_string(mtu_bytes(r.mtu)) + "), " +
              (local.ethernet ? describe_gid(local) + " to " + describe_gid(r, remote.described)
                              : "LID " + std::to_string(local.lid) + " to " + std::to_string(r.lid));
  return n;
}

}  // namespace sluice::detail::rdma
