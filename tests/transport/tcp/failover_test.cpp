// tcp channel failover (docs/cluster.md, "Channel failover"): a channel that owes answers and
// stays silent is replaced by a fresh connection dialed by the connecting side; reads and
// writes caught on it are sent again (tcp.retry_rma), write_with_imm fails naming the peer,
// the channel and "not retried". The stall is made by tcp.test_mute_channel on the accepting
// engine: the first connection of that channel reads requests and never answers them, with no
// link to break, so the tests are deterministic. Without failover each of them would wait for
// op_timeout and fail (checked: SLUICE_TCP_FAILOVER_MS=0 makes every test here fail).
// Two engines in one process: runs under TSan.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../loopback.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class TcpFailover : public ::testing::Test {
 protected:
  static constexpr uint64_t kBytes = 1 << 20;

  // a dials b; b's channel `mute` never answers its first connection's requests.
  void start(int mute, bool retry_rma = true, std::chrono::milliseconds op_timeout = 20s) {
    EngineConfig ca = engine_config("tcp", 2, op_timeout);
    ca.set("tcp.failover_ms", "200");
    ca.set("tcp.retry_rma", retry_rma ? "1" : "0");
    EngineConfig cb = engine_config("tcp", 2, op_timeout);
    a_ = std::make_unique<Engine>(ca);
    b_ = std::make_unique<Engine>(cb);
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    fill_pattern(la_.data(), la_.size(), 31);
    fill_pattern(lb_.data(), lb_.size(), 32);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    hb_ = b_->register_memory(lb_.data(), lb_.size(), Location::host(), "b");
    // A test-only parameter, read from the environment as an endpoint is made: only b's
    // (accepted) endpoint mutes a channel.
    ::setenv("SLUICE_TCP_TEST_MUTE_CHANNEL", std::to_string(mute).c_str(), 1);
    ep_ = a_->connect(b_->local_info());
    auto acc = b_->accept(5s);
    ::unsetenv("SLUICE_TCP_TEST_MUTE_CHANNEL");
    ASSERT_EQ(ep_.transport(), "tcp");
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
    rb_ = *ep_.remote_region("b");
  }
  void TearDown() override {
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }
  // A batch of 1 MiB: striped over both channels (stripe_threshold 256 KiB).
  Batch whole(uint64_t loff = 0) { return {{ha_, loff, rb_, 0, kBytes}}; }

  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  MemoryHandle ha_, hb_;
  RemoteHandle rb_;
  Endpoint ep_, peer_;
};

// A write and a read that both have a lane on the muted channel complete with the right
// bytes (the lane went again on the replacement), and the endpoint stays up.
TEST_F(TcpFailover, ReadsAndWritesOnAStalledChannelAreRetried) {
  start(/*mute=*/1);
  Status w = ep_.write(whole()).wait();
  ASSERT_TRUE(w.ok()) << w.to_string();
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), kBytes)) << "the write's bytes did not all land";

  fill_pattern(lb_.data(), lb_.size(), 33);  // b's memory changes; a reads it back
  std::vector<uint8_t> want = lb_;
  Status r = ep_.read(whole()).wait();
  ASSERT_TRUE(r.ok()) << r.to_string();
  EXPECT_EQ(0, std::memcmp(la_.data(), want.data(), kBytes)) << "the read's bytes are wrong";
  EXPECT_TRUE(ep_.connected());
  EXPECT_TRUE(peer_.connected());
  // Each op had a lane on channel 1, replaced once per op_timeout: one replacement, the
  // write sent again (the read went on the new channel).
  EndpointMetrics m = ep_.metrics();
  EXPECT_EQ(m.channels_replaced, 1u);
  EXPECT_EQ(m.retries, 1u);
  // The replacement carries new ops too, in both directions.
  fill_pattern(la_.data(), la_.size(), 34);
  ASSERT_TRUE(ep_.write(whole()).wait().ok());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), kBytes));
  std::vector<uint8_t> pb(kBytes, 0);
  auto hpb = b_->register_memory(pb.data(), pb.size());
  auto ra = *peer_.remote_region("a");
  ASSERT_TRUE(peer_.read({{hpb, 0, ra, 0, kBytes}}).wait().ok());
  EXPECT_EQ(0, std::memcmp(pb.data(), la_.data(), kBytes));
}

// A stall on channel 0, which also carries the thin post path: posted writes are retried.
TEST_F(TcpFailover, PostedWritesOnAStalledChannelAreRetried) {
  start(/*mute=*/0);
  ep_.post_write(ha_, 0, rb_, 0, 4096);
  ep_.post_write(ha_, 4096, rb_, 4096, 4096);
  ep_.flush(20s);
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), 8192));
  EXPECT_TRUE(ep_.connected());
}

// write_with_imm may have been applied in part: it fails, naming the peer and the channel,
// and is not sent again; the endpoint and the other ops go on.
TEST_F(TcpFailover, WriteWithImmOnAStalledChannelFailsAndIsNotRetried) {
  start(/*mute=*/1, /*retry_rma=*/true, /*op_timeout=*/4s);  // replaced after op_timeout / 2
  Status st = ep_.write_with_imm(whole(), 77).wait();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code, ErrorCode::kPeerLost) << st.to_string();
  EXPECT_NE(st.message.find("not retried: may have been partly delivered"), std::string::npos) << st.message;
  EXPECT_NE(st.message.find("tcp channel 1"), std::string::npos) << st.message;
  const std::string b_id = nlohmann::json::parse(b_->local_info())["engine_id"].get<std::string>();
  EXPECT_NE(st.message.find(b_id), std::string::npos) << st.message;
  EXPECT_TRUE(ep_.connected());
  ASSERT_TRUE(ep_.write(whole()).wait().ok());
  EXPECT_EQ(0, std::memcmp(la_.data(), lb_.data(), kBytes));
}

// tcp.retry_rma off: a read caught on the replaced channel fails and says why.
TEST_F(TcpFailover, WithoutRetryReadsFailAndSaySo) {
  start(/*mute=*/1, /*retry_rma=*/false, /*op_timeout=*/4s);
  Status st = ep_.read(whole()).wait();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message.find("not retried (tcp.retry_rma is off)"), std::string::npos) << st.message;
  EXPECT_TRUE(ep_.connected());
  ASSERT_TRUE(ep_.read(whole()).wait().ok());
}

}  // namespace
