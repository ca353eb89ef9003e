// What the two sides of an rdma channel tell each other about their queue pair and port, and
// the negotiation over it: link layer, GID family and RoCE version, LID, path MTU. Pure
// functions over the exchanged values (no verbs calls), so they are unit-tested without a NIC
// (tests/transport/rdma/negotiate_test.cpp), hostile inputs included. See docs/rdma.md.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace sluice::detail::rdma {

// enum ibv_mtu values (device.cpp checks they match <infiniband/verbs.h>); kept here so that
// this file needs no verbs header.
constexpr int kMtu256 = 1;
constexpr int kMtu4096 = 5;
inline int mtu_bytes(int mtu_enum) { return 128 << mtu_enum; }

using Gid = std::array<uint8_t, 16>;

// One side's port, as it describes it to the other with every channel's queue-pair address.
struct PortDesc {
  std::string dev;         // device name (mlx5_0, rxe0)
  int port = 1;
  bool ethernet = false;   // link layer: RoCE (Ethernet) or InfiniBand
  int gid_index = 0;
  Gid gid{};
  int roce_version = 0;    // 1 or 2 for a RoCE GID of known type; 0: InfiniBand or unknown
  uint16_t lid = 0;
  int mtu = 0;             // active MTU, enum ibv_mtu (1 = 256 .. 5 = 4096)
  std::string where() const { return dev + ":" + std::to_string(port); }
};

// What the peer needs to reach one of our queue pairs.
struct QpAddress {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  PortDesc port;
  // Whether the peer sent the port fields (dev, port, link, gid_index, roce): a peer built
  // before they existed sends only qpn/psn/gid/lid/mtu, and is checked on those alone.
  bool described = false;
  nlohmann::json to_json() const;
  // Every field checked (types, ranges, the GID's hex, the device name's characters): a
  // malformed or hostile address is kProtocol naming the field.
  static QpAddress from_json(const nlohmann::json& j);
};

// GID helpers. The text form is 32 hex digits (what the handshake carries).
std::string gid_hex(const Gid& g);
bool parse_gid_hex(const std::string& s, Gid* g);  // exactly 32 hex digits, nothing else
bool gid_zero(const Gid& g);
bool gid_ipv4_mapped(const Gid& g);                // ::ffff:a.b.c.d
std::string gid_readable(const Gid& g);            // "::ffff:10.0.0.1" / "fe80::..." for messages
// "RoCE v2" from sysfs gid_attrs/types/N -> 2; "IB/RoCE v1" / "RoCE v1" -> 1; else 0.
int roce_version_of(const std::string& sysfs_type);

struct Negotiated {
  int path_mtu = 0;     // enum ibv_mtu: min of both sides' active MTU
  std::string summary;  // one line for the log: both ports, GIDs, MTUs
};

// Both sides run this on the other's address (the passive side in attach(), the active side
// on the reply), so each refuses by its own rules and names both ports. min_mtu_bytes: the
// smallest path MTU this side accepts (rdma.min_mtu; 0 = any). Throws Error: kProtocol for a
// value no honest peer sends (an all-zero RoCE GID, a LID that is not unicast),
// kUnsupported for two honest ports that cannot talk (link layers, GID families or RoCE
// versions differ) or a path MTU below min_mtu_bytes.
Negotiated negotiate(const PortDesc& local, const QpAddress& remote, int min_mtu_bytes);

// The transport retry count a queue pair on a device of this vendor gets for rdma.retry_cnt
// `configured`. SoftRoCE (rxe, vendor id 0xffffff) treats 7 like an RNR retry count of 7:
// it never decrements it (rxe_comp.c), so a queue pair whose retransmissions the peer never
// answers retries every timer tick forever and the endpoint learns only at op_timeout
// (measured in the two-guest wire test under 1% loss: PSNs still for 30 s, the retry counter
// climbing every 67 ms). 6 fails it after six ticks, and failover replaces the channel.
constexpr uint32_t kSoftRoceVendorId = 0xffffff;
inline int effective_retry_cnt(int configured, uint32_t vendor_id) {
  return vendor_id == kSoftRoceVendorId && configured > 6 ? 6 : configured;
}

}  // namespace sluice::detail::rdma
