// shm: a thread that waits for a future receives on its endpoint's control socket itself
// (ShmEndpoint::drive, WaiterReceive, StreamChannel::lend). These check what that must keep:
// the answers that come over the socket (a PULL_WRITE's ACK, a SEND_ACK) complete on the
// waiter; completions made elsewhere (the copy workers of mapped writes and reads, the
// watchdog) end a driver's sleep; many waiters on one endpoint all complete; and a callback
// run on the driver may close the endpoint. Two engines in one process: runs under TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "../loopback.hpp"

using namespace sluice;
using namespace sluice_test;

namespace {

class ShmWaiter : public ::testing::Test {
 protected:
  static constexpr uint64_t kBytes = 1 << 20;

  void SetUp() override { start(engine_config("shm", 2, 10s)); }
  void start(const EngineConfig& c) {
    a_ = std::make_unique<Engine>(c);
    b_ = std::make_unique<Engine>(c);
    la_.assign(kBytes, 0);
    lb_.assign(kBytes, 0);
    fill_pattern(la_.data(), la_.size(), 5);
    ha_ = a_->register_memory(la_.data(), la_.size(), Location::host(), "a");
    // Plain memory: writes into it are PULL_WRITEs, answered by an ACK on the socket.
    hb_ = b_->register_memory(lb_.data(), lb_.size(), Location::host(), "b");
    // A memfd region: once described, writes into it are mapped copies on a copy worker.
    mb_ = b_->allocate(kBytes, Location::host(), "bm");
    ep_ = a_->connect(b_->local_info());
    ASSERT_EQ(ep_.transport(), "shm");
    auto acc = b_->accept(5s);
    ASSERT_TRUE(acc.has_value());
    peer_ = *acc;
    auto rb = ep_.remote_region("b");
    ASSERT_TRUE(rb.has_value());
    rb_ = *rb;
    auto rm = ep_.remote_region("bm");
    ASSERT_TRUE(rm.has_value());
    rm_ = *rm;
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
  Allocation mb_;
  RemoteHandle rb_, rm_;
  Endpoint ep_, peer_;
};

// Runs `op` until one of its completions runs on the thread that waited for it. Which
// thread gets there first is up to the scheduler for any one op (an answer that beats the
// waiter to its poll is the reactor's), so this asks only that it happens at all; before
// shm lent its socket to waiters it never did.
template <class Op>
bool completes_on_waiter(Op op) {
  const auto me = std::this_thread::get_id();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    // Shared: a callback on a reactor may still run after wait() returned. Counted only when
    // it runs inside wait(): an op that completed before on_complete() runs it right there.
    auto on_me = std::make_shared<std::atomic<bool>>(false);
    auto in_wait = std::make_shared<std::atomic<bool>>(false);
    Future f = op();
    f.on_complete([on_me, in_wait, me](const Status&) { *on_me = std::this_thread::get_id() == me && in_wait->load(); });
    in_wait->store(true);
    EXPECT_TRUE(f.wait().ok()) << f.status().to_string();
    if (!f.status().ok()) return false;
    if (on_me->load()) return true;
  }
  return false;
}

TEST_F(ShmWaiter, PullWriteAckCompletesOnTheWaitingThread) {
  EXPECT_TRUE(completes_on_waiter([&] { return ep_.write({{ha_, 0, rb_, 0, 64}}); }))
      << "no PULL_WRITE ever completed on the thread that waited for it";
  EXPECT_EQ(std::memcmp(la_.data(), lb_.data(), 64), 0);
}

TEST_F(ShmWaiter, SendAckCompletesOnTheWaitingThread) {
  // Sends that wait for the receiver (an eager one completes when it is queued, on no waiter).
  TearDown();
  EngineConfig c = engine_config("shm", 2, 10s);
  c.options["shm.eager_max"] = "0";
  ASSERT_NO_FATAL_FAILURE(start(c));
  // Each send meets a recv posted beforehand: the receiver copies, then SEND_ACKs.
  std::vector<Future> recvs;
  EXPECT_TRUE(completes_on_waiter([&] {
    recvs.push_back(peer_.recv(hb_, 0, 64));
    return ep_.send(ha_, 0, 64);
  })) << "no send ever completed on the thread that waited for it";
  for (auto& r : recvs) EXPECT_TRUE(r.wait_for(10s) && r.status().ok()) << r.status().to_string();
  EXPECT_EQ(std::memcmp(la_.data(), lb_.data(), 64), 0);
}

// Waiters that spin (busy_wait_us) before they sleep: sends and PULL_WRITEs complete with
// the right bytes, whichever side's waiter or reactor gets each answer.
TEST(ShmWaiterSpin, SendsAndWritesCompleteWithSpinningWaiters) {
  EngineConfig c = engine_config("shm", 2, 10s);
  c.busy_wait_us = 2000;
  Engine a(c), b(c);
  std::vector<uint8_t> la(1 << 16), lb(1 << 16);
  auto ha = a.register_memory(la.data(), la.size(), Location::host(), "a");
  auto hb = b.register_memory(lb.data(), lb.size(), Location::host(), "b");
  auto ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "shm");
  auto acc = b.accept(5s);
  ASSERT_TRUE(acc.has_value());
  Endpoint peer = *acc;
  auto rb = ep.remote_region("b");
  ASSERT_TRUE(rb.has_value());
  for (int i = 0; i < 200; ++i) {
    const uint64_t n = 1 + (i * 331) % 4096;
    fill_pattern(la.data(), n, i);
    std::thread receiver([&] { EXPECT_TRUE(peer.recv(hb, 0, n).wait().ok()); });  // spins, then sleeps
    ASSERT_TRUE(ep.send(ha, 0, n).wait().ok()) << i;
    receiver.join();
    ASSERT_EQ(std::memcmp(la.data(), lb.data(), n), 0) << "send " << i;
    fill_pattern(la.data(), n, i + 1000);
    ASSERT_TRUE(ep.write({{ha, 0, *rb, 0, n}}).wait().ok()) << i;
    ASSERT_EQ(std::memcmp(la.data(), lb.data(), n), 0) << "write " << i;
  }
}

// Several threads wait on one endpoint at once (one drives, the others sleep until it, the
// reactor or a copy worker completes them), mixing PULL_WRITEs, mapped writes and reads
// (both completed on copy workers), wait() and wait_for().
TEST_F(ShmWaiter, ConcurrentWaitersAllComplete) {
  constexpr int kThreads = 4, kRounds = 150;
  constexpr uint64_t kSlice = kBytes / kThreads;
  std::atomic<int> bad{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t)
    ts.emplace_back([&, t] {
      const uint64_t base = static_cast<uint64_t>(t) * kSlice;
      for (int r = 0; r < kRounds; ++r) {
        uint64_t n = (r % 3 == 0) ? kSlice : 64 + static_cast<uint64_t>(r);
        Future w = ep_.write({{ha_, base, rb_, base, n / 2}, {ha_, base + n / 2, rb_, base + n / 2, n - n / 2}});
        Future m = ep_.write({{ha_, base, rm_, base, n}});
        if (!(r % 2 ? w.wait_for(30s) && w.status().ok() : w.wait().ok())) bad++;
        if (!m.wait().ok()) bad++;
        Future rd = ep_.read({{ha_, base, rb_, base, n}});
        if (!rd.wait().ok()) bad++;
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(std::memcmp(la_.data(), lb_.data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(la_.data(), mb_.ptr, kBytes), 0);
  EXPECT_TRUE(ep_.connected());
}

// A thread submitted a PULL_WRITE (so it drives the socket when it waits) and then a read,
// which a copy worker completes (slowly: every copy into an op's memory waits 200 ms first).
// Waiting for the read, the thread sleeps in poll() on the socket: the worker's completion
// must end that sleep (interrupt), not leave the waiter there until the ACK of some later op.
TEST(ShmWaiterWorker, WorkerCompletionWakesTheDriver) {
  ::setenv("SLUICE_SHM_TEST_COPY_DELAY_MS", "200", 1);
  EngineConfig c = engine_config("shm", 2, 10s);
  Engine a(c), b(c);
  std::vector<uint8_t> ma(4096), mb(4096);
  fill_pattern(mb.data(), mb.size(), 9);
  auto ha = a.register_memory(ma.data(), ma.size());
  b.register_memory(mb.data(), mb.size(), Location::host(), "b");
  Endpoint ep = a.connect(b.local_info());
  auto acc = b.accept(5s);
  ::unsetenv("SLUICE_SHM_TEST_COPY_DELAY_MS");  // read as the endpoints were made
  ASSERT_EQ(ep.transport(), "shm");
  ASSERT_TRUE(acc.has_value());
  auto rb = ep.remote_region("b");
  ASSERT_TRUE(rb.has_value());
  // wait() without a deadline: a driver that nobody wakes would sleep for good (nothing
  // else arrives on the socket once the write's ACK is in), so the test watches from here.
  std::atomic<int> rounds{0};
  std::atomic<bool> ok{true};
  std::thread waiter([&] {
    try {
      for (int i = 0; i < 5; ++i) {
        Future w = ep.write({{ha, 2048, *rb, 2048, 64}});
        Future r = ep.read({{ha, 0, *rb, 0, 1024}});
        if (!r.wait().ok() || !w.wait().ok()) ok = false;
        rounds++;
      }
    } catch (const Error&) {  // the endpoint was closed to end a hang
      ok = false;
    }
  });
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (rounds.load() < 5 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(rounds.load(), 5) << "a read completed by a copy worker never woke the waiter driving the socket";
  if (rounds.load() < 5) ep.close();  // ends the poll (hang-up) so the test can finish
  waiter.join();
  ASSERT_EQ(rounds.load(), 5);
  EXPECT_TRUE(ok.load());
  EXPECT_EQ(std::memcmp(ma.data(), mb.data(), 1024), 0);
  acc->close();
  ep.close();
  a.close();
  b.close();
}

// A recv nobody answers is completed by the watchdog (recv_timeout), on the watchdog's
// thread, while this thread sleeps driving the control socket: the completion must end that
// sleep, and a recv timeout fails the recv alone.
TEST(ShmWaiterWatchdog, CompletionOnAnotherThreadWakesTheDriver) {
  EngineConfig c = engine_config("shm", 2, 10s);
  c.recv_timeout = 300ms;
  Engine a(c), b(c);
  std::vector<uint8_t> mem(4096);
  auto h = a.register_memory(mem.data(), mem.size());
  Endpoint ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "shm");
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

// A callback that runs on the driving thread closes the endpoint (it joins the control
// channel whose fiber it runs on); the wait returns, later ops fail, nothing hangs.
TEST_F(ShmWaiter, CallbackOnTheDriverClosesTheEndpoint) {
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
  EXPECT_NE(code_of([&] { ep_.write({{ha_, 0, rb_, 0, 64}}).wait(); }), ErrorCode::kOk)
      << "a write on the closed endpoint succeeded";
}

}  // namespace
