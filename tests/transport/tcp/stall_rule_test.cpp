// The tcp watchdog's rule (src/transport/tcp/stall_rule.hpp) on fixed clocks: which silent
// channels it replaces, and that a channel's silence starts no earlier than its owed work.
#include "transport/tcp/stall_rule.hpp"

#include <gtest/gtest.h>

namespace sluice::detail {
namespace {

using namespace std::chrono_literals;
using Clock = ChannelClocks::Clock;

constexpr auto kFailover = 300ms;
constexpr auto kOpTimeout = 1500ms;

// A clock far from the epoch, so that "long ago" is representable.
const Clock::time_point kNow = Clock::time_point(1000s);

bool replaces(const ChannelClocks& c, bool all_retryable, bool retransmitting = false) {
  bool asked = false;
  bool r = should_replace(kNow, c, all_retryable, kFailover, kOpTimeout, [&] {
    asked = true;
    return retransmitting;
  });
  if (all_retryable) EXPECT_FALSE(asked) << "TCP_INFO asked for although every op can be sent again";
  return r;
}

// The race TSan caught (TcpStripedSend.NothingIsLeftPendingAfterwards): a channel idle for
// 2.5 s is handed a send; a watchdog tick before the send's frame left saw 2.5 s of silence,
// past half of op_timeout, and replaced the channel, which failed the (unretryable) send.
TEST(TcpStallRule, AnIdleChannelHandedWorkIsNotLateForIt) {
  ChannelClocks c{kNow - 2500ms, kNow - 2500ms, kNow - 5ms};
  EXPECT_EQ(silence(kNow, c), 5ms);
  EXPECT_FALSE(replaces(c, /*all_retryable=*/false));
  EXPECT_FALSE(replaces(c, /*all_retryable=*/true));
  // The same channel with the send owed for longer than failover and half of op_timeout.
  c.owed_since = kNow - 800ms;
  EXPECT_TRUE(replaces(c, false));
}

TEST(TcpStallRule, RetryableWorkIsMovedAfterFailover) {
  ChannelClocks c{kNow - 10s, kNow - 10s, kNow - 299ms};
  EXPECT_FALSE(replaces(c, true));
  c.owed_since = kNow - 300ms;
  EXPECT_TRUE(replaces(c, true));
}

// Bytes moving, or answers arriving, keep a channel that owes work from being replaced.
TEST(TcpStallRule, AChannelThatMovesIsNotSilent) {
  ChannelClocks c{kNow - 10ms, kNow - 10s, kNow - 10s};
  EXPECT_FALSE(replaces(c, true));
  c = {kNow - 10s, kNow - 10ms, kNow - 10s};
  EXPECT_FALSE(replaces(c, true));
}

// Unretryable work needs the socket retransmitting, or half of op_timeout of silence.
TEST(TcpStallRule, UnretryableWorkNeedsRetransmissionsOrHalfTheTimeout) {
  ChannelClocks c{kNow - 10s, kNow - 10s, kNow - 400ms};
  EXPECT_FALSE(replaces(c, false, /*retransmitting=*/false));
  EXPECT_TRUE(replaces(c, false, /*retransmitting=*/true));
  c.owed_since = kNow - 750ms;
  EXPECT_TRUE(replaces(c, false, false));
}

}  // namespace
}  // namespace sluice::detail
