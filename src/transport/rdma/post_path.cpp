// rdma endpoint: the thin post path (post_write / post_signal / flush, contract in
// transport.hpp; see endpoint.hpp).
//
// Every post goes to QP 0, as RDMA WRITEs and IBV_WR_ATOMIC_FETCH_AND_ADDs built on the stack
// and posted through the same post() as every other WR, so posts stay in order with each other
// (and with whatever else QP 0 carries). Ordering is the whole design:
// - A signal is an atomic fetch-and-add queued on the same RC QP after the writes it covers.
//   An RC responder executes requests in PSN order and an atomic is executed only after the
//   RDMA WRITEs ahead of it have been placed (InfiniBand Architecture Specification vol. 1,
//   9.5 "Transaction ordering" and its ordering table: a later request never passes an
//   earlier RDMA WRITE). That is what MSCCL++'s IB connection relies on for putWithSignal
//   (IBConnection::updateAndSync: stageAtomicAdd on the QP behind the data WRITEs), and what
//   NCCL's IB proxy relies on when it writes its completion flag behind the data on one QP.
//   No SignalSequencer is needed here.
// - Completions: a signalled WR's completion means every earlier WR of the QP completed (an
//   RC send queue completes in order), so each WR carries the number of posts queued up to it
//   (post_mark) and any signalled completion on QP 0 retires the posts up to its mark. Posts
//   ask for a completion only every post_signal_every_ posts; flush() asks for one behind the
//   last post when it went unsignalled.
// - Bounds: post.depth (PostTracker) posts outstanding, and at most post_bound_ in flight on
//   QP 0 (half its send queue), so posts alone never spill into the backlog (no allocation
//   per post: WRs live on the stack, source pins in a ring sized once).
// A WR that fails moves QP 0 to the error state: the endpoint fails (as for any other WR) and
// every later call, flush included, returns that failure.
#include "core/inline_vec.hpp"
#include "transport/rdma/endpoint.hpp"

namespace sluice::detail::rdma {

namespace {

// The 8 bytes an atomic writes its fetched (old) value to: one slot past the control slots,
// in the control registration on QP 0's rail. Posts never read it.
constexpr size_t kAtomicResultSlot = size_t(kRecvSlots) + kCtrlSendSlots;

}  // namespace

// The endpoint failed: what every thin-path call returns from then on (the tracker's copy of
// the failure, once EndpointBase::fail() handed it over).
static Status failure_of(PostTracker& posts) {
  Status st = posts.admit(std::chrono::milliseconds(0));
  if (st.ok()) {  // fail() has not reached the tracker yet
    posts.cancel();
    st = {ErrorCode::kPeerLost, "rdma: endpoint failed"};
  }
  return st;
}

// ch.mu held. Every post up to `mark` completed (with `st`): release their source regions and
// tell the tracker.
void RdmaEndpoint::retire_posts(Chan& ch, uint64_t mark, const Status& st) {
  if (mark <= ch.posts_retired) return;
  const uint64_t n = mark - ch.posts_retired;
  for (uint64_t p = ch.posts_retired; p < mark; ++p) {
    if (!ch.post_pins.empty()) ch.post_pins[p % ch.post_pins.size()].release();
    posts_.done(st);
  }
  ch.posts_retired = mark;
  posts_inflight_.fetch_sub(n, std::memory_order_relaxed);
  if (ch.post_waiting) ch.post_room.notify_all();
}

// One admitted post (its WRs, the last one marked `post`) onto QP 0: waits (until `deadline`)
// for room among the posts in flight, keeps the source pin until the post is retired, and asks
// for a completion every post_signal_every_ posts. On an error the admission is undone or the
// endpoint failed; the caller returns the result.
Status RdmaEndpoint::post_admitted(Wr* wrs, size_t n, RegionPin&& pin, std::chrono::steady_clock::time_point deadline) {
  Chan& ch = *chans_[0];
  Status st;
  {
    std::unique_lock<std::mutex> lk(ch.mu);
    while (!failed() && ch.posts_queued - ch.posts_retired >= post_bound_) {
      ch.post_waiting = true;
      if (ch.post_room.wait_until(lk, deadline) == std::cv_status::timeout &&
          ch.posts_queued - ch.posts_retired >= post_bound_ && !failed()) {
        ch.post_waiting = false;
        lk.unlock();
        posts_.cancel();
        return {ErrorCode::kTimeout, "rdma: " + std::to_string(post_bound_) + " posts still in flight on QP 0 at the deadline"};
      }
    }
    ch.post_waiting = false;
    if (failed()) {
      lk.unlock();
      posts_.cancel();
      return failure_of(posts_);
    }
    // The slot of this post (number posts_queued) was freed when post posts_queued - bound retired.
    if (pin) ch.post_pins[ch.posts_queued % ch.post_pins.size()] = std::move(pin);
    Wr& last = wrs[n - 1];
    last.post = true;
    if (ch.posts_queued + 1 - ch.posts_signalled >= post_signal_every_) last.signal = true;
    const uint64_t before = ch.posts_queued;
    st = post_locked(ch, 0, wrs, n);
    if (ch.posts_queued != before) posts_inflight_.fetch_add(1, std::memory_order_relaxed);  // numbered, so retired later
  }
  wake_for_submit();
  if (!st.ok()) fail(st, true);  // outside ch.mu: fail() takes every channel's lock
  return st;
}

Status RdmaEndpoint::post_write(PostWrite&& w, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (Status st = posts_.admit(timeout); !st.ok()) return st;
  const Chan& ch = *chans_[0];
  Status st;
  const RegionKeys* keys = rails_->keys_for(*reg_, w.pin.get(), &st);
  uint32_t rkey = 0;
  if (keys && !rkey_for(w.dst.remote_id, ch.peer_rail, &rkey))
    st = {ErrorCode::kUnknownHandle, "rdma: peer " + setup_.peer.engine_id + " unregistered region " +
                                         std::to_string(w.dst.remote_id) + " (or advertised no memory key for it)"};
  if (!keys || !st.ok()) {
    posts_.cancel();
    return st;
  }
  if (fault_rkey_xor_ != 0) [[unlikely]]  // test-only fault injection, 0 in production
    rkey ^= fault_rkey_xor_;
  const uint32_t lkey = keys->mrs[ch.rail]->lkey;
  // One WR per max_wr_bytes_ (the devices' message size): one WR in all but giant posts.
  const bool host_src = w.pin.get()->location.is_host();
  InlineVec<Wr, 1> wrs((w.dst.length + max_wr_bytes_ - 1) / max_wr_bytes_);
  size_t i = 0;
  for (uint64_t off = 0; off < w.dst.length; ++i) {
    const uint64_t len = std::min(max_wr_bytes_, w.dst.length - off);
    Wr& x = wrs[i];
    x.sges[0] = {reinterpret_cast<uintptr_t>(w.src + off), static_cast<uint32_t>(len), lkey};
    x.nsge = 1;
    x.wr.opcode = IBV_WR_RDMA_WRITE;
    x.wr.wr.rdma.remote_addr = w.dst.remote_addr + off;
    x.wr.wr.rdma.rkey = rkey;
    // Inline: the CPU copies the bytes inside ibv_post_send, so host memory only.
    if (len <= max_inline_ && host_src) x.wr.send_flags |= IBV_SEND_INLINE;
    off += len;
  }
  return post_admitted(wrs.data(), wrs.size(), std::move(w.pin), deadline);
}

Status RdmaEndpoint::post_signal(const PostSignal& s, std::chrono::milliseconds timeout) {
  if (!post_atomics_)
    return {ErrorCode::kUnsupported, "rdma: post_signal needs IBV_WR_ATOMIC_FETCH_AND_ADD and a device of this engine "
                                     "has none (ibv_query_device atomic_cap = IBV_ATOMIC_NONE)"};
  // The core checked the offset; an atomic also needs the address itself 8-byte aligned
  // (a region may start anywhere), or the responder fails the QP.
  if (s.remote_addr % 8 != 0)
    return {ErrorCode::kInvalidArgument, "rdma: post_signal: the counter's address (region " + std::to_string(s.remote_id) +
                                             " + " + std::to_string(s.remote_offset) + ") is not 8-byte aligned"};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (Status st = posts_.admit(timeout); !st.ok()) return st;
  const Chan& ch = *chans_[0];
  uint32_t rkey = 0;
  if (!rkey_for(s.remote_id, ch.peer_rail, &rkey)) {
    posts_.cancel();
    return {ErrorCode::kUnknownHandle, "rdma: peer " + setup_.peer.engine_id + " unregistered region " +
                                           std::to_string(s.remote_id) + " (or advertised no memory key for it)"};
  }
  if (fault_rkey_xor_ != 0) [[unlikely]]
    rkey ^= fault_rkey_xor_;
  Wr x;
  x.sges[0] = {reinterpret_cast<uintptr_t>(ctrl_mem_.data() + kAtomicResultSlot * kSlotBytes), 8, ctrl_mr_->lkey};
  x.nsge = 1;
  x.wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  x.wr.wr.atomic.remote_addr = s.remote_addr;
  x.wr.wr.atomic.compare_add = s.add;
  x.wr.wr.atomic.rkey = rkey;
  return post_admitted(&x, 1, RegionPin{}, deadline);
}

Status RdmaEndpoint::flush(std::chrono::milliseconds timeout) {
  Status st;
  {
    Chan& ch = *chans_[0];
    std::lock_guard<std::mutex> lk(ch.mu);
    if (!failed() && ch.posts_queued > ch.posts_signalled) {
      // The last posts went unsignalled: a zero-length signalled WRITE to the peer's scratch
      // slot behind them brings the completion that retires them.
      Wr x;
      x.wr.opcode = IBV_WR_RDMA_WRITE;
      x.wr.wr.rdma.remote_addr = peer_scratch_addr_;
      x.wr.wr.rdma.rkey = peer_scratch_rkey_;
      x.signal = true;
      st = post_locked(ch, 0, &x, 1);
    }
  }
  if (!st.ok()) fail(st, true);
  wake_for_submit();
  return posts_.flush(timeout);
}

}  // namespace sluice::detail::rdma
