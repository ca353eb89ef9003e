// The info blob: round trip, and malformed blobs rejected with kProtocol.
#include <gtest/gtest.h>

#include "core/engine_info.hpp"
#include "sluice/error.hpp"
#include "sluice/version.hpp"

using namespace sluice;
using namespace sluice::detail;
using nlohmann::json;

namespace {

EngineInfo sample() {
  EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = "0123456789abcdef";
  e.host_id = "host/boot";
  e.listen_host = "127.0.0.1";
  e.listen_port = 31337;
  e.transports["tcp"] = json::object();
  e.transports["shm"] = {{"pid", 4242}, {"probe_addr", 123456789ull}, {"probe_value", 99ull}};
  PeerRegion a;
  a.info = {1, 0x7fff00001000ull, 1ull << 33, Location::host(), "weights", false};
  PeerRegion b;
  b.info = {7, 0x7fff10000000ull, 4096, Location::host(), "", true};
  PeerRegion c;
  c.info = {9, 0x1000, 65536, Location::cuda(3), "gpu", false};
  e.regions = {a, b, c};
  return e;
}

ErrorCode parse_code(const std::string& text) {
  try {
    EngineInfo::parse(text);
  } catch (const Error& e) {
    return e.code();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "non-sluice exception: " << e.what();
    return ErrorCode::kInternal;
  }
  return ErrorCode::kOk;
}

}  // namespace

TEST(EngineInfo, RoundTrip) {
  EngineInfo e = sample();
  EngineInfo back = EngineInfo::parse(e.dump());
  EXPECT_EQ(back.wire_version, e.wire_version);
  EXPECT_EQ(back.engine_id, e.engine_id);
  EXPECT_EQ(back.host_id, e.host_id);
  EXPECT_EQ(back.listen_host, e.listen_host);
  EXPECT_EQ(back.listen_port, e.listen_port);
  EXPECT_EQ(back.listen_address(), "127.0.0.1:31337");
  EXPECT_EQ(back.transports, e.transports);
  ASSERT_EQ(back.regions.size(), e.regions.size());
  for (size_t i = 0; i < e.regions.size(); ++i) {
    const auto& x = e.regions[i].info;
    const auto& y = back.regions[i].info;
    EXPECT_EQ(x.id, y.id);
    EXPECT_EQ(x.addr, y.addr);
    EXPECT_EQ(x.length, y.length);
    EXPECT_EQ(x.location, y.location);
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.shareable, y.shareable);
  }
  ASSERT_NE(back.find_region(7), nullptr);
  EXPECT_TRUE(back.find_region(7)->info.shareable);
  EXPECT_EQ(back.find_region(8), nullptr);
  // Re-serialising gives the same JSON.
  EXPECT_EQ(back.to_json(), e.to_json());
}

TEST(EngineInfo, MalformedBlobsAreProtocolErrors) {
  json good = sample().to_json();
  EXPECT_EQ(parse_code(good.dump()), ErrorCode::kOk);
  EXPECT_EQ(parse_code(""), ErrorCode::kProtocol);
  EXPECT_EQ(parse_code("{"), ErrorCode::kProtocol);
  EXPECT_EQ(parse_code("not json at all"), ErrorCode::kProtocol);
  EXPECT_EQ(parse_code("[]"), ErrorCode::kProtocol);
  EXPECT_EQ(parse_code("42"), ErrorCode::kProtocol);
  EXPECT_EQ(parse_code("null"), ErrorCode::kProtocol);
  std::string bytes = good.dump();
  EXPECT_EQ(parse_code(bytes.substr(0, bytes.size() / 2)), ErrorCode::kProtocol);

  for (const char* key : {"sluice", "engine_id", "host_id", "listen", "transports", "regions"}) {
    json j = good;
    j.erase(key);
    EXPECT_EQ(parse_code(j.dump()), ErrorCode::kProtocol) << "missing " << key;
    j[key] = json::array({1, 2});
    EXPECT_EQ(parse_code(j.dump()), ErrorCode::kProtocol) << "wrong type for " << key;
  }
  auto mutate = [&](auto fn) {
    json j = good;
    fn(j);
    return parse_code(j.dump());
  };
  EXPECT_EQ(mutate([](json& j) { j["sluice"] = kWireVersion + 1; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["sluice"] = "1"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["transports"] = "tcp"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"] = json::object(); }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0].erase("id"); }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0]["length"] = "big"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0]["location"] = "tpu:0"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0]["name"] = 5; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][1]["shareable"] = "x"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0] = 17; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["regions"][0] = nullptr; }), ErrorCode::kProtocol);
  // A listen address that is not host:port is a malformed blob, not a caller error.
  EXPECT_EQ(mutate([](json& j) { j["listen"] = "nocolon"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["listen"] = "host:99999"; }), ErrorCode::kProtocol);
  EXPECT_EQ(mutate([](json& j) { j["listen"] = "host:"; }), ErrorCode::kProtocol);
}

TEST(EngineInfo, SplitHostPort) {
  EXPECT_EQ(split_host_port("127.0.0.1:80"), std::make_pair(std::string("127.0.0.1"), uint16_t(80)));
  EXPECT_EQ(split_host_port("[::1]:65535"), std::make_pair(std::string("::1"), uint16_t(65535)));
  EXPECT_EQ(split_host_port("example.org:1"), std::make_pair(std::string("example.org"), uint16_t(1)));
  for (const char* bad : {"", ":", "host", "host:", ":80", "host:0", "host:65536", "host:8o", "host:-1", "host:99999999999999999999"}) {
    try {
      split_host_port(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << bad;
    }
  }
}

// What Transport::region_added() returned travels with the region.
TEST(EngineInfo, RegionTransportDataRoundTrips) {
  EngineInfo e = sample();
  e.regions[0].transport_data["rdma"] = json::array({11u, 22u});
  EngineInfo back = EngineInfo::parse(e.dump());
  ASSERT_EQ(back.regions.size(), e.regions.size());
  const PeerRegion* r = back.find_region(1);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->transport_data.count("rdma"), 1u);
  EXPECT_EQ(r->transport_data.at("rdma"), json::array({11u, 22u}));
  EXPECT_TRUE(back.find_region(7)->transport_data.empty());
  EXPECT_FALSE(json::parse(e.dump())["regions"][1].contains("transports"));  // none: no field
}

TEST(EngineInfo, RegionTransportDataMustBeAnObject) {
  json j = sample().to_json();
  j["regions"][0]["transports"] = json::array({1, 2});
  EXPECT_EQ(parse_code(j.dump()), ErrorCode::kProtocol);
  j["regions"][0]["transports"] = json::object({{std::string(65, 'x'), 1}});
  EXPECT_EQ(parse_code(j.dump()), ErrorCode::kProtocol);
}

TEST(EngineInfo, CarriesNoSameHostDetails) {
  // A region's memfd and lease slot, the owner's pid and lease table reach same-host peers
  // only over the owner's proven socket (docs/wire-protocol.md 3.1), never in the blob.
  json j = sample().to_json();
  EXPECT_FALSE(j.contains("pid"));
  EXPECT_FALSE(j.contains("leases"));
  for (const auto& r : j["regions"]) {
    EXPECT_FALSE(r.contains("memfd")) << r.dump();
    EXPECT_FALSE(r.contains("lease")) << r.dump();
  }
  // Blobs of builds that still sent them parse; the fields are ignored.
  j["pid"] = 4242;
  j["leases"] = {{"memfd", 7}, {"slots", 16384}};
  j["regions"][1]["memfd"] = 12;
  j["regions"][1]["lease"] = 3;
  EXPECT_NO_THROW(EngineInfo::from_json(j));
}
