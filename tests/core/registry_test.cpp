// Registry: handles, bounds checks (with overflow), pins and unregister waiting for them.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "core/registry.hpp"

using namespace sluice;
using namespace sluice::detail;
using namespace std::chrono_literals;

TEST(Registry, UnknownHandle) {
  Registry r;
  Status st;
  EXPECT_FALSE(r.pin(0, 0, 1, &st));
  EXPECT_EQ(st.code, ErrorCode::kUnknownHandle);
  st = {};
  EXPECT_FALSE(r.pin(42, 0, 1, &st));
  EXPECT_EQ(st.code, ErrorCode::kUnknownHandle);
  EXPECT_NE(st.message.find("42"), std::string::npos) << st.message;
  EXPECT_THROW(
      {
        try {
          r.remove(42);
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnknownHandle);
          throw;
        }
      },
      Error);
}

TEST(Registry, HandlesAreNonZeroAndDistinct) {
  Registry r;
  char a[16], b[16];
  auto h1 = r.add(a, sizeof(a), Location::host(), "");
  auto h2 = r.add(b, sizeof(b), Location::host(), "");
  EXPECT_NE(h1.id, 0u);
  EXPECT_NE(h2.id, 0u);
  EXPECT_NE(h1.id, h2.id);
  // Overlapping regions are allowed.
  auto h3 = r.add(a + 4, 8, Location::host(), "");
  EXPECT_NE(h3.id, h1.id);
  EXPECT_EQ(r.snapshot().size(), 3u);
}

TEST(Registry, RejectsBadRegistrations) {
  Registry r;
  char a[16];
  auto code_of = [&](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  EXPECT_EQ(code_of([&] { r.add(nullptr, 16, Location::host(), ""); }), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { r.add(a, 0, Location::host(), ""); }), ErrorCode::kInvalidArgument);
  r.add(a, 16, Location::host(), "x");
  EXPECT_EQ(code_of([&] { r.add(a, 16, Location::host(), "x"); }), ErrorCode::kInvalidArgument);
}

TEST(Registry, BoundsChecks) {
  Registry r;
  std::vector<char> buf(4096);
  auto h = r.add(buf.data(), buf.size(), Location::host(), "");
  struct Case {
    uint64_t off, len;
    bool ok;
  } cases[] = {
      {0, 4096, true},
      {0, 0, true},
      {4096, 0, true},
      {4095, 1, true},
      {4095, 2, false},
      {4096, 1, false},
      {4097, 0, false},
      {0, 4097, false},
      {1, UINT64_MAX, false},
      {UINT64_MAX, 1, false},
      {UINT64_MAX - 10, 20, false},  // offset + length wraps around to a small number
      {10, UINT64_MAX - 5, false},
      {UINT64_MAX, UINT64_MAX, false},
  };
  for (auto& c : cases) {
    Status st;
    RegionPin pin = r.pin(h.id, c.off, c.len, &st);
    EXPECT_EQ(static_cast<bool>(pin), c.ok) << "offset " << c.off << " length " << c.len;
    if (!c.ok) {
      EXPECT_EQ(st.code, ErrorCode::kOutOfRange) << "offset " << c.off << " length " << c.len;
    } else {
      EXPECT_EQ(pin.get()->base, reinterpret_cast<uint8_t*>(buf.data()));
    }
  }
  EXPECT_TRUE(in_bounds(0, 0, 0));
  EXPECT_FALSE(in_bounds(1, 0, 0));
  EXPECT_FALSE(in_bounds(UINT64_MAX, 2, UINT64_MAX));
  EXPECT_TRUE(in_bounds(UINT64_MAX - 1, 1, UINT64_MAX));
}

TEST(Registry, RemovedHandleIsUnknown) {
  Registry r;
  char a[64];
  auto h = r.add(a, sizeof(a), Location::host(), "name");
  r.remove(h.id);
  Status st;
  EXPECT_FALSE(r.pin(h.id, 0, 1, &st));
  EXPECT_EQ(st.code, ErrorCode::kUnknownHandle);
  EXPECT_EQ(r.find(h.id), nullptr);
  // The name is free again, and the old id is never reused.
  auto h2 = r.add(a, sizeof(a), Location::host(), "name");
  EXPECT_NE(h2.id, h.id);
}

TEST(Registry, UnregisterWaitsForPins) {
  Registry r;
  char a[64];
  auto h = r.add(a, sizeof(a), Location::host(), "");
  Status st;
  auto pin1 = std::make_unique<RegionPin>(r.pin(h.id, 0, 8, &st));
  RegionPin pin2 = r.pin(h.id, 8, 8, &st);
  ASSERT_TRUE(*pin1);
  ASSERT_TRUE(pin2);
  std::atomic<bool> removed{false};
  std::thread t([&] {
    r.remove(h.id);
    removed = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(removed.load()) << "remove() returned while pins were held";
  // Lookups fail as soon as removal started.
  Status st2;
  EXPECT_FALSE(r.pin(h.id, 0, 1, &st2));
  EXPECT_EQ(st2.code, ErrorCode::kUnknownHandle);
  pin1.reset();
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(removed.load()) << "remove() returned while one pin was still held";
  // Moving a pin keeps one reference.
  RegionPin moved = std::move(pin2);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(removed.load());
  moved.release();
  t.join();
  EXPECT_TRUE(removed.load());
}

TEST(Registry, PinMoveAssignmentReleasesOld) {
  Registry r;
  char a[64], b[64];
  auto ha = r.add(a, sizeof(a), Location::host(), "");
  auto hb = r.add(b, sizeof(b), Location::host(), "");
  Status st;
  RegionPin p = r.pin(ha.id, 0, 1, &st);
  p = r.pin(hb.id, 0, 1, &st);
  EXPECT_EQ(r.find(ha.id)->inflight.load(), 0);
  EXPECT_EQ(r.find(hb.id)->inflight.load(), 1);
  std::thread t([&] { r.remove(ha.id); });  // must not block
  t.join();
  p.release();
  EXPECT_EQ(r.find(hb.id)->inflight.load(), 0);
}

TEST(Registry, ConcurrentPinsAndRemove) {
  Registry r;
  std::vector<char> buf(1 << 16);
  for (int round = 0; round < 20; ++round) {
    auto h = r.add(buf.data(), buf.size(), Location::host(), "");
    std::atomic<bool> stop{false};
    std::atomic<int> held{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < 4; ++i)
      ts.emplace_back([&] {
        while (!stop) {
          Status st;
          RegionPin p = r.pin(h.id, 0, 16, &st);
          if (p) {
            held++;
            held--;
          }
        }
      });
    std::this_thread::sleep_for(2ms);
    auto e = r.remove(h.id);
    EXPECT_EQ(e->inflight.load(), 0);
    stop = true;
    for (auto& t : ts) t.join();
  }
}
