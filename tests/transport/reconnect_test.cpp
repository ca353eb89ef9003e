// Reconnection over the real transports (tcp, shm), in one process: the peer engine closes
// and a new one starts on the same address; the endpoint's next operation connects to the new
// engine, and the bytes land in its memory, not anywhere the old handles pointed.
// The rules one by one are in tests/core/reconnect_test.cpp (fake transport).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "loopback.hpp"
#include "test_util.hpp"
#include "transports_under_test.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class ReconnectOver : public ::testing::TestWithParam<std::string> {
 protected:
  void TearDown() override { close_all(); }
  void close_all() {
    ep_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }
  // Registered memory must outlive the engine that serves it: a READ retried on a replaced
  // channel may still be answered after the test's own read completed (ASan caught one). A
  // test declares this after its buffers, so the engines close before the buffers are freed,
  // early returns included.
  struct CloseOnExit {
    ReconnectOver* t;
    ~CloseOnExit() { t->close_all(); }
  };
  // A new engine listening where `old_addr` was. SLUICE_LISTEN (the RDMA guest sets it to
  // "<rxe ip>:0") overrides the config's listen address, so it is pointed there meanwhile.
  std::unique_ptr<Engine> restart_at(EngineConfig c, const std::string& old_addr) {
    const size_t colon = old_addr.rfind(':');
    c.listen_host = old_addr.substr(0, colon);
    c.listen_port = static_cast<uint16_t>(std::stoi(old_addr.substr(colon + 1)));
    const char* env = std::getenv("SLUICE_LISTEN");
    if (!env) return std::make_unique<Engine>(c);
    const std::string saved = env;
    ::setenv("SLUICE_LISTEN", old_addr.c_str(), 1);
    auto e = std::make_unique<Engine>(c);
    ::setenv("SLUICE_LISTEN", saved.c_str(), 1);
    return e;
  }
  // Waits (bounded) until ep_ reports its connection lost.
  bool wait_lost(std::chrono::milliseconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (ep_.connected()) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  std::unique_ptr<Engine> a_, b_;
  Endpoint ep_;
};

TEST_P(ReconnectOver, PeerRestartedOnTheSameAddress) {
  constexpr uint64_t kBytes = 1 << 20;
  EngineConfig c = engine_config(GetParam(), 2, 10s);
  a_ = std::make_unique<Engine>(c);
  b_ = std::make_unique<Engine>(c);
  std::vector<uint8_t> src(kBytes), old_dst(kBytes, 0), new_dst(kBytes, 0), back(kBytes, 0);
  CloseOnExit closer{this};
  fill_pattern(src.data(), src.size(), 5);
  MemoryHandle hs = a_->register_memory(src.data(), src.size(), Location::host(), "src");
  b_->register_memory(old_dst.data(), old_dst.size(), Location::host(), "dst");
  ep_ = a_->connect(b_->listen_address());
  ASSERT_EQ(ep_.transport(), GetParam());
  RemoteHandle old_r = *ep_.remote_region("dst");
  ASSERT_TRUE(ep_.write({{hs, 0, old_r, 0, kBytes}}).wait_for(10s));
  const std::string old_id = ep_.peer_engine_id();

  const std::string addr = b_->listen_address();
  b_->close();
  b_.reset();
  ASSERT_TRUE(wait_lost(10s)) << "the endpoint never noticed that its peer closed";
  b_ = restart_at(c, addr);
  b_->register_memory(new_dst.data(), new_dst.size(), Location::host(), "dst");

  // The old handle: connected again, to a new engine that never advertised it.
  std::string msg;
  EXPECT_EQ(code_of([&] { ep_.write({{hs, 0, old_r, 0, kBytes}}); }, &msg), ErrorCode::kUnknownHandle) << msg;
  EXPECT_TRUE(ep_.connected());
  EXPECT_NE(ep_.peer_engine_id(), old_id);
  EXPECT_EQ(ep_.transport(), GetParam());
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
  auto r = ep_.remote_region("dst");
  ASSERT_TRUE(r.has_value());
  Future f = ep_.write({{hs, 0, *r, 0, kBytes}});
  ASSERT_TRUE(f.wait_for(10s));
  ASSERT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_EQ(new_dst, src);
  // Read back over the new connection too.
  MemoryHandle hb = a_->register_memory(back.data(), back.size(), Location::host(), "back");
  Future g = ep_.read({{hb, 0, *r, 0, kBytes}});
  ASSERT_TRUE(g.wait_for(10s));
  ASSERT_TRUE(g.status().ok()) << g.status().to_string();
  EXPECT_EQ(back, src);
}

// Posts have no Future: their failure is reported by flush(). An endpoint with posts not yet
// flushed does not reconnect (the failure would be lost with the old connection) until
// flush() has thrown it; then the next operation reconnects.
TEST_P(ReconnectOver, UnflushedPostsHoldReconnectionUntilFlushReportsTheFailure) {
  EngineConfig c = engine_config(GetParam(), 2, 10s);
  a_ = std::make_unique<Engine>(c);
  b_ = std::make_unique<Engine>(c);
  std::vector<uint8_t> src(4096, 7), dst(4096, 0), dst2(4096, 0);
  CloseOnExit closer{this};
  MemoryHandle hs = a_->register_memory(src.data(), src.size(), Location::host(), "src");
  b_->register_memory(dst.data(), dst.size(), Location::host(), "dst");
  ep_ = a_->connect(b_->listen_address());
  if (!ep_.capabilities().rma_post) GTEST_SKIP() << GetParam() << " has no thin post path";
  RemoteHandle r = *ep_.remote_region("dst");
  ep_.post_write(hs, 0, r, 0, 4096);
  ep_.flush();
  EXPECT_EQ(dst, src);
  const std::string addr = b_->listen_address();
  ep_.post_write(hs, 0, r, 0, 4096);  // may or may not reach the peer before it closes
  b_->close();
  b_.reset();
  ASSERT_TRUE(wait_lost(10s));
  b_ = restart_at(c, addr);
  std::string msg;
  EXPECT_NE(code_of([&] { ep_.write({{hs, 0, r, 0, 4096}}); }, &msg), ErrorCode::kOk);
  EXPECT_NE(msg.find("flush()"), std::string::npos) << msg;
  EXPECT_EQ(ep_.metrics().reconnects, 0u);
  // flush() reports the loss (or nothing, if the post had landed before it), then the next
  // operation reconnects to the new engine.
  code_of([&] { ep_.flush(); });
  b_->register_memory(dst2.data(), dst2.size(), Location::host(), "dst");
  ep_.refresh_remote_regions();
  EXPECT_EQ(ep_.metrics().reconnects, 1u);
  Future f = ep_.write({{hs, 0, *ep_.remote_region("dst"), 0, 4096}});
  ASSERT_TRUE(f.wait_for(10s));
  EXPECT_TRUE(f.status().ok()) << f.status().to_string();
  EXPECT_EQ(dst2, src);
}

INSTANTIATE_TEST_SUITE_P(Conformance, ReconnectOver, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace
