// A recording transport registered only in this binary: the engine tells it of every region
// registered and unregistered, publishes what region_added() returned with the region, and
// calls region_removed() only once the region's pins have drained.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/engine_impl.hpp"
#include "sluice/sluice.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

using namespace std::chrono_literals;

struct Record {
  std::mutex mu;
  std::vector<uint64_t> added, removed;
  std::atomic<int64_t> inflight_at_removal{-1};
  std::atomic<bool> refuse{false};
};
Record& record() {
  static Record r;
  return r;
}
// Region ids restart at 1 in every engine: each test starts from an empty record.
void reset_record() {
  std::lock_guard<std::mutex> lk(record().mu);
  record().added.clear();
  record().removed.clear();
  record().inflight_at_removal.store(-1);
  record().refuse.store(false);
}

class RecordingTransport final : public Transport {
 public:
  std::string name() const override { return "recording"; }
  int priority() const override { return 0; }
  bool supports(const Location&) const override { return true; }
  Capabilities capabilities() const override { return {}; }  // moves nothing
  nlohmann::json local_address() const override { return nlohmann::json::object(); }
  bool can_reach(const EngineInfo&, std::string* why) override {
    *why = "a test transport moves nothing";
    return false;
  }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup&) override {
    throw Error(ErrorCode::kUnsupported, "recording transport");
  }
  nlohmann::json region_added(const RegionEntry& e) override {
    if (record().refuse.load()) throw Error(ErrorCode::kNoDevice, "refused by the test");
    std::lock_guard<std::mutex> lk(record().mu);
    record().added.push_back(e.id);
    return {{"key", e.id * 10}};
  }
  void region_removed(const RegionEntry& e) override {
    record().inflight_at_removal.store(e.inflight.load());
    std::lock_guard<std::mutex> lk(record().mu);
    record().removed.push_back(e.id);
  }
};

SLUICE_REGISTER_TRANSPORT(recording, "recording", [](const EngineContext&, std::string*) -> std::unique_ptr<Transport> {
  return std::make_unique<RecordingTransport>();
});

EngineConfig config() {
  EngineConfig c;
  c.transports = {"tcp", "recording"};
  c.connect_timeout = 5s;
  return c;
}

const PeerRegion* find(const EngineInfo& info, uint64_t id) {
  for (const auto& r : info.regions)
    if (r.info.id == id) return &r;
  return nullptr;
}

TEST(RegionLifecycle, PublicDataIsPublishedWithTheRegionAndWithdrawn) {
  reset_record();
  Engine e(config());
  std::vector<uint8_t> buf(4096);
  MemoryHandle h = e.register_memory(buf.data(), buf.size(), Location::host(), "r");
  {
    std::lock_guard<std::mutex> lk(record().mu);
    ASSERT_FALSE(record().added.empty());
    EXPECT_EQ(record().added.back(), h.id);
  }
  // Through the blob a peer parses, not only the engine's struct.
  EngineInfo info = EngineInfo::parse(e.local_info());
  const PeerRegion* r = find(info, h.id);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->transport_data.count("recording"));
  EXPECT_EQ(r->transport_data.at("recording")["key"], h.id * 10);
  EXPECT_FALSE(r->transport_data.count("tcp"));  // tcp publishes nothing per region

  e.unregister_memory(h);
  {
    std::lock_guard<std::mutex> lk(record().mu);
    ASSERT_FALSE(record().removed.empty());
    EXPECT_EQ(record().removed.back(), h.id);
  }
  EXPECT_EQ(find(EngineInfo::parse(e.local_info()), h.id), nullptr);
}

TEST(RegionLifecycle, RemovalWaitsForPins) {
  reset_record();
  Engine e(config());
  std::vector<uint8_t> buf(4096);
  MemoryHandle h = e.register_memory(buf.data(), buf.size());
  Status st;
  RegionPin pin = e.impl().registry().pin(h.id, 0, 16, &st);
  ASSERT_TRUE(pin);
  std::atomic<bool> done{false};
  std::thread un([&] {
    e.unregister_memory(h);
    done.store(true);
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(done.load()) << "unregister returned while an operation still pinned the region";
  {
    std::lock_guard<std::mutex> lk(record().mu);
    EXPECT_TRUE(record().removed.empty()) << "the transport was told before the region's pins drained";
  }
  pin.release();
  un.join();
  EXPECT_TRUE(done.load());
  EXPECT_EQ(record().inflight_at_removal.load(), 0);
  std::lock_guard<std::mutex> lk(record().mu);
  EXPECT_EQ(record().removed.back(), h.id);
}

TEST(RegionLifecycle, ARefusedRegistrationLeavesNothingBehind) {
  reset_record();
  Engine e(config());
  std::vector<uint8_t> buf(4096);
  record().refuse.store(true);
  EXPECT_THROW(e.register_memory(buf.data(), buf.size(), Location::host(), "refused"), Error);
  record().refuse.store(false);
  EXPECT_TRUE(EngineInfo::parse(e.local_info()).regions.empty());
  // The name is free again: the registry forgot the refused region.
  EXPECT_NO_THROW(e.register_memory(buf.data(), buf.size(), Location::host(), "refused"));
}

}  // namespace
}  // namespace sluice::detail
