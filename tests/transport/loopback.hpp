// Two engines in one process connected over loopback (tcp or shm): no fork, so these tests
// also run under ThreadSanitizer.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "harness.hpp"
#include "sluice/sluice.hpp"

namespace sluice_test {

// Returns the ErrorCode a callable throws (kOk if none).
template <typename F>
sluice::ErrorCode code_of(F&& fn, std::string* message = nullptr) {
  try {
    fn();
  } catch (const sluice::Error& e) {
    if (message) *message = e.what();
    return e.code();
  }
  return sluice::ErrorCode::kOk;
}

class LoopbackTest : public ::testing::TestWithParam<std::string> {
 protected:
  static constexpr uint64_t kBytes = 1 << 20;

  void SetUp() override {
    a_ = std::make_unique<sluice::Engine>(engine_config(GetParam(), 2, 10s));
    b_ = std::make_unique<sluice::Engine>(engine_config(GetParam(), 2, 10s));
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    fill_pattern(la_.data(), la_.size(), 11);
    fill_pattern(lb_.data(), lb_.size(), 22);
    ha_ = a_->register_memory(la_.data(), la_.size(), sluice::Location::host(), "a");
    hb_ = b_->register_memory(lb_.data(), lb_.size(), sluice::Location::host(), "b");
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), GetParam());
    auto acc = b_->accept(5s);
    ASSERT_TRUE(acc.has_value()) << "passive side never saw the endpoint";
    peer_ = *acc;
    auto rb = ep_.remote_region("b");
    ASSERT_TRUE(rb.has_value());
    rb_ = *rb;
  }
  void TearDown() override {
    ep_ = {};
    peer_ = {};
    if (a_) a_->close();
    if (b_) b_->close();
  }

  std::unique_ptr<sluice::Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  sluice::MemoryHandle ha_, hb_;
  sluice::RemoteHandle rb_;
  sluice::Endpoint ep_, peer_;
};

}  // namespace sluice_test
