// A region the peer registers after connect becomes reachable through
// refresh_remote_regions(), which is the engine's lookup in its directory delivered to the
// transport as peer_updated(); the submit itself dials nobody's listener. An unregistered
// region fails kUnknownHandle once refreshed.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/engine_impl.hpp"
#include "directory/in_memory_directory.hpp"
#include "sluice/sluice.hpp"

namespace sluice::detail {
namespace {

using namespace std::chrono_literals;

struct Param {
  std::string transport;
  bool in_memory;  // the in-memory directory (else the default listener one)
};

std::string param_name(const testing::TestParamInfo<Param>& p) {
  return p.param.transport + (p.param.in_memory ? "_memory" : "_listener");
}

// The code an operation fails with, whether submit throws it or the future reports it.
template <typename F>
ErrorCode op_code(F&& submit) {
  try {
    return submit().wait().code;
  } catch (const Error& e) {
    return e.code();
  }
}

class RefreshTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    EngineConfig c;
    c.transports = {GetParam().transport};
    c.channels = 2;
    c.connect_timeout = 5s;
    c.op_timeout = 10s;
    a_ = std::make_unique<Engine>(c);
    b_ = std::make_unique<Engine>(c);
    std::string target = b_->local_info();
    if (GetParam().in_memory) {
      auto dir = std::make_shared<InMemoryDirectory>();
      a_->impl().use_directory(dir);
      b_->impl().use_directory(dir);
      target = b_->impl().info().engine_id;
    }
    src_.assign(1 << 16, 0);
    for (size_t i = 0; i < src_.size(); ++i) src_[i] = static_cast<uint8_t>(i * 7 + 3);
    hs_ = a_->register_memory(src_.data(), src_.size());
    ep_ = a_->connect(target);
    ASSERT_EQ(ep_.transport(), GetParam().transport);
    auto acc = b_->accept(5s);
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
  }
  void TearDown() override {
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }

  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> src_;
  MemoryHandle hs_;
  Endpoint ep_, peer_;
};

TEST_P(RefreshTest, RegionRegisteredAfterConnectIsReachableAfterRefresh) {
  std::vector<uint8_t> late(src_.size(), 0);
  MemoryHandle hl = b_->register_memory(late.data(), late.size(), Location::host(), "late");
  // Not in the info we connected with: unknown until refreshed.
  EXPECT_FALSE(ep_.remote_region("late").has_value());

  uint64_t before = b_->impl().listener_connections();
  ep_.refresh_remote_regions();
  // The listener directory asks b's listener once; the in-memory one not at all.
  EXPECT_EQ(b_->impl().listener_connections(), before + (GetParam().in_memory ? 0 : 1));
  auto rl = ep_.remote_region("late");
  ASSERT_TRUE(rl.has_value());
  EXPECT_EQ(rl->id, hl.id);

  before = b_->impl().listener_connections();
  ASSERT_TRUE(ep_.write({{hs_, 0, *rl, 0, src_.size()}}).wait().ok());
  std::vector<uint8_t> back(src_.size(), 0);
  MemoryHandle hback = a_->register_memory(back.data(), back.size());
  ASSERT_TRUE(ep_.read({{hback, 0, *rl, 0, back.size()}}).wait().ok());
  // The transfers opened nothing to b's listener (no refetch on the submit path).
  EXPECT_EQ(b_->impl().listener_connections(), before);
  EXPECT_EQ(late, src_);
  EXPECT_EQ(back, src_);
}

TEST_P(RefreshTest, UnregisteredRegionFailsUnknownHandleAfterRefresh) {
  std::vector<uint8_t> buf(src_.size(), 0);
  MemoryHandle hb = b_->register_memory(buf.data(), buf.size(), Location::host(), "gone");
  ep_.refresh_remote_regions();
  auto rg = ep_.remote_region("gone");
  ASSERT_TRUE(rg.has_value());
  ASSERT_TRUE(ep_.write({{hs_, 0, *rg, 0, 4096}}).wait().ok());

  b_->unregister_memory(hb);
  ep_.refresh_remote_regions();
  EXPECT_FALSE(ep_.remote_region("gone").has_value());
  EXPECT_EQ(op_code([&] { return ep_.write({{hs_, 0, *rg, 0, 4096}}); }), ErrorCode::kUnknownHandle);
  EXPECT_EQ(op_code([&] { return ep_.read({{hs_, 0, *rg, 0, 4096}}); }), ErrorCode::kUnknownHandle);
  // The endpoint stays usable.
  EXPECT_TRUE(ep_.connected());
}

INSTANTIATE_TEST_SUITE_P(Directories, RefreshTest,
                         ::testing::Values(Param{"tcp", true}, Param{"tcp", false}, Param{"shm", true},
                                           Param{"shm", false}),
                         param_name);

}  // namespace
}  // namespace sluice::detail
