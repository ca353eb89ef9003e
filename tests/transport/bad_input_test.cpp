// Caller errors: each throws sluice::Error with the right code at once and moves nothing.
#include <gtest/gtest.h>

#include "loopback.hpp"
#include "transports_under_test.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class BadInput : public LoopbackTest {
 protected:
  void SetUp() override {
    LoopbackTest::SetUp();
    if (HasFatalFailure()) return;
    snap_a_ = la_;
    snap_b_ = lb_;
  }
  // Runs `fn`, expects Error(code) thrown fast, then proves nothing moved: a later valid op
  // on the same endpoint completes (so anything submitted before it would have landed) and
  // both buffers are unchanged.
  void expect_refused(ErrorCode want, const std::function<void()>& fn, const char* what) {
    SCOPED_TRACE(what);
    std::string msg;
    auto t0 = std::chrono::steady_clock::now();
    ErrorCode got = code_of(fn, &msg);
    auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(got, want) << what << ": " << msg;
    EXPECT_LT(took, 500ms) << "the refusal was not immediate";
    EXPECT_FALSE(msg.empty());
    // Flush: a harmless write of a byte onto itself (same value) through the same path.
    ASSERT_TRUE(ep_.read({{hflush_, 0, rb_, 0, 1}}).wait().ok());
    EXPECT_TRUE(ep_.connected()) << "a caller error broke the endpoint";
    EXPECT_EQ(la_, snap_a_) << what << ": local memory changed";
    EXPECT_EQ(lb_, snap_b_) << what << ": remote memory changed";
  }

  std::vector<uint8_t> snap_a_, snap_b_;
  std::vector<uint8_t> flush_ = std::vector<uint8_t>(8);
  MemoryHandle hflush_;
};

TEST_P(BadInput, EveryCallerErrorIsRefusedAtOnce) {
  hflush_ = a_->register_memory(flush_.data(), flush_.size());
  const MemoryHandle unknown{987654};
  const RemoteHandle runknown{987654};
  const uint64_t n = kBytes;

  // Unknown / unregistered local handle.
  std::vector<uint8_t> tmp(4096);
  auto gone = a_->register_memory(tmp.data(), tmp.size());
  a_->unregister_memory(gone);
  for (MemoryHandle h : {unknown, gone, MemoryHandle{0}}) {
    expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.write({{h, 0, rb_, 0, 16}}); }, "write unknown local");
    expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.read({{h, 0, rb_, 0, 16}}); }, "read unknown local");
    expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.write_with_imm({{h, 0, rb_, 0, 16}}, 1); },
                   "write_with_imm unknown local");
    expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.send(h, 0, 16); }, "send unknown local");
    expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.recv(h, 0, 16); }, "recv unknown local");
  }
  // A peer's handle used as a local one is still unknown here (b's ids are not a's).
  expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.write({{MemoryHandle{rb_.id + 1000}, 0, rb_, 0, 16}}); },
                 "foreign handle");

  // Unknown remote handle.
  expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.write({{ha_, 0, runknown, 0, 16}}); }, "write unknown remote");
  expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.read({{ha_, 0, runknown, 0, 16}}); }, "read unknown remote");
  expect_refused(ErrorCode::kUnknownHandle, [&] { ep_.write_with_imm({{ha_, 0, RemoteHandle{0}, 0, 16}}, 1); },
                 "write_with_imm remote 0");

  // Local range outside the region (plain and overflowing).
  struct R {
    uint64_t off, len;
  } bad_ranges[] = {{n, 1}, {n - 1, 2}, {0, n + 1}, {UINT64_MAX, 1}, {UINT64_MAX - 7, 16}, {8, UINT64_MAX - 4}};
  for (auto r : bad_ranges) {
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.write({{ha_, r.off, rb_, 0, r.len}}); }, "write local range");
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.read({{ha_, r.off, rb_, 0, r.len}}); }, "read local range");
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.send(ha_, r.off, r.len); }, "send local range");
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.recv(ha_, r.off, r.len); }, "recv local range");
  }
  // Remote range outside the region (local range valid where possible).
  R bad_remote[] = {{n, 1}, {n - 1, 2}, {1, n}, {UINT64_MAX, 1}, {UINT64_MAX - 7, 16}, {8, n}};
  for (auto r : bad_remote) {
    uint64_t len = r.len;  // always a valid local length
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.write({{ha_, 0, rb_, r.off, len}}); }, "write remote range");
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.read({{ha_, 0, rb_, r.off, len}}); }, "read remote range");
    expect_refused(ErrorCode::kOutOfRange, [&] { ep_.write_with_imm({{ha_, 0, rb_, r.off, len}}, 9); },
                   "write_with_imm remote range");
  }
  // Empty batch, zero-length assignment.
  expect_refused(ErrorCode::kEmptyBatch, [&] { ep_.write({}); }, "write empty");
  expect_refused(ErrorCode::kEmptyBatch, [&] { ep_.read({}); }, "read empty");
  expect_refused(ErrorCode::kEmptyBatch, [&] { ep_.write_with_imm({}, 3); }, "write_with_imm empty");
  expect_refused(ErrorCode::kInvalidArgument, [&] { ep_.write({{ha_, 0, rb_, 0, 0}}); }, "write zero length");
  expect_refused(ErrorCode::kInvalidArgument, [&] { ep_.read({{ha_, 0, rb_, 0, 0}}); }, "read zero length");

  // One bad assignment in an otherwise good batch: the whole batch is refused, including the
  // good assignments before it.
  expect_refused(ErrorCode::kOutOfRange,
                 [&] { ep_.write({{ha_, 0, rb_, 0, 4096}, {ha_, 4096, rb_, 4096, 4096}, {ha_, 0, rb_, n - 10, 11}}); },
                 "write batch with a bad third assignment");
  expect_refused(ErrorCode::kUnknownHandle,
                 [&] { ep_.read({{ha_, 0, rb_, 0, 4096}, {ha_, 8192, runknown, 0, 4096}}); },
                 "read batch with a bad second assignment");
  expect_refused(ErrorCode::kInvalidArgument,
                 [&] { ep_.write_with_imm({{ha_, 0, rb_, 0, 4096}, {ha_, 0, rb_, 0, 0}}, 5); },
                 "write_with_imm batch with a zero-length assignment");
  // No imm was delivered for any refused write_with_imm.
  auto imm = peer_.imm_recv();
  EXPECT_FALSE(imm.wait_for(200ms)) << "a refused write_with_imm delivered imm " << imm.imm();

  // The endpoint is still fully usable.
  ASSERT_TRUE(ep_.write({{ha_, 0, rb_, 0, 4096}}).wait().ok());
  EXPECT_EQ(0, std::memcmp(lb_.data(), la_.data(), 4096));

  // A default-constructed endpoint is refused, not a crash.
  Endpoint empty;
  EXPECT_EQ(code_of([&] { empty.write({{ha_, 0, rb_, 0, 1}}); }), ErrorCode::kInvalidArgument);
}

TEST_P(BadInput, EngineLevelArgumentErrors) {
  char buf[64];
  EXPECT_EQ(code_of([&] { a_->register_memory(nullptr, 64); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a_->register_memory(buf, 0); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a_->register_memory(buf, 64, Location::host(), "a"); }), ErrorCode::kInvalidArgument)
      << "duplicate region name accepted";
  EXPECT_EQ(code_of([&] { a_->unregister_memory(MemoryHandle{424242}); }), ErrorCode::kUnknownHandle);
  EXPECT_EQ(code_of([&] { a_->allocate(0); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a_->free(Allocation{MemoryHandle{424242}, buf, 64}); }), ErrorCode::kUnknownHandle);
  EXPECT_EQ(code_of([&] { a_->free(Allocation{ha_, la_.data(), la_.size()}); }), ErrorCode::kUnknownHandle)
      << "free() of registered (not allocated) memory";
  auto al = a_->allocate(100);
  EXPECT_EQ(code_of([&] { a_->unregister_memory(al.handle); }), ErrorCode::kInvalidArgument);
  a_->free(al);
  EXPECT_EQ(code_of([&] { a_->free(al); }), ErrorCode::kUnknownHandle) << "double free accepted";
  EXPECT_EQ(code_of([&] { a_->connect("{not json"); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { a_->connect("nohostport"); }), ErrorCode::kInvalidArgument);
  ConnectOptions bad;
  bad.transport = "carrier-pigeon";
  EXPECT_EQ(code_of([&] { a_->connect(b_->local_info(), bad); }), ErrorCode::kUnsupported);
  EngineConfig c;
  c.transports = {"carrier-pigeon"};
  EXPECT_EQ(code_of([&] { Engine e(c); }), ErrorCode::kInvalidArgument);
  c = EngineConfig{};
  c.channels = 0;
  EXPECT_EQ(code_of([&] { Engine e(c); }), ErrorCode::kInvalidArgument);
  // Nothing changed.
  EXPECT_EQ(la_, snap_a_);
  EXPECT_EQ(lb_, snap_b_);
}

INSTANTIATE_TEST_SUITE_P(Conformance, BadInput, ::testing::ValuesIn(transports_under_test()), transport_name);

}  // namespace
