// The rdma handshake's negotiation (src/transport/rdma/negotiate.hpp) without a NIC: the
// queue-pair address as the peer sends it (JSON), every malformed or hostile form of it, and
// the decisions over two ports (link layer, GID family, RoCE version, LID, path MTU).
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sluice/error.hpp"
#include "transport/rdma/negotiate.hpp"

using nlohmann::json;
using namespace sluice;
using namespace sluice::detail::rdma;

namespace {

Gid gid_of(const std::string& hex) {
  Gid g{};
  EXPECT_TRUE(parse_gid_hex(hex, &g)) << hex;
  return g;
}

const std::string kV4a = "00000000000000000000ffff0a000001";  // ::ffff:10.0.0.1
const std::string kV4b = "00000000000000000000ffff0a000002";  // ::ffff:10.0.0.2
const std::string kV6 = "fe800000000000005054fffe123456ff";   // fe80::5054:fffe:1234:56ff

PortDesc roce(const std::string& dev, const std::string& gid, int mtu = 3, int version = 2, int index = 1) {
  PortDesc p;
  p.dev = dev;
  p.port = 1;
  p.ethernet = true;
  p.gid_index = index;
  p.gid = gid_of(gid);
  p.roce_version = version;
  p.mtu = mtu;
  return p;
}

PortDesc ib(const std::string& dev, uint16_t lid, int mtu = 5) {
  PortDesc p;
  p.dev = dev;
  p.port = 1;
  p.lid = lid;
  p.mtu = mtu;
  return p;
}

QpAddress addr(const PortDesc& p) {
  QpAddress a;
  a.qpn = 0x1234;
  a.psn = 0xabcdef;
  a.port = p;
  a.described = true;
  return a;
}

// The error negotiate() throws, for EXPECTs on its code and text.
Error refusal(const PortDesc& local, const QpAddress& remote, int min_mtu = 0) {
  try {
    negotiate(local, remote, min_mtu);
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "negotiate accepted " << remote.to_json().dump();
  return Error(ErrorCode::kOk, "");
}

bool has(const Error& e, const std::string& s) { return std::string(e.what()).find(s) != std::string::npos; }

TEST(RdmaQpAddress, RoundTripsEveryField) {
  QpAddress a = addr(roce("mlx5_0", kV4a, 4, 2, 3));
  a.port.port = 2;
  a.port.lid = 7;
  QpAddress b = QpAddress::from_json(json::parse(a.to_json().dump()));
  EXPECT_EQ(b.qpn, a.qpn);
  EXPECT_EQ(b.psn, a.psn);
  EXPECT_TRUE(b.described);
  EXPECT_EQ(b.port.dev, "mlx5_0");
  EXPECT_EQ(b.port.port, 2);
  EXPECT_TRUE(b.port.ethernet);
  EXPECT_EQ(b.port.gid_index, 3);
  EXPECT_EQ(b.port.gid, a.port.gid);
  EXPECT_EQ(b.port.roce_version, 2);
  EXPECT_EQ(b.port.lid, 7);
  EXPECT_EQ(b.port.mtu, 4);
}

TEST(RdmaQpAddress, APeerWithoutThePortFieldsIsCheckedOnWhatItSends) {
  // What a peer built before the port description sends.
  json old = {{"qpn", 5}, {"psn", 6}, {"gid", kV4b}, {"lid", 0}, {"mtu", 3}};
  QpAddress a = QpAddress::from_json(old);
  EXPECT_FALSE(a.described);
  EXPECT_EQ(negotiate(roce("rxe0", kV4a, 5), a, 0).path_mtu, 3);
  // ... and still refused where what it sends cannot work.
  EXPECT_EQ(refusal(roce("rxe0", kV4a), QpAddress::from_json({{"qpn", 5}, {"psn", 6}, {"gid", kV6}, {"lid", 0}, {"mtu", 3}}))
                .code(),
            ErrorCode::kUnsupported);
}

TEST(RdmaQpAddress, MalformedAndHostileAddressesAreProtocolErrorsNamingTheField) {
  const json good = addr(roce("rxe0", kV4a)).to_json();
  struct Case {
    std::string field;
    json value;  // null with erase = true: the field is left out
    bool erase = false;
  };
  const std::vector<Case> cases = {
      {"qpn", -1},         {"qpn", 1.5},          {"qpn", "12"},        {"qpn", 1u << 24},  {"qpn", true},
      {"qpn", nullptr, true},
      {"psn", UINT64_MAX}, {"psn", -5},           {"psn", nullptr, true},
      {"lid", 65536},      {"lid", json::array()},
      {"mtu", 0},          {"mtu", 6},            {"mtu", -1},          {"mtu", 1e9},       {"mtu", nullptr, true},
      {"gid", kV4a.substr(1)},                    {"gid", kV4a + "0"},  {"gid", " f" + kV4a.substr(2)},
      {"gid", "+f" + kV4a.substr(2)},             {"gid", "zz" + kV4a.substr(2)},           {"gid", 12},
      {"gid", nullptr, true},
      {"dev", ""},         {"dev", "rxe0\n[warn] forged log line"},                         {"dev", "\x1b[2Jrxe0"},
      {"dev", std::string(65, 'm')},              {"dev", 7},           {"dev", "mlx5 0"},  {"dev", "../x"},
      {"port", 0},         {"port", 256},         {"port", "1"},        {"port", nullptr, true},
      {"link", "roce"},    {"link", 1},           {"link", nullptr, true},
      {"gid_index", 65536}, {"gid_index", -1},    {"gid_index", nullptr, true},
      {"roce", 3},         {"roce", -2},          {"roce", nullptr, true},
  };
  for (const auto& c : cases) {
    json j = good;
    if (c.erase) j.erase(c.field);
    else j[c.field] = c.value;
    SCOPED_TRACE(j.dump());
    try {
      QpAddress::from_json(j);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kProtocol) << e.what();
      EXPECT_TRUE(has(e, c.field)) << e.what();
    }
  }
  for (const json& j : {json(nullptr), json::array({1, 2}), json("qpn"), json(5), json::object()}) {
    SCOPED_TRACE(j.dump());
    EXPECT_THROW(QpAddress::from_json(j), Error);
  }
}

TEST(RdmaQpAddress, RandomMutationsNeverEscapeAsAnythingButProtocolErrors) {
  // Whatever a peer sends: either an address whose every value is in range, or kProtocol.
  const json good = addr(roce("rxe0", kV4a)).to_json();
  const std::vector<json> values = {nullptr, true, -1, 0, 1, 2, 5, 6, 255, 256, 65535, 65536, 1u << 24, UINT64_MAX,
                                    INT64_MIN, 0.5, -0.0, 1e300, "", "eth", "ib", kV4a, kV6, std::string(1000, 'a'),
                                    json::array(), json::object()};
  std::vector<std::string> keys;
  for (auto& [k, v] : good.items()) keys.push_back(k);
  keys.push_back("extra");
  std::mt19937 rng(19);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    json j = good;
    for (int m = 1 + rng() % 3; m > 0; --m) {
      const std::string& k = keys[rng() % keys.size()];
      if (rng() % 5 == 0) j.erase(k);
      else j[k] = values[rng() % values.size()];
    }
    try {
      QpAddress a = QpAddress::from_json(j);
      ++accepted;
      ASSERT_LE(a.qpn, 0xffffffu);
      ASSERT_LE(a.psn, 0xffffffu);
      ASSERT_GE(a.port.mtu, kMtu256);
      ASSERT_LE(a.port.mtu, kMtu4096);
      if (a.described) {
        ASSERT_GE(a.port.port, 1);
        ASSERT_LE(a.port.port, 255);
        ASSERT_LE(a.port.gid_index, 0xffff);
        ASSERT_LE(a.port.roce_version, 2);
        ASSERT_FALSE(a.port.dev.empty());
      }
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), ErrorCode::kProtocol) << j.dump() << ": " << e.what();
    }
  }
  EXPECT_GT(accepted, 0);  // the mutations also produce valid addresses (the check above ran)
}

TEST(RdmaNegotiate, PathMtuIsTheSmallerSideAndTheSameBothWays) {
  PortDesc a = roce("rxe0", kV4a, 5), b = roce("rxe1", kV4b, 3);
  EXPECT_EQ(negotiate(a, addr(b), 0).path_mtu, 3);
  EXPECT_EQ(negotiate(b, addr(a), 0).path_mtu, 3);
  Negotiated n = negotiate(a, addr(b), 1024);  // a minimum met exactly
  EXPECT_EQ(n.path_mtu, 3);
  EXPECT_NE(n.summary.find("path MTU 1024"), std::string::npos) << n.summary;
  EXPECT_NE(n.summary.find("rxe0:1"), std::string::npos) << n.summary;
  EXPECT_NE(n.summary.find("rxe1:1"), std::string::npos) << n.summary;
}

TEST(RdmaNegotiate, APathMtuBelowTheMinimumIsRefusedNamingBothPorts) {
  PortDesc a = roce("mlx5_0", kV4a, 5), b = roce("mlx5_3", kV4b, 3);
  for (const Error& e : {refusal(a, addr(b), 2048), refusal(b, addr(a), 4096)}) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_TRUE(has(e, "rdma.min_mtu")) << e.what();
    EXPECT_TRUE(has(e, "path MTU 1024")) << e.what();
    EXPECT_TRUE(has(e, "mlx5_0:1") && has(e, "mlx5_3:1")) << e.what();
    EXPECT_TRUE(has(e, "4096")) << e.what();  // mlx5_0's active MTU
  }
}

TEST(RdmaNegotiate, LinkLayersThatDifferAreRefusedByName) {
  Error e = refusal(roce("rxe0", kV4a), addr(ib("mlx5_1", 3)));
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "link layers differ")) << e.what();
  EXPECT_TRUE(has(e, "rxe0:1 is RoCE") && has(e, "mlx5_1:1 is InfiniBand")) << e.what();
  e = refusal(ib("mlx5_1", 3), addr(roce("rxe0", kV4a)));
  EXPECT_TRUE(has(e, "mlx5_1:1 is InfiniBand") && has(e, "rxe0:1 is RoCE")) << e.what();
}

TEST(RdmaNegotiate, GidFamiliesThatDifferAreRefusedNamingIndexAndAddress) {
  Error e = refusal(roce("rxe0", kV4a, 3, 2, 1), addr(roce("rxe0", kV6, 3, 2, 0)));
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "GID families differ")) << e.what();
  EXPECT_TRUE(has(e, "ours rxe0:1 uses GID index 1 ::ffff:10.0.0.1 (IPv4, RoCE v2)")) << e.what();
  EXPECT_TRUE(has(e, "the peer's rxe0:1 uses GID index 0 fe80::5054:fffe:1234:56ff (IPv6, RoCE v2)")) << e.what();
  EXPECT_TRUE(has(e, "rdma.gid_index")) << e.what();
  // Two IPv6 GIDs are one family.
  EXPECT_NO_THROW(negotiate(roce("rxe0", kV6), addr(roce("rxe1", kV6)), 0));
}

TEST(RdmaNegotiate, RoceVersionsThatDifferAreRefusedWhereBothAreKnown) {
  Error e = refusal(roce("mlx5_0", kV4a, 3, 2, 3), addr(roce("mlx5_2", kV4b, 3, 1, 2)));
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "RoCE versions differ")) << e.what();
  EXPECT_TRUE(has(e, "ours mlx5_0:1 uses GID index 3 ::ffff:10.0.0.1 (IPv4, RoCE v2)")) << e.what();
  EXPECT_TRUE(has(e, "the peer's mlx5_2:1 uses GID index 2 ::ffff:10.0.0.2 (IPv4, RoCE v1)")) << e.what();
  // A side whose sysfs names no type (0) is not refused on that ground.
  EXPECT_NO_THROW(negotiate(roce("mlx5_0", kV4a, 3, 2), addr(roce("mlx5_2", kV4b, 3, 0)), 0));
  EXPECT_NO_THROW(negotiate(roce("mlx5_0", kV4a, 3, 0), addr(roce("mlx5_2", kV4b, 3, 1)), 0));
}

TEST(RdmaNegotiate, UnusablePeerAddressesAreProtocolErrors) {
  // RoCE: an all-zero GID (an empty table entry) is no address.
  Error e = refusal(roce("rxe0", kV4a), addr(roce("rxe1", std::string(32, '0'), 3, 2, 9)));
  EXPECT_EQ(e.code(), ErrorCode::kProtocol);
  EXPECT_TRUE(has(e, "all-zero GID (index 9)") && has(e, "rxe1:1")) << e.what();
  // InfiniBand routes by LID: 0 (unassigned) and 0xc000+ (multicast, permissive) are refused.
  for (uint16_t lid : {0, 0xc000, 0xffff}) {
    e = refusal(ib("mlx5_0", 1), addr(ib("mlx5_1", lid)));
    EXPECT_EQ(e.code(), ErrorCode::kProtocol);
    EXPECT_TRUE(has(e, "LID " + std::to_string(lid))) << e.what();
  }
  // ... where a zero GID does not matter.
  PortDesc p = ib("mlx5_1", 0xbfff);
  EXPECT_EQ(negotiate(ib("mlx5_0", 1, 4), addr(p), 0).path_mtu, 4);
}

TEST(RdmaGid, HexIsStrictAndReadableFormsAreAddresses) {
  Gid g{};
  EXPECT_TRUE(parse_gid_hex("00000000000000000000FFFF0A000001", &g));
  EXPECT_TRUE(gid_ipv4_mapped(g));
  EXPECT_EQ(gid_readable(g), "::ffff:10.0.0.1");
  EXPECT_EQ(gid_hex(g), kV4a);
  EXPECT_FALSE(gid_ipv4_mapped(gid_of(kV6)));
  EXPECT_TRUE(gid_zero(Gid{}));
  for (const std::string& s : std::vector<std::string>{"", "0", std::string(31, '0'), std::string(33, '0'), " 0" + std::string(30, '0'),
                              "-1" + std::string(30, '0'), "0x" + std::string(30, '0'), std::string(30, '0') + "g0"})
    EXPECT_FALSE(parse_gid_hex(s, &g)) << s;
  EXPECT_EQ(roce_version_of("RoCE v2"), 2);
  EXPECT_EQ(roce_version_of("IB/RoCE v1"), 1);
  EXPECT_EQ(roce_version_of(""), 0);
}

}  // namespace

TEST(RdmaRetryCount, SoftRoceNeverGetsTheCountItWouldRetryForever) {
  // rxe never decrements a transport retry count of 7: 6 is the most that still ends.
  EXPECT_EQ(effective_retry_cnt(7, kSoftRoceVendorId), 6);
  EXPECT_EQ(effective_retry_cnt(6, kSoftRoceVendorId), 6);
  EXPECT_EQ(effective_retry_cnt(0, kSoftRoceVendorId), 0);
  // A hardware HCA (Mellanox 0x02c9, Broadcom 0x14e4) counts 7 as seven retries.
  EXPECT_EQ(effective_retry_cnt(7, 0x02c9), 7);
  EXPECT_EQ(effective_retry_cnt(7, 0x14e4), 7);
  EXPECT_EQ(effective_retry_cnt(3, 0x02c9), 3);
}
