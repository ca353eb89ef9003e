// rdma endpoint: completion polling and failure (see endpoint.hpp).
//
// One thread per endpoint owns the CQs unless waiters drive them: it busy-polls while
// operations are outstanding (bounded by SLUICE_RDMA_BUSY_MS without any completion or
// submission) and for SLUICE_RDMA_SPIN_US after the last completion, then arms the CQs and
// sleeps in poll() on their completion channels, an eventfd (close, a submit while asleep) and
// the channel bootstrap sockets (kept open: EOF means the peer process is gone, which fails
// pending operations at once). A waiter (Future::wait) polls the CQs itself through
// progress(); meanwhile the thread leaves the CQs unarmed and only watches the sockets.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/log.hpp"
#include "transport/rdma/endpoint.hpp"

namespace sluice::detail::rdma {

using Clock = std::chrono::steady_clock;

bool RdmaEndpoint::progress() {
  // A completion callback that waits on another of our futures: this thread already polls.
  if (poll_owner_.load(std::memory_order_relaxed) == std::this_thread::get_id()) return false;
  std::unique_lock<std::mutex> lk(poll_mu_, std::try_to_lock);
  if (!lk.owns_lock() || stop_.load(std::memory_order_acquire)) return false;
  return poll_locked() > 0;
}

void RdmaEndpoint::begin_polling() {
  handoff_.store(false, std::memory_order_relaxed);
  callers_polling_.fetch_add(1, std::memory_order_acq_rel);
}

void RdmaEndpoint::end_polling(bool satisfied) {
  last_caller_end_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  // The waiter gave up (it now sleeps until someone else completes its future), or operations
  // are still outstanding: hand the CQs back now.
  if (callers_polling_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
      (!satisfied || pending_.size() > 0 || posts_inflight_.load(std::memory_order_relaxed) > 0)) {
    handoff_.store(true, std::memory_order_relaxed);
    wake();
  }
}

int RdmaEndpoint::poll_locked() {
  ibv_wc wcs[32];
  int total = 0;
  poll_owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  for (auto& c : cqs_) {
    int n = ibv_poll_cq(c.cq, 32, wcs);
    if (n < 0) {
      poll_owner_.store(std::thread::id(), std::memory_order_relaxed);
      fail({ErrorCode::kSystem, "rdma: ibv_poll_cq failed"}, true);
      return -1;
    }
    if (n > 0) pending_.touch();  // the peer shows progress
    for (int i = 0; i < n; ++i) handle(wcs[i], c.rail);
    total += n;
  }
  poll_owner_.store(std::thread::id(), std::memory_order_relaxed);
  return total;
}

void RdmaEndpoint::handle(const ibv_wc& wc, int rail) {
  const uint64_t tag = wc.wr_id & kTagMask;
  if (tag == kTagRecv) {
    handle_recv(wc);
  } else if (tag == kTagUnsig) {
    // Only errors come back for unsignalled WRs.
    if (wc.status == IBV_WC_SUCCESS) return;
    if (failover_ && !failed()) {
      const int c = chan_of_qp(rail, wc.qp_num);
      if (c < 0) return;  // a replaced queue pair's: its lanes were taken back already
      if (link_error(c, rail, wc)) {
        break_channel(c, wc_status(v_, wc, "transfer"), true);
        return;
      }
    }
    uint64_t token = wc.wr_id & ~kTagMask;
    Status st = wc_status(v_, wc, "transfer");
    if (token && wc.status != IBV_WC_WR_FLUSH_ERR) fail_op(token, st);
    fail({st.code, "QP " + std::to_string(wc.qp_num) + " in error state after: " + st.message}, true);
  } else {
    handle_send_completion(wc, rail);
  }
}

bool RdmaEndpoint::arm_all() {
  for (auto& c : cqs_)
    if (ibv_req_notify_cq(c.cq, 0)) {
      fail({ErrorCode::kSystem, "rdma: ibv_req_notify_cq failed"}, true);
      return false;
    }
  return true;
}

void RdmaEndpoint::run() {
  auto idle_since = Clock::now();
  bool armed = false;
  while (!stop_.load(std::memory_order_acquire)) {
    const auto since_caller = Clock::now() - Clock::time_point(Clock::duration(last_caller_end_.load(std::memory_order_relaxed)));
    if (callers_polling_.load(std::memory_order_acquire) > 0 ||
        (!handoff_.load(std::memory_order_relaxed) && since_caller < kCallerWindow)) {
      // Waiters drive the CQs: leave them unarmed (an armed CQ makes every completion wake this
      // thread, inside the poster's system call under SoftRoCE). Watch the sockets (peer death)
      // and look again now and then; a submit after the waiters left wakes us sooner.
      callers_mode_.store(true, std::memory_order_relaxed);
      sleep_on_events(static_cast<int>(kCallersModeSleep.count()));
      callers_mode_.store(false, std::memory_order_relaxed);
      armed = false;
      continue;
    }
    int n;
    {
      std::unique_lock<std::mutex> lk(poll_mu_, std::try_to_lock);
      if (!lk.owns_lock()) {
        std::this_thread::yield();
        continue;
      }
      n = poll_locked();
    }
    if (n < 0) break;
    if (n > 0) {
      idle_since = Clock::now();
      armed = false;
      continue;
    }
    auto now = Clock::now();
    // Busy-poll while operations are outstanding (their completions are a round trip
    // away) and for spin_ after the last completion; sleep on the channels only when idle.
    auto last = std::max(idle_since, Clock::time_point(Clock::duration(last_submit_.load(std::memory_order_relaxed))));
    const bool outstanding = pending_.size() > 0 || posts_inflight_.load(std::memory_order_relaxed) > 0;
    if (now - last < spin_ || (outstanding && now - last < busy_)) continue;
    if (!armed) {
      if (!arm_all()) break;
      armed = true;
      continue;  // poll once more: a completion may have raced the arming
    }
    sleeping_.store(true);
    if (busy_.count() > 0 && Clock::now() - Clock::time_point(Clock::duration(last_submit_.load())) < std::chrono::milliseconds(1)) {
      sleeping_.store(false);  // raced a submit that did not see us asleep
      continue;
    }
    sleep_on_events(100);
    sleeping_.store(false);
    armed = false;  // an event consumed the arming; re-arming an armed CQ is harmless
  }
}

void RdmaEndpoint::sleep_on_events(int timeout_ms) {
  std::vector<pollfd> fds;
  for (auto& c : cqs_) fds.push_back({c.comp->fd, POLLIN, 0});
  const size_t nc = fds.size();
  fds.push_back({wake_fd_, POLLIN, 0});
  std::vector<int> which;
  {
    std::lock_guard<std::mutex> sk(sock_mu_);  // a replacement swaps a channel's socket
    for (int c = 0; c < nchan_; ++c)
      if (chans_[c]->sock_live && !failed()) {
        fds.push_back({chans_[c]->sock.fd(), POLLIN, 0});
        which.push_back(c);
      }
  }
  int rc = ::poll(fds.data(), fds.size(), timeout_ms);
  if (rc <= 0) return;
  for (size_t i = 0; i < nc; ++i) {
    if (!(fds[i].revents & POLLIN)) continue;
    RailCq& c = cqs_[i];
    ibv_cq* ev_cq;
    void* ev_ctx;
    while (v_.get_cq_event(c.comp, &ev_cq, &ev_ctx) == 0) c.events++;
    if (c.events >= 64) {
      v_.ack_cq_events(c.cq, c.events);
      c.events = 0;
    }
  }
  if (fds[nc].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
  }
  int closed = -1;
  {
    std::lock_guard<std::mutex> sk(sock_mu_);
    for (size_t i = 0; i < which.size() && closed < 0; ++i) {
      if (!fds[nc + 1 + i].revents) continue;
      // A socket retired by a replacement meanwhile: the peer closing it is expected (a
      // retired socket stays open until the channel's next replacement).
      if (chans_[which[i]]->sock.fd() != fds[nc + 1 + i].fd) continue;
      char b;
      ssize_t k = ::recv(fds[nc + 1 + i].fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        chans_[which[i]]->sock_live = false;
        closed = which[i];
      } else if (k > 0) {
        chans_[which[i]]->sock_live = false;  // nothing is ever sent after the reply
      }
    }
  }
  // Outside the lock: failing completes ops, whose callbacks may close the endpoint.
  if (closed >= 0)
    fail({ErrorCode::kPeerLost, "rdma: peer " + setup_.peer.engine_id + " closed channel " + std::to_string(closed) +
                                    " (process exited or endpoint closed)"},
         true);
}

void RdmaEndpoint::wake_for_submit() {
  last_submit_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  // Asleep with the CQs armed: start busy-polling while the WRs travel (if configured to).
  if (busy_.count() > 0 && sleeping_.load()) {
    wake();
    return;
  }
  // Asleep with the CQs left to waiters, who are gone: whoever submits now may never wait.
  // (A submit right after a wait, the loop of a waiting caller, does not pay for a wake-up.)
  if (callers_mode_.load(std::memory_order_relaxed) && callers_polling_.load(std::memory_order_relaxed) == 0 &&
      Clock::now() - Clock::time_point(Clock::duration(last_caller_end_.load(std::memory_order_relaxed))) >= kCallerWindow)
    wake();
}

void RdmaEndpoint::wake() {
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wake_fd_, &one, sizeof one);
  }
}

// EndpointBase::fail(), first call: the core already heard; stop the queue pairs before the
// base fails pending ops and posts (the adapter may still be writing into a read's buffer).
void RdmaEndpoint::stop_io() {
  SLUICE_LOG(kDebug, "rdma: endpoint to " << setup_.peer.engine_id << " failed");
  // Flush the queues: every outstanding WR completes with IBV_WC_WR_FLUSH_ERR.
  for (auto& ch : chans_) {
    std::lock_guard<std::mutex> lk(ch->mu);
    ch->backlog.clear();
    if (ch->qp) {
      ibv_qp_attr at{};
      at.qp_state = IBV_QPS_ERR;
      v_.modify_qp(ch->qp, &at, IBV_QP_STATE);
    }
    // Posts in flight are forgotten with the endpoint (the tracker reports the failure from
    // now on); their source regions are free once the QP stopped.
    for (auto& pin : ch->post_pins) pin.release();
    posts_inflight_.fetch_sub(ch->posts_queued - ch->posts_retired, std::memory_order_relaxed);
    ch->posts_retired = ch->posts_queued;
    ch->post_room.notify_all();
  }
  std::lock_guard<std::mutex> lk(gone_mu_);
  gone_cv_.notify_all();
}

}  // namespace sluice::detail::rdma
