// The FIFO push protocol on its own, with the test standing in for the proxy: 64-bit fields
// travel intact, a full FIFO holds its producer back without overwriting anything, a push
// that runs out of its spin bound fails the FIFO (its ticket can never be filled), and many
// producers never lose or duplicate a request.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "port_channel/proxy_core.hpp"

using namespace sluice;
using namespace sluice::detail;

namespace {

// Pops one request the way the proxy does; false if the next slot is not complete yet.
bool pop(Fifo& f, port::Request* out, uint64_t* kinds) {
  port::SlotState st = port::read_slot(f.slots + (f.next & (f.handle.depth - 1)), f.next, f.handle.depth, out, kinds);
  EXPECT_NE(port::SlotState::kCorrupt, st) << "slot holds a word of no lap of ticket " << f.next;
  if (st != port::SlotState::kReady) return false;
  ++f.next;
  __atomic_store_n(f.tail, f.next, __ATOMIC_RELEASE);
  return true;
}

port::Request request(uint64_t dst_off, uint64_t src_off, uint64_t size, uint32_t dst, uint32_t src, uint32_t ch) {
  port::Request r{};
  r.dst_offset = dst_off;
  r.src_offset = src_off;
  r.size = size;
  r.dst_mem = dst;
  r.src_mem = src;
  r.channel = ch;
  return r;
}

TEST(PortFifo, SixtyFourBitFieldsTravelIntact) {
  Fifo f(4, ProducerKind::kHost, 0);
  const uint64_t big = (5ull << 32) + 12345;  // offsets and sizes past 4 GiB
  uint64_t t = ~0ull;
  ASSERT_EQ(PortResult::kOk,
            f.handle.push(request(big, big + 7, (3ull << 32) + 9, 0xfffffff0u, 0xabcdef12u, 0x87654321u),
                          port::kPut | port::kSignal, port::kDefaultSpinNs, &t));
  EXPECT_EQ(0u, t);
  port::Request r{};
  uint64_t kinds = 0;
  ASSERT_TRUE(pop(f, &r, &kinds));
  EXPECT_EQ(big, r.dst_offset);
  EXPECT_EQ(big + 7, r.src_offset);
  EXPECT_EQ((3ull << 32) + 9, r.size);
  EXPECT_EQ(0xfffffff0u, r.dst_mem);
  EXPECT_EQ(0xabcdef12u, r.src_mem);
  EXPECT_EQ(0x87654321u, r.channel);
  EXPECT_EQ(port::kPut | port::kSignal, kinds);
  EXPECT_FALSE(pop(f, &r, &kinds)) << "an empty slot looked published";
}

// The LL slot: a producer's words arrive in any order, with no fence; the proxy takes the
// request only once every word carries its ticket's flag, and a flag of no lap of that
// ticket is a protocol violation.
TEST(PortFifo, ASlotIsTakenOnlyOnceEveryWordCarriesItsTicket) {
  constexpr uint64_t kDepth = 4;
  port::Slot slot{};
  port::Request out{};
  uint64_t kinds = 0;
  EXPECT_EQ(port::SlotState::kNotYet, port::read_slot(&slot, 0, kDepth, &out, &kinds)) << "a never-written slot";
  port::write_slot(&slot, request(1, 2, 3, 4, 5, 6), port::kPut, 4);  // ticket 4: slot 0's second lap
  port::Slot next{};
  port::write_slot(&next, request((9ull << 32) + 1, (8ull << 32) + 2, (7ull << 32) + 3, 11, 12, 13),
                   port::kPut | port::kSignal, 8);  // its third lap
  for (int k = 0; k < port::kSlotWords; ++k) {
    const int w = (k * 7) % port::kSlotWords;  // out of order
    slot.word[w] = next.word[w];
    const port::SlotState st = port::read_slot(&slot, 8, kDepth, &out, &kinds);
    if (k + 1 < port::kSlotWords) {
      ASSERT_EQ(port::SlotState::kNotYet, st) << "taken with " << k + 1 << " of " << port::kSlotWords << " words";
    } else {
      ASSERT_EQ(port::SlotState::kReady, st);
    }
  }
  EXPECT_EQ((9ull << 32) + 1, out.dst_offset);
  EXPECT_EQ((8ull << 32) + 2, out.src_offset);
  EXPECT_EQ((7ull << 32) + 3, out.size);
  EXPECT_EQ(11u, out.dst_mem);
  EXPECT_EQ(12u, out.src_mem);
  EXPECT_EQ(13u, out.channel);
  EXPECT_EQ(port::kPut | port::kSignal, kinds);
  slot.word[3] = (uint64_t(port::flag_of(8) + 1) << 32) | 5;  // no producer of any lap writes this
  EXPECT_EQ(port::SlotState::kCorrupt, port::read_slot(&slot, 8, kDepth, &out, &kinds));
}

TEST(PortFifo, FullFifoHoldsTheProducerBackAndOverwritesNothing) {
  Fifo f(4, ProducerKind::kHost, 0);
  for (uint64_t i = 0; i < 4; ++i)
    ASSERT_EQ(PortResult::kOk, f.handle.push(request(i, 0, 1, 0, 0, 0), port::kPut, port::kDefaultSpinNs, nullptr));
  std::atomic<int> result{-1};
  std::thread fifth([&] {
    result = static_cast<int>(f.handle.push(request(4, 0, 1, 0, 0, 0), port::kPut, port::kDefaultSpinNs, nullptr));
  });
  // Whatever the fifth producer has done so far, slot 0 still holds request 0.
  while (__atomic_load_n(f.handle.head, __ATOMIC_ACQUIRE) < 5) std::this_thread::yield();
  EXPECT_EQ(uint64_t(port::flag_of(0)) << 32, f.slots[0].word[0]) << "slot 0 no longer holds request 0 (dst_offset 0)";
  EXPECT_EQ(-1, result.load()) << "a push into a full FIFO returned before anything was consumed";
  port::Request r{};
  uint64_t kinds = 0;
  for (uint64_t i = 0; i < 5; ++i) {
    while (!pop(f, &r, &kinds)) std::this_thread::yield();
    EXPECT_EQ(i, r.dst_offset) << "requests came out of order or one was overwritten";
  }
  fifth.join();
  EXPECT_EQ(static_cast<int>(PortResult::kOk), result.load());
}

TEST(PortFifo, PushTimeoutFailsTheFifoInsteadOfStallingIt) {
  Fifo f(2, ProducerKind::kHost, 0);
  for (int i = 0; i < 2; ++i)
    ASSERT_EQ(PortResult::kOk, f.handle.push(request(i, 0, 1, 0, 0, 0), port::kPut, port::kDefaultSpinNs, nullptr));
  // Nobody consumes: a bounded push gives up (20 ms bound) ...
  EXPECT_EQ(PortResult::kTimeout, f.handle.push(request(2, 0, 1, 0, 0, 0), port::kPut, 20'000'000, nullptr));
  EXPECT_EQ(port::kFifoTimedOut, __atomic_load_n(f.state, __ATOMIC_ACQUIRE));
  // ... and every later push fails at once, even with room in the FIFO.
  port::Request r{};
  uint64_t kinds = 0;
  ASSERT_TRUE(pop(f, &r, &kinds));
  EXPECT_EQ(PortResult::kFailed, f.handle.push(request(3, 0, 1, 0, 0, 0), port::kPut, port::kDefaultSpinNs, nullptr));
}

TEST(PortFifo, ManyProducersNeverLoseOrRepeatARequest) {
  Fifo f(16, ProducerKind::kHost, 0);
  constexpr int kThreads = 64, kEach = 200;
  std::vector<std::thread> producers;
  std::atomic<int> bad{0};
  for (int p = 0; p < kThreads; ++p)
    producers.emplace_back([&, p] {
      for (int i = 0; i < kEach; ++i)
        if (f.handle.push(request(uint64_t(p) << 32 | uint64_t(i), 0, 8, 0, 0, uint32_t(p)), port::kPut,
                          port::kDefaultSpinNs, nullptr) != PortResult::kOk)
          bad++;
    });
  std::set<uint64_t> seen;
  std::vector<int> last(kThreads, -1);
  port::Request r{};
  uint64_t kinds = 0;
  while (seen.size() < size_t(kThreads) * kEach && bad.load() == 0) {
    if (!pop(f, &r, &kinds)) {
      std::this_thread::yield();
      continue;
    }
    int p = int(r.dst_offset >> 32), i = int(r.dst_offset & 0xffffffffu);
    ASSERT_EQ(uint32_t(p), r.channel) << "a request's words came from two producers";
    EXPECT_TRUE(seen.insert(r.dst_offset).second) << "request " << p << "/" << i << " seen twice";
    EXPECT_LT(last[p], i) << "producer " << p << "'s requests out of its order";
    last[p] = i;
  }
  for (auto& t : producers) t.join();
  EXPECT_EQ(0, bad.load());
  EXPECT_EQ(size_t(kThreads) * kEach, seen.size());
}

}  // namespace
