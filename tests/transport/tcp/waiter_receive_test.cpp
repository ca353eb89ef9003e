// tcp: a thread that waits for a future receives on its endpoint's sockets itself
// (TcpEndpoint::drive, StreamChannel::lend). These check what that must keep: completions
// reach every waiter whoever drives, a completion on another thread (the watchdog) ends a
// driver's sleep, a silent peer still fails a driven op within op_timeout, and a callback run
// on the driver may close the endpoint. Two engines in one process: runs under TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../loopback.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class TcpWaiter : public ::testing::Test {
 protected:
  static constexpr uint64_t kBytes = 1 << 20;

  void SetUp() override { start(engine_config("tcp", 2, 10s)); }
  void start(const EngineConfig& c) {
    a_ = std::make_unique<Engine>(c);
    b_ = std::make_unique<Engine>(c);
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    fill_pattern(la_.data(), la_.size(), 5);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    hb_ = b_->register_memory(lb_.data(), lb_.size(), Location::host(), "b");
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), "tcp");
    auto acc = b_->accept(5s);
    ASSERT_TRUE(acc.has_value());
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

  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> la_, lb_;
  MemoryHandle ha_, hb_;
  RemoteHandle rb_;
  Endpoint ep_, peer_;
};

// The point of driving: the answer is handled, and the op completed, on the waiting thread.
// Which thread gets there first is up to the scheduler for any one op (an answer that beats
// the waiter to its poll is the reactor's), so this asks only that it happens at all.
TEST_F(TcpWaiter, CompletionsRunOnTheWaitingThread) {
  const auto me = std::this_thread::get_id();
  bool seen = false;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  for (int i = 0; !seen && std::chrono::steady_clock::now() < deadline; ++i) {
    // Shared: a callback on a reactor may still run after wait() returned (wait is woken
    // before callbacks run), past this iteration. Counted only when it runs inside wait():
    // a write that completed before on_complete() runs it right there, on this thread.
    auto on_me = std::make_shared<std::atomic<bool>>(false);
    auto in_wait = std::make_shared<std::atomic<bool>>(false);
    Future f = ep_.write({{ha_, 0, rb_, 0, 64}});
    f.on_complete([on_me, in_wait, me](const Status&) { *on_me = std::this_thread::get_id() == me && in_wait->load(); });
    in_wait->store(true);
    ASSERT_TRUE(f.wait().ok());
    seen = on_me->load();
  }
  EXPECT_TRUE(seen) << "no completion ever ran on the thread that waited for it";
}

// Several threads wait on one endpoint at once (one drives, the others sleep until it or
// the reactor completes them), with writes striped over both channels and reads between.
TEST_F(TcpWaiter, ConcurrentWaitersAllComplete) {
  constexpr int kThreads = 4, kRounds = 150;
  constexpr uint64_t kSlice = kBytes / kThreads;
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      const uint64_t base = static_cast<uint64_t>(t) * kSlice;
      for (int r = 0; r < kRounds; ++r) {
        uint64_t n = (r % 3 == 0) ? kSlice : 64 + static_cast<uint64_t>(r);
        // A batch of two assignments lands on both channels.
        Future w = ep_.write({{ha_, base, rb_, base, n / 2}, {ha_, base + n / 2, rb_, base + n / 2, n - n / 2}});
        if (!(r % 2 ? w.wait_for(30s) && w.status().ok() : w.wait().ok())) bad++;
        Future rd = ep_.read({{ha_, base, rb_, base, n}});
        if (!rd.wait().ok()) bad++;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(std::memcmp(la_.data(), lb_.data(), kBytes), 0);
  EXPECT_TRUE(ep_.connected());
}

// A recv nobody answers is completed by the watchdog (recv_timeout), on the watchdog's
// thread, while this thread sleeps driving the endpoint's sockets: the completion must end
// that sleep (interrupt), not leave the waiter in poll() for good.
TEST(TcpWaiterWatchdog, CompletionOnAnotherThreadWakesTheDriver) {
  EngineConfig c = engine_config("tcp", 2, 10s);
  c.recv_timeout = 300ms;
  Engine a(c), b(c);
  std::vector<uint8_t> mem(4096);
  auto h = a.register_memory(mem.data(), mem.size());
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  std::atomic<bool> returned{false};
  Status st;
  std::thread waiter([&] {
    Future f = ep.recv(h, 0, mem.size());
    st = f.wait();
    returned = true;
  });
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!returned.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(returned.load()) << "the driving waiter never woke for a completion made on another thread";
  if (!returned.load()) ep.close();  // ends the poll (hang-up) so the test can finish
  waiter.join();
  EXPECT_EQ(st.code, ErrorCode::kTimeout) << st.to_string();
  EXPECT_TRUE(ep.connected()) << "a recv timeout fails the recv alone";
  acc->close();
  a.close();
  b.close();
}

// A callback that runs on the driving thread closes the endpoint; the wait returns, later
// ops fail, nothing hangs.
TEST_F(TcpWaiter, CallbackOnTheDriverClosesTheEndpoint) {
  for (int i = 0; i < 50 && ep_.connected(); ++i) {
    Future f = ep_.write({{ha_, 0, rb_, 0, 64}});
    Endpoint copy = ep_;
    const bool last = i == 49;
    const auto me = std::this_thread::get_id();
    f.on_complete([copy, last, me](const Status&) mutable {
      if (last || std::this_thread::get_id() == me) copy.close();
    });
    EXPECT_TRUE(f.wait_for(10s));
  }
  EXPECT_FALSE(ep_.connected());
}

}  // namespace
