// The fixture of the core's tests over the fake transport (core_with_fake_test.cpp,
// reconnect_test.cpp): engines a_ and b_ in this process, ep_ from a to b and peer_ its
// accepted side, a's source region ha_ and b's target region (rb_) between guard bytes.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fake_transport.hpp"
#include "sluice/sluice.hpp"

namespace sluice::detail::fake {

constexpr uint64_t kLen = 16 << 10;
constexpr uint64_t kGuard = 4096;  // bytes either side of the target region, never registered
constexpr uint8_t kGuardByte = 0xEE;

class CoreWithFake : public ::testing::Test {
 protected:
  void TearDown() override {
    net().clear();
    ep_ = Endpoint();
    peer_ = Endpoint();
    a_.reset();
    b_.reset();
  }

  // channels 4 with 4 KiB pieces and striping always on: a 16 KiB transfer is 4 lanes.
  // `reconnect`: ConnectOptions::reconnect of ep_ (off where a test checks that a failed
  // endpoint stays failed); `b_name`: engine b's name (its metrics' label).
  void start(int channels, std::chrono::milliseconds op_timeout = std::chrono::seconds(30), bool reconnect = true,
             const std::string& b_name = "") {
    net().clear();
    EngineConfig c;
    c.transports = {"fake"};
    c.channels = channels;
    c.op_timeout = op_timeout;
    c.connect_timeout = std::chrono::seconds(5);
    c.chunk_size = 4096;
    c.stripe_threshold = 0;
    cfg_ = c;
    a_ = std::make_unique<Engine>(c);
    c.name = b_name;
    b_ = std::make_unique<Engine>(c);
    la_.assign(kLen, 0);
    for (size_t i = 0; i < la_.size(); ++i) la_[i] = static_cast<uint8_t>(i * 7 + 1);
    lb_.assign(kGuard + kLen + kGuard, kGuardByte);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    hb_ = b_->register_memory(lb_.data() + kGuard, kLen, Location::host(), "b");
    ConnectOptions co;
    co.reconnect = reconnect;
    ep_ = a_->connect(b_->listen_address(), co);
    auto p = b_->accept(std::chrono::seconds(5));
    ASSERT_TRUE(p.has_value());
    peer_ = *p;
    ASSERT_EQ(ep_.transport(), "fake");
    auto r = ep_.remote_region("b");
    ASSERT_TRUE(r.has_value());
    rb_ = *r;
  }

  Future write(uint64_t len = 4096, uint64_t off = 0) { return ep_.write({{ha_, off, rb_, off, len}}); }
  // The target region's bytes [off, off + len) hold what a wrote there.
  bool landed(uint64_t off, uint64_t len) const {
    for (uint64_t i = off; i < off + len; ++i)
      if (lb_[kGuard + i] != la_[i]) return false;
    return true;
  }
  bool untouched() const {
    for (uint8_t v : lb_)
      if (v != kGuardByte) return false;
    return true;
  }
  static ErrorCode code_of_write(Endpoint& ep, MemoryHandle h, RemoteHandle r) {
    try {
      ep.write({{h, 0, r, 0, 4096}});
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  }

  EngineConfig cfg_;
  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  MemoryHandle ha_, hb_;
  RemoteHandle rb_;
  Endpoint ep_, peer_;
};

}  // namespace sluice::detail::fake
