// When the tcp watchdog replaces a channel (docs/cluster.md, "Channel failover"), as a pure
// function of the channel's clocks so that the rule is tested without racing real sockets.
#pragma once

#include <algorithm>
#include <chrono>

namespace sluice::detail {

struct ChannelClocks {
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_io;     // a byte moved either way
  Clock::time_point answered;    // our requests moved forward (an answer, or request bytes out)
  Clock::time_point owed_since;  // the oldest owed work's submission (PendingOps::owed_since)
};

// How long the channel has been silent towards what it owes. The silence starts no earlier
// than the oldest owed work: a channel idle for a minute that was handed a send a moment ago
// is not a minute late. (Measured from the last byte alone, a send posted after a long idle
// looked stalled before its frame left, and, being unretryable, failed: TSan caught it.)
inline ChannelClocks::Clock::duration silence(ChannelClocks::Clock::time_point now, const ChannelClocks& c) {
  return now - std::max({c.last_io, c.answered, c.owed_since});
}

// Replace the channel? `all_retryable`: every op it owes can be sent again on a replacement.
// When one cannot (a send, a write_with_imm, a signal, or tcp.retry_rma off), a short silence is
// not enough (a slow peer is not a broken link): its socket must also be retransmitting, or the
// silence last half of op_timeout (what is lost may be the peer's data, after our request was
// acknowledged: then only the peer's socket retransmits). `retransmitting` is asked only then.
template <class Retransmitting>
bool should_replace(ChannelClocks::Clock::time_point now, const ChannelClocks& c, bool all_retryable,
                    std::chrono::milliseconds failover, std::chrono::milliseconds op_timeout,
                    Retransmitting&& retransmitting) {
  const auto quiet = silence(now, c);
  if (quiet < failover) return false;
  if (all_retryable) return true;
  return quiet >= op_timeout / 2 || retransmitting();
}

}  // namespace sluice::detail
