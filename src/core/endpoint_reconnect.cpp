// Reconnection (ConnectOptions::reconnect): an endpoint whose peer was lost connects again
// on the next operation, as the Mooncake and NIXL users we serve expect from an engine that
// heals itself (issue 19), instead of leaving every caller to notice and connect anew.
// The design and its limits are in docs/cluster.md ("Reconnection").
#include <algorithm>
#include <chrono>
#include <string>

#include "core/engine_impl.hpp"
#include "core/log.hpp"

namespace sluice::detail {
namespace {
// A peer that is down refuses each attempt; callers that keep submitting get the last
// attempt's error at once for at least this long, and for as long as that attempt took (a
// hung peer's listener holds each attempt for the connect timeout: a caller in a loop then
// spends at most half its time dialing), instead of dialing again on every call.
constexpr std::chrono::milliseconds kRetryGap{100};

bool reconnectable(ErrorCode c) { return c == ErrorCode::kPeerLost || c == ErrorCode::kTimeout; }
}  // namespace

EndpointImpl& EndpointImpl::live_slow(std::shared_ptr<EndpointImpl>& hold, bool connect_again) {
  std::lock_guard<std::mutex> lk(reconnect_mu_);
  hold = successor_;
  EndpointImpl* cur = successor_ ? successor_.get() : this;
  if (!connect_again || !reconnect_ || user_closed_ || cur->failed_code_.load(std::memory_order_acquire) == 0)
    return *cur;
  Status failure;
  {
    std::lock_guard<std::mutex> f(cur->fail_mu_);
    failure = cur->failure_;
  }
  if (!reconnectable(failure.code)) return *cur;  // the caller's check_usable() reports it
  const std::string old_id = cur->peer_engine_id();
  auto refuse = [&](const std::string& why) {
    return Error(failure.code, "endpoint to " + old_id + " is unusable: " + failure.message + "; " + why);
  };
  if (unflushed_posts_.load(std::memory_order_relaxed))
    throw refuse("not reconnected: posts were made since the last flush(), whose failure flush() reports first");
  const auto now = std::chrono::steady_clock::now();
  if (!last_attempt_error_.empty() && now - last_attempt_ < std::max<std::chrono::steady_clock::duration>(kRetryGap, last_attempt_took_))
    throw refuse("connecting again failed " +
                 std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - last_attempt_).count()) +
                 " ms ago: " + last_attempt_error_);
  last_attempt_ = now;
  std::string ref;
  {
    std::lock_guard<std::mutex> p(peer_mu_);
    ref = peer_ref_;
  }
  std::shared_ptr<EndpointImpl> fresh;
  try {
    fresh = engine_->connect(ref, reconnect_options_, counters_);
  } catch (const std::exception& e) {
    last_attempt_took_ = std::chrono::steady_clock::now() - now;
    last_attempt_error_ = e.what();
    if (last_attempt_error_.empty()) last_attempt_error_ = "unknown error";
    throw refuse("connecting again to '" + ref + "' failed: " + last_attempt_error_);
  }
  last_attempt_error_.clear();
  counters_->reconnected();
  const std::string new_id = fresh->peer_engine_id();
  if (new_id != old_id)
    SLUICE_LOG(kInfo, "reconnected to '" << ref << "': the peer restarted, engine " << old_id << " is now " << new_id
                                         << " (handles of the old engine's regions are refused)");
  else
    SLUICE_LOG(kInfo, "reconnected to " << new_id << " at '" << ref << "' over " << fresh->transport_name()
                                        << " after: " << failure.to_string());
  successor_ = fresh;
  has_successor_.store(true, std::memory_order_release);
  hold = std::move(fresh);
  return *hold;
}

void EndpointImpl::close_chain(const Status& why) {
  std::shared_ptr<EndpointImpl> succ;
  {
    std::lock_guard<std::mutex> lk(reconnect_mu_);
    user_closed_ = true;
    succ = successor_;
  }
  if (succ) {
    succ->close(why);
    succ->engine_forget();
  }
  close(why);
  engine_forget();
}

}  // namespace sluice::detail
