// nvlink completion: an op's CUDA events (polled on the submitting thread for small ops, else
// by the endpoint's poller thread), the owner's answers to its PULL_WRITEs, and its lanes
// finishing (the imm of a write_with_imm after the last one, through EndpointBase). The
// poller also completes posts (post_path.cpp) and does what must not block a submitting
// thread (peer_view.cpp) (see endpoint.hpp).
#include <algorithm>

#include "transport/nvlink/endpoint.hpp"

namespace sluice::detail::nvlink {

// This side's copies of the op are done with `st`: complete it, unless the owner has yet to
// answer PULL_WRITEs of it (then the last answer completes it).
void NvlinkEndpoint::settle(Inflight& f, Status st) {
  if (auto p = f.pull) {
    {
      std::lock_guard<std::mutex> lk(p->mu);
      p->own_done = true;
      if (p->st.ok() && !st.ok()) p->st = st;
      if (p->frames_left > 0) {
        f.pull.reset();  // no cycle through the parked op
        p->parked.emplace(std::move(f));
        return;
      }
      st = p->st;
    }
    std::lock_guard<std::mutex> lk(pull_mu_);
    pulls_.erase(f.token);
  }
  finish_all(f, st);
}

// The owner answered a PULL_WRITE frame of an op, or a post's PULL_WRITE or kSignal.
Status NvlinkEndpoint::take_pull_ack(const FrameHeader& h, PayloadReader& payload) {
  Status st = frame_status(h, payload);
  if (h.type == static_cast<uint8_t>(FrameType::kNack) && st.ok()) st = {ErrorCode::kRemoteError, "peer refused the write"};
  std::shared_ptr<PullState> p;
  {
    std::lock_guard<std::mutex> lk(pull_mu_);
    auto it = pulls_.find(h.op_id);
    if (it != pulls_.end()) p = it->second;
  }
  if (!p) return owner_post_done(h.op_id, st);
  std::optional<Inflight> done;
  {
    std::lock_guard<std::mutex> lk(p->mu);
    if (p->frames_left <= 0) return {ErrorCode::kProtocol, "more acks than PULL_WRITE frames"};
    if (p->st.ok() && !st.ok()) p->st = st;
    if (--p->frames_left > 0 || !p->own_done) return Status::Ok();
    done = std::move(p->parked);
    p->parked.reset();
    st = p->st;
  }
  {
    std::lock_guard<std::mutex> lk(pull_mu_);
    pulls_.erase(h.op_id);
  }
  if (done) finish_all(*done, st);
  return Status::Ok();
}

// cudaSuccess when every event fired, cudaErrorNotReady, or the first error.
cudaError_t NvlinkEndpoint::events_done(const Inflight& f) {
  for (auto e : f.events) {
    cudaError_t r = cudaEventQuery(e);
    if (r != cudaSuccess) return r;
  }
  return cudaSuccess;
}

void NvlinkEndpoint::complete(Inflight& f, cudaError_t e) {
  Status st = Status::Ok();
  if (e != cudaSuccess) {
    cudaGetLastError();
    st = {ErrorCode::kInternal, std::string("nvlink copy failed: ") + cudaGetErrorString(e)};
  }
  for (auto ev : f.events) give_event(f.device, ev);
  f.events.clear();
  if (st.ok() && f.op->kind == OpKind::kRead) st = f.leases->still();
  settle(f, st);
}

// Every lane of the op finished with `st` (the base sends a write_with_imm's imm after the
// last one, through send_imm).
void NvlinkEndpoint::finish_all(Inflight& f, const Status& st) {
  pending_.touch();
  moved();
  if (f.lanes == 0) {
    pending_.lane_done(f.token, st);
    return;
  }
  for (int i = 0; i < f.lanes; ++i) lane_finished(f.token, st);
}

// The imm goes on the control channel, behind nothing of ours that could overtake it: the
// copies are done (their events fired) and the owner answered every PULL_WRITE of the op.
void NvlinkEndpoint::send_imm(uint64_t token, const std::shared_ptr<TransferOp>& op) {
  if (control_) {
    OutFrame fr;
    fr.hdr = make_frame(FrameType::kImm, token, 0, 0, 0, 0, op->imm);
    control_->post(std::move(fr));
  }
  pending_.lane_done(token, Status::Ok());
}

// What the poller does for the submitting threads, off them: describing the peer's regions
// after accept, and starting the ops that waited for a description (peer_view.cpp).
void NvlinkEndpoint::run_background() {
  bool resolve = false;
  std::deque<std::pair<std::shared_ptr<TransferOp>, uint64_t>> ops;
  {
    std::lock_guard<std::mutex> lk(mu_);
    resolve = resolve_wanted_;
    resolve_wanted_ = false;
    ops.swap(deferred_);
  }
  if (resolve) resolve_known();
  for (auto& [op, token] : ops) start(op, token, true);
}

namespace {
thread_local int tl_reaping = 0;  // completions this thread is making in reap() (stop_io waits for the others)
}  // namespace

bool NvlinkEndpoint::reap(bool block) {
  std::vector<std::pair<Inflight, cudaError_t>> done;
  bool left = false;
  {
    std::unique_lock<std::mutex> lk(act_mu_, std::defer_lock);
    if (block) {
      lk.lock();
    } else if (!lk.try_lock()) {
      return false;  // the poller (or another waiter) is looking: poll again
    }
    if (stop_flag_.load(std::memory_order_acquire)) return false;  // stop_io() takes what is left
    {
      std::lock_guard<std::mutex> g(mu_);
      while (!inflight_.empty()) {
        running_.push_back(std::move(inflight_.front()));
        inflight_.pop_front();
      }
    }
    for (auto it = running_.begin(); it != running_.end();) {
      cudaError_t e = events_done(*it);
      if (e == cudaErrorNotReady) {
        ++it;
        continue;
      }
      done.emplace_back(std::move(*it), e);
      it = running_.erase(it);
    }
    running_n_.store(running_.size(), std::memory_order_release);
    left = !running_.empty();
    if (!done.empty()) reaping_.fetch_add(1, std::memory_order_acq_rel);
  }
  // A waiter may have taken ops nobody waits for: the poller must go on polling them.
  if (!block && left) wake_poller();
  if (done.empty()) return false;
  ++tl_reaping;
  for (auto& [f, e] : done) complete(f, e);
  --tl_reaping;
  reaping_.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

// Under mu_, so that a poller about to sleep sees running_n_ or is woken.
void NvlinkEndpoint::wake_poller() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    has_work_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

void NvlinkEndpoint::end_polling(bool satisfied) {
  if (!satisfied) wake_poller();  // the waiter sleeps now: the poller completes its op
}

void NvlinkEndpoint::poll() {
  auto idle_since = std::chrono::steady_clock::now();
  for (;;) {
    const bool posts = post_marks_.load(std::memory_order_acquire) > 0;
    const bool active = running_n_.load(std::memory_order_acquire) > 0;
    if (!active && !posts && !has_work_.load(std::memory_order_acquire)) {
      // Spin a little before sleeping: a new op is often right behind the last one.
      if (std::chrono::steady_clock::now() - idle_since < poller_spin_) {
        if (stop_flag_.load(std::memory_order_acquire)) break;
        std::this_thread::yield();
        continue;
      }
    }
    bool background = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] {
        return stop_ || !inflight_.empty() || running_n_.load(std::memory_order_acquire) > 0 || !deferred_.empty() ||
               resolve_wanted_ || post_marks_.load(std::memory_order_acquire) > 0;
      });
      if (stop_) break;
      background = resolve_wanted_ || !deferred_.empty();
      has_work_.store(false, std::memory_order_release);
    }
    if (background) run_background();
    bool progressed = poll_posts();
    if (reap(true)) progressed = true;
    const bool busy = running_n_.load(std::memory_order_acquire) > 0 || post_marks_.load(std::memory_order_acquire) > 0;
    if (!busy) idle_since = std::chrono::steady_clock::now();
    if (!progressed && busy) std::this_thread::yield();
  }
  // Closing: stop_io() waits for the copies in running_ and inflight_.
}

// Closing (stop_io, after the poller stopped): no waiter takes ops any more; wait for those
// completing ops they took, then for every copy still in flight, so that no engine thread
// touches memory after close().
void NvlinkEndpoint::drain_active() {
  std::deque<Inflight> left;
  {
    std::lock_guard<std::mutex> lk(act_mu_);  // after this, reap() sees stop_flag_ and takes nothing
    left.swap(running_);
    running_n_.store(0, std::memory_order_release);
  }
  while (reaping_.load(std::memory_order_acquire) > tl_reaping) std::this_thread::yield();
  for (auto& f : left)
    for (auto e : f.events) {
      cudaEventSynchronize(e);
      give_event(f.device, e);
    }
}

}  // namespace sluice::detail::nvlink
