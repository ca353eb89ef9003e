// The shm thin post path (TransportEndpoint::post_write / post_signal; the contract is the
// comment above post_write in transport/transport.hpp).
// - A write into a peer region this side has mapped (engine-allocated memfd memory) is a
//   memcpy on the copy pool; any other write is a PULL_WRITE that the owner executes and acks.
//   Both finish out of order, so sequencer_ holds each signal until the writes before it are
//   done.
// - A signal to a counter this side has mapped is an atomic add (release) on the mapping; any
//   other signal is a SIGNAL frame that the owner applies with apply_signal() and acks.
// Posts reuse PostOps (no allocation per post in the steady state) and complete through
// pending_'s post handler (on_post_done).
#include <atomic>
#include <cstring>

#include "transport/common/signal_target.hpp"
#include "transport/shm/bulk_copy.hpp"
#include "transport/shm/shm_endpoint.hpp"

namespace sluice::detail::shm {

std::shared_ptr<PostOp> ShmEndpoint::take_post_op() {
  // Called by the poster and by the threads that issue ready signals (on_post_done).
  std::lock_guard<std::mutex> lk(post_ops_mu_);
  const size_t n = post_ops_.size();
  // Ops complete roughly in order, so the next few after the cursor are usually free.
  for (size_t i = 0; i < n && i < 8; ++i) {
    std::shared_ptr<PostOp>& o = post_ops_[post_cursor_++ % n];
    if (o.use_count() == 1) {
      // The last other holder released it (acq_rel); pair with that before reusing it.
      std::atomic_thread_fence(std::memory_order_acquire);
      return o;
    }
  }
  post_ops_.push_back(std::make_shared<PostOp>());
  return post_ops_.back();
}

Status ShmEndpoint::post_write(PostWrite&& w, std::chrono::milliseconds timeout) {
  const RegionEntry* src = w.pin.get();
  // Host memory only: the StagingEndpoint in front refuses posts from the CUDA memory it
  // stages (a pinned buffer per post), and stages the regular write().
  if (!src->location.is_host())
    return {ErrorCode::kUnsupported, "shm: post_write from " + src->location.to_string() + " memory"};
  if (Status st = posts_.admit(timeout); !st.ok()) return st;
  std::shared_ptr<PostOp> op = take_post_op();
  op->kind = OpKind::kWrite;
  op->future = nullptr;
  op->post = &posts_;
  op->post_error = Status::Ok();
  op->signal = false;
  op->bytes = w.dst.length;
  op->pins.clear();
  op->pins.push_back(std::move(w.pin));
  op->lanes.resize(1);
  op->lanes[0].pieces.resize(1);
  op->lanes[0].pieces[0] = w.dst;
  op->lanes[0].bytes = w.dst.length;

  const uint64_t id = w.dst.remote_id;
  bool mapped = false, describe = false;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    mapped = mapped_locked(id);
    describe = !mapped && !regions_.count(id) && describing_.insert(id).second;
  }
  if (describe) {
    // Learn about the region in the background (once): a memfd region is written through its
    // mapping from then on.
    start_describe(id);
  }
  op->by_peer = !mapped;
  if (!mapped)
    op->pull = PullPiece{id, w.dst.remote_offset, w.dst.length, reinterpret_cast<uint64_t>(w.src), src->id,
                         src->lease_slot, 0};
  op->post_epoch = sequencer_.write_posted();
  const uint64_t token = pending_.add(op);
  if (!token) return {ErrorCode::kPeerLost, "shm: the endpoint failed"};  // completed (failed) by add
  op->token = token;
  if (mapped) {
    push_post_job(std::move(op));
    return Status::Ok();
  }
  OutFrame f;
  f.hdr = make_frame(FrameType::kPullWrite, token, 0, 0, sizeof(PullPiece));
  f.data = reinterpret_cast<const uint8_t*>(&op->pull);
  f.keep = std::shared_ptr<void>(op, &op->pull);  // aliasing: holds the op, allocates nothing
  control_->post(std::move(f));
  return Status::Ok();
}

Status ShmEndpoint::post_signal(const PostSignal& s, std::chrono::milliseconds timeout) {
  if (Status st = posts_.admit(timeout); !st.ok()) return st;
  if (sequencer_.signal(s)) issue_signal(s);
  return Status::Ok();
}

void ShmEndpoint::push_post_job(std::shared_ptr<TransferOp> op) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) return;  // stop_io() ran: fail_all() fails the op
  if (post_count_ == post_ring_.size()) {
    // Grow (never shrinks): the steady state queues without allocating.
    std::vector<std::shared_ptr<TransferOp>> bigger(std::max<size_t>(16, 2 * post_ring_.size()));
    for (size_t i = 0; i < post_count_; ++i) bigger[i] = std::move(post_ring_[(post_head_ + i) % post_ring_.size()]);
    post_ring_.swap(bigger);
    post_head_ = 0;
  }
  post_ring_[(post_head_ + post_count_) % post_ring_.size()] = std::move(op);
  ++post_count_;
  schedule_locked();
}

Status ShmEndpoint::run_post_write(const PostOp& op) {
  const Piece& p = op.lanes[0].pieces[0];
  RemoteRegion where;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto it = regions_.find(p.remote_id);
    if (it == regions_.end() || !it->second.map)
      return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(p.remote_id) + " is no longer registered"};
    where = it->second;
  }
  if (!in_bounds(p.remote_offset, p.length, where.length))
    return {ErrorCode::kOutOfRange, "peer region " + std::to_string(p.remote_id) + " is " + std::to_string(where.length) +
                                        " bytes on its same-host socket"};
  if (where.slot == kNoLease || !leases_.enter(where.slot, p.remote_id)) {
    std::lock_guard<std::mutex> lk(map_mu_);
    regions_.erase(p.remote_id);  // gone: forget its description and mapping
    return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(p.remote_id) + " is no longer registered"};
  }
  bulk_copy(where.map->base + p.remote_offset, p.local, p.length, stream_min_);
  // If the owner withdrew the region meanwhile the bytes went to pages only our mapping still
  // holds (harmless to it), and the write did not happen as far as we can tell.
  const bool still = leases_.still(where.slot, p.remote_id);
  leases_.leave(where.slot);
  if (!still)
    return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(p.remote_id) +
                                           " was unregistered during the copy; the write is lost"};
  return Status::Ok();
}

void ShmEndpoint::issue_signal(const PostSignal& s) {
  RemoteRegion where;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto it = regions_.find(s.remote_id);
    if (it != regions_.end()) where = it->second;
  }
  if (where.map) {
    // Mapped here: the add is ours to do. Release order: a waiter that sees the new value
    // sees the writes before it (they finished before the sequencer let this signal go).
    Status st;
    const bool inside = in_bounds(s.remote_offset, 8, where.length);
    uint8_t* p = inside ? where.map->base + s.remote_offset : nullptr;
    if (!inside)
      st = {ErrorCode::kOutOfRange, "signal: offset " + std::to_string(s.remote_offset) + " is outside peer region " +
                                        std::to_string(s.remote_id)};
    else if (reinterpret_cast<uintptr_t>(p) % 8 != 0)
      st = {ErrorCode::kInvalidArgument, "signal: the counter's address is not 8-byte aligned"};
    else if (where.slot == kNoLease || !leases_.enter(where.slot, s.remote_id))
      st = {ErrorCode::kUnknownHandle, "peer region " + std::to_string(s.remote_id) + " is no longer registered"};
    else {
      __atomic_fetch_add(reinterpret_cast<uint64_t*>(p), s.add, __ATOMIC_RELEASE);
      leases_.leave(where.slot);
    }
    posts_.done(st);
    return;
  }
  // Otherwise the owner applies it: a pending op, so a lost peer or the watchdog fails it.
  std::shared_ptr<PostOp> op = take_post_op();
  op->kind = OpKind::kWrite;
  op->future = nullptr;
  op->post = &posts_;
  op->post_error = Status::Ok();
  op->signal = true;
  op->signal_add = s.add;
  op->bytes = 8;
  op->pins.clear();
  op->by_peer = true;
  const uint64_t token = pending_.add(op);
  if (!token) return;  // the endpoint failed: add() completed it
  op->token = token;
  OutFrame f;
  f.hdr = make_frame(FrameType::kSignal, token, s.remote_id, s.remote_offset, 0, kLaneEnd,
                     static_cast<uint32_t>(s.add), static_cast<uint32_t>(s.add >> 32));
  control_->post(std::move(f));
}

void ShmEndpoint::on_post_done(const std::shared_ptr<TransferOp>& op, const Status& st) {
  const bool write = !op->signal;
  const uint64_t epoch = op->post_epoch;
  op->pins.clear();  // the source region is free to go now, not when the op is reused
  if (write) {
    // The signals this write held back, in order. A thread-local list allocates nothing in
    // the steady state; a nested call (a signal's add() failing) only appends past `base`.
    thread_local std::vector<PostSignal> ready;
    const size_t base = ready.size();
    sequencer_.write_done(epoch, &ready);
    for (size_t i = base; i < ready.size(); ++i) {
      PostSignal s = ready[i];
      issue_signal(s);
    }
    ready.resize(base);
  }
  posts_.done(st);
}

Status ShmEndpoint::serve_signal(StreamChannel& ch, const FrameHeader& h) {
  if (h.length != 0) return {ErrorCode::kProtocol, "SIGNAL with a payload"};
  if (!(h.flags & kLaneEnd) || (h.flags & kImmPart)) return {ErrorCode::kProtocol, "SIGNAL without LANE_END or with IMM_PART"};
  // Checked like any access to our memory (registered region, in range, aligned); a refused
  // signal changes nothing and is answered with a NACK.
  const uint64_t add = uint64_t(h.aux) << 32 | h.imm;
  Status st = apply_signal(events_->registry(), h.region, h.offset, add);
  OutFrame f;
  f.text = st.message.substr(0, kMaxMessageText);
  f.hdr = make_frame(st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, 0, 0, f.text.size(), kLaneEnd, 0, 0,
                     static_cast<uint16_t>(st.code));
  f.response = true;
  ch.post(std::move(f));
  return Status::Ok();
}

}  // namespace sluice::detail::shm
