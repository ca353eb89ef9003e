// nvlink's thin post path: post_write, post_signal, flush (the contract is above post_write in
// transport/transport.hpp; the records are in post_path.hpp).
//
// A write goes one of three ways, by where the peer's memory is as seen from here (its owner's
// description, peer_view.cpp, never the info blob):
//  - the peer's GPU memory (mapped here), or its host memory mapped here (memfd) from our GPU
//    memory: one cudaMemcpyAsync on this endpoint's post stream of the device (Via::kStream);
//  - the peer's host memory mapped here, from our host memory: a memcpy now, under the
//    region's lease (done when post_write returns);
//  - the peer's host memory not mapped here: a PULL_WRITE its owner executes and answers
//    (Via::kOwner), as for submit: writes into such memory are always the owner's.
// A signal into the peer's GPU memory is a one-thread kernel (atomicAdd_system) on the post
// stream of the last copy: stream order puts it behind the copies before it (other devices'
// post streams are waited on with an event), and owner_seq_ holds it back while PULL_WRITEs
// before it are unanswered. A signal into host memory is a kSignal frame its owner applies
// (apply_signal): the control channel is in order, so it comes after every PULL_WRITE before
// it, and sequencer_ holds it back until the stream copies before it are done.
// Completion: stream posts are completed by the poller once an event recorded behind them
// fired (a "mark": every mark_every_ posts, at flush, when a signal waits for them); kOwner
// posts by the owner's ACK. No FutureState, no allocation per post: PostOps come back to a
// free list, the rings and vectors keep their size.
#include <cstring>

#include "cuda/copy_kernels.hpp"
#include "transport/nvlink/endpoint.hpp"

namespace sluice::detail::nvlink {

// The peer region `id` as described already; a post never waits for a description (see the
// top of peer_view.cpp): it fails, and the poller describes the region meanwhile.
Status NvlinkEndpoint::post_view(uint64_t id, RemoteView* rv) {
  Status why;
  if (cached_view(id, rv, &why)) return Status::Ok();
  if (!why.ok()) return why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    resolve_wanted_ = true;
    has_work_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
  return {ErrorCode::kUnknownHandle, "nvlink: peer region " + std::to_string(id) +
                                         " is not mapped here yet (the peer's regions are described after connect and "
                                         "accept, in the background); retry, or call refresh_remote_regions() first"};
}

// The endpoint's failure, for a post that found it failed.
Status NvlinkEndpoint::post_failure() {
  if (posts_.failed()) return posts_.flush(std::chrono::milliseconds(0));  // failed: returns the failure
  return {ErrorCode::kCancelled, "endpoint closed"};
}

std::shared_ptr<PostOp> NvlinkEndpoint::take_post() {
  {
    std::lock_guard<std::mutex> lk(free_mu_);
    if (!free_posts_.empty()) {
      auto op = std::move(free_posts_.back());
      free_posts_.pop_back();
      return op;
    }
  }
  auto op = std::make_shared<PostOp>();
  op->post = &posts_;
  return op;
}

// PendingOps' post handler: every way a post ends (its mark, the owner's answer, failure).
void NvlinkEndpoint::post_finished(const std::shared_ptr<TransferOp>& op, const Status& st) {
  auto po = std::static_pointer_cast<PostOp>(op);
  if (po->lease_slot != kNoLease) leases_.leave(po->lease_slot);
  po->lease_slot = kNoLease;
  for (uint32_t slot : po->leases) leases_.leave(slot);
  po->leases.clear();
  const uint32_t posts = po->posts;
  po->posts = 1;
  po->pins.clear();
  po->post_error = Status::Ok();
  po->counter = nullptr;
  po->stream = nullptr;
  po->signal = false;
  // Back to the free list first, so that the poster this done() wakes finds it. Not after a
  // failure: a PULL_WRITE frame may still point into it.
  if (!failed()) {
    std::lock_guard<std::mutex> lk(free_mu_);
    free_posts_.push_back(std::move(po));
  }
  posts_.done(st, posts);
}

PostStream* NvlinkEndpoint::post_stream(int device) {
  for (auto& ps : post_streams_)
    if (ps->device == device) return ps.get();
  auto ps = std::make_unique<PostStream>();
  ps->device = device;
  DeviceScope scope(device);
  // Loaded now, not at the first signal: a port channel's kernel may be spinning on this
  // device by then, and a lazy load would wait for it (copy_kernels.hpp).
  cu::check(cu::load_kernels(), "loading the signal and copy kernels");
  cu::check(cudaStreamCreateWithFlags(&ps->stream, cudaStreamNonBlocking), "cudaStreamCreate");
  try {
    ps->done = cuda::take_mapped_word();
  } catch (const Error&) {
    ps->done = nullptr;  // marks are events then
  }
  post_streams_.push_back(std::move(ps));
  return post_streams_.back().get();
}

// A copy or signal kernel on `from`'s post stream reaches memory on `to` (the kernel needs
// peer access: without it the address is illegal). Once per pair.
void NvlinkEndpoint::peer_access_locked(int from, int to) {
  if (from < 0 || to < 0 || from >= 64 || to >= 64 || from == to) return;
  if (peer_enabled_[from] >> to & 1) return;
  enable_peer_access(from, to);
  peer_enabled_[from] |= uint64_t(1) << to;
}

// An event behind the stream's unmarked posts, for the poller.
void NvlinkEndpoint::mark_locked(PostStream& ps) {
  if (ps.unmarked == 0) return;
  PostStream::Mark m;
  m.count = ps.unmarked;
  if (ps.tail_seq != 0) {
    // The batch kernel last launched covers every post before it on the stream.
    m.seq = ps.tail_seq;
    m.since = std::chrono::steady_clock::now();
  } else {
    DeviceScope scope(ps.device);  // an event is recorded on a stream of its own device
    try {
      m.event = take_event(ps.device);
      cudaError_t e = cudaEventRecord(m.event, ps.stream);
      if (e != cudaSuccess) {
        cudaGetLastError();
        give_event(ps.device, m.event);
        m.event = nullptr;
      }
    } catch (const Error&) {
      m.event = nullptr;
    }
    // Without an event the posts still complete, once the stream drained.
    if (!m.event) m.error = cudaStreamSynchronize(ps.stream);
  }
  ps.marks.push(m);
  unmarked_total_ -= ps.unmarked_posts;
  ps.unmarked = 0;
  ps.unmarked_posts = 0;
  post_marks_.fetch_add(1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    has_work_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

void NvlinkEndpoint::mark_all_locked() {
  for (auto& ps : post_streams_) mark_locked(*ps);
}

// One copy on the op's post stream.
Status NvlinkEndpoint::enqueue_post_locked(PostOp& op, uint64_t token, const uint8_t* src, uint8_t* dst, uint64_t n) {
  PostStream& ps = *op.stream;
  {
    DeviceScope scope(ps.device);
    if (Status st = cuda_status(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, ps.stream), "cudaMemcpyAsync"); !st.ok())
      return st;
  }
  ps.tail_seq = 0;
  ps.entries.push({token, op.post_epoch, 1});
  ++ps.unmarked;
  ++ps.unmarked_posts;
  ++unmarked_total_;
  last_post_stream_ = &ps;
  // Counted over every post stream: posts unmarked on several devices must not fill the depth.
  if (unmarked_total_ >= mark_every_ || flushing_.load(std::memory_order_acquire) > 0) mark_all_locked();
  return Status::Ok();
}

// Copies on other devices' post streams are waited for by `ps` (an event behind each), so
// that a signal launched on `ps` next comes after them too.
Status NvlinkEndpoint::wait_other_streams_locked(PostStream& ps) {
  for (auto& other : post_streams_) {
    if (other.get() == &ps || other->entries.empty()) continue;
    mark_locked(*other);
    if (!other->marks.empty() && other->marks.back().event) {
      DeviceScope scope(ps.device);
      if (Status st = cuda_status(cudaStreamWaitEvent(ps.stream, other->marks.back().event, 0), "cudaStreamWaitEvent");
          !st.ok())
        return st;
    }
  }
  return Status::Ok();
}

// The signal kernel on the op's post stream, behind every copy posted before it.
Status NvlinkEndpoint::launch_signal_locked(PostOp& op, uint64_t token, bool mark_now) {
  if (posts_stopped_) return {ErrorCode::kCancelled, "endpoint closed"};
  PostStream& ps = *op.stream;
  if (Status st = wait_other_streams_locked(ps); !st.ok()) return st;
  {
    DeviceScope scope(ps.device);
    if (Status st = cuda_status(cu::signal_add(reinterpret_cast<uint64_t*>(op.counter), op.signal_add, ps.stream),
                                "signal kernel");
        !st.ok())
      return st;
  }
  ps.tail_seq = 0;
  ps.entries.push({token, 0, 0});
  ++ps.unmarked;
  ++ps.unmarked_posts;
  ++unmarked_total_;
  if (mark_now || unmarked_total_ >= mark_every_ || flushing_.load(std::memory_order_acquire) > 0) mark_all_locked();
  return Status::Ok();
}

// A signal kernel that waited for the owner's answers to PULL_WRITEs before it (control
// channel). Marked at once: a flush may already be waiting for it.
void NvlinkEndpoint::launch_deferred_signal(uint64_t token) {
  auto op = pending_.find(token);
  if (!op) return;  // failed meanwhile
  std::unique_lock<std::mutex> lk(post_mu_);
  Status st = launch_signal_locked(static_cast<PostOp&>(*op), token, true);
  lk.unlock();
  if (!st.ok()) pending_.lane_done(token, st);
}

void NvlinkEndpoint::send_signal_frame(uint64_t token, uint64_t region, uint64_t offset, uint64_t add) {
  OutFrame fr;
  fr.hdr = make_frame(FrameType::kSignal, token, region, offset, 0, kLaneEnd, static_cast<uint32_t>(add),
                      static_cast<uint32_t>(add >> 32));
  control_->post(std::move(fr));
}

// post_write's checks (post_batch makes them too): the peer region as its owner describes
// it, the bounds, and a way for the bytes to go.
Status NvlinkEndpoint::check_write(const PostWrite& w, RemoteView* rv) {
  if (failed()) return post_failure();
  const uint64_t id = w.dst.remote_id, off = w.dst.remote_offset, n = w.dst.length;
  if (Status st = post_view(id, rv); !st.ok()) return st;
  if (!in_bounds(off, n, rv->length))
    return {ErrorCode::kOutOfRange, "peer region " + std::to_string(id) + " is " + std::to_string(rv->length) +
                                        " bytes (as its owner describes it); " + std::to_string(n) +
                                        " bytes at offset " + std::to_string(off) + " do not fit"};
  const bool local_cuda = !w.pin.get()->location.is_host();
  if (rv->host && !rv->ptr && local_cuda)
    return {ErrorCode::kUnsupported, "nvlink post_write: from GPU memory into peer host memory that is not mapped "
                                     "here (not engine-allocated) needs staging; use write()"};
  return Status::Ok();
}

Status NvlinkEndpoint::post_write(PostWrite&& w, std::chrono::milliseconds timeout) {
  RemoteView rv;
  if (Status st = check_write(w, &rv); !st.ok()) return st;
  const uint64_t id = w.dst.remote_id, off = w.dst.remote_offset, n = w.dst.length;
  const RegionEntry* src_region = w.pin.get();
  const int local_device = src_region->location.is_host() ? -1 : src_region->location.device;
  const bool by_owner = rv.host && !rv.ptr;
  if (Status st = posts_.admit(timeout); !st.ok()) return st;

  if (rv.host && rv.ptr && local_device < 0) {
    // Host memory on both sides, the peer's mapped here: copy now, inside its lease.
    if (rv.slot == kNoLease || !leases_.enter(rv.slot, id)) {
      posts_.cancel();
      forget_region(id, gone(id));
      return gone(id);
    }
    std::memcpy(rv.ptr + off, w.src, n);
    leases_.leave(rv.slot);
    posts_.done(Status::Ok());
    return Status::Ok();
  }

  auto op = take_post();
  op->kind = OpKind::kWrite;
  op->bytes = n;
  op->pins.push_back(std::move(w.pin));
  if (by_owner) {
    op->via = PostOp::Via::kOwner;
    op->piece = same_host::PullPiece{id, off, n, reinterpret_cast<uint64_t>(w.src), src_region->id,
                                     src_region->lease_slot, 0};
    const uint64_t epoch = owner_seq_.write_posted();
    op->post_epoch = epoch;
    const uint64_t token = pending_.add(op);
    if (!token) {
      owner_seq_.write_dropped(epoch);
      return post_failure();  // the post handler counted it done
    }
    OutFrame fr;
    fr.hdr = make_frame(FrameType::kPullWrite, token, 0, 0, sizeof(same_host::PullPiece));
    fr.data = reinterpret_cast<const uint8_t*>(&op->piece);
    fr.keep = op;
    control_->post(std::move(fr));
    return Status::Ok();
  }

  // A copy on the post stream, inside the peer region's lease until it completed.
  if (rv.slot == kNoLease || !leases_.enter(rv.slot, id)) {
    op->pins.clear();
    {
      std::lock_guard<std::mutex> lk(free_mu_);
      free_posts_.push_back(std::move(op));
    }
    posts_.cancel();
    forget_region(id, gone(id));
    return gone(id);
  }
  op->via = PostOp::Via::kStream;
  op->lease_slot = rv.slot;
  op->lease_id = id;
  int device = local_device;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    device = 0;
  }
  const uint64_t token = pending_.add(op);
  if (!token) return post_failure();  // the post handler left the lease and counted it done
  std::unique_lock<std::mutex> lk(post_mu_);
  // After stop_posts() nothing is enqueued: the lease would be left while the copy runs.
  Status st = posts_stopped_ ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
  if (st.ok()) {
    try {
      op->stream = post_stream(device);
    } catch (const Error& e) {
      st = e.status();
    }
  }
  if (st.ok()) {
    if (!rv.host) peer_access_locked(op->stream->device, rv.owner_device);
    op->post_epoch = sequencer_.write_posted();
    st = enqueue_post_locked(*op, token, w.src, rv.ptr + off, n);
    if (!st.ok()) sequencer_.write_dropped(op->post_epoch);  // the newest write: releases no signal
  }
  lk.unlock();
  if (!st.ok()) pending_.lane_done(token, st);
  return st;
}

// post_signal's checks (post_batch makes them too).
Status NvlinkEndpoint::check_signal(const PostSignal& s, RemoteView* rv) {
  if (failed()) return post_failure();
  const uint64_t id = s.remote_id;
  if (Status st = post_view(id, rv); !st.ok()) return st;
  if (s.remote_offset % 8 != 0 || !in_bounds(s.remote_offset, 8, rv->length))
    return {ErrorCode::kOutOfRange, "peer region " + std::to_string(id) + " is " + std::to_string(rv->length) +
                                        " bytes (as its owner describes it); no aligned counter at offset " +
                                        std::to_string(s.remote_offset)};
  if (!rv->host && reinterpret_cast<uintptr_t>(rv->ptr + s.remote_offset) % 8 != 0)
    return {ErrorCode::kInvalidArgument, "post_signal: the counter's address is not 8-byte aligned"};
  return Status::Ok();
}

Status NvlinkEndpoint::post_signal(const PostSignal& s, std::chrono::milliseconds timeout) {
  RemoteView rv;
  if (Status st = check_signal(s, &rv); !st.ok()) return st;
  const uint64_t id = s.remote_id;
  // A counter in the peer's GPU memory (always mapped here) is raised by our kernel; one in
  // its host memory by its owner.
  const bool kernel = !rv.host;
  uint8_t* counter = kernel ? rv.ptr + s.remote_offset : nullptr;
  if (Status st = posts_.admit(timeout); !st.ok()) return st;
  if (kernel && (rv.slot == kNoLease || !leases_.enter(rv.slot, id))) {
    posts_.cancel();
    forget_region(id, gone(id));
    return gone(id);
  }
  auto op = take_post();
  op->kind = OpKind::kWrite;
  op->bytes = 8;
  op->signal = true;
  op->signal_add = s.add;
  // While it waits in a sequencer the signal carries its post's token where the owner's
  // address would be (nvlink uses its own view of the region, never that address).
  PostSignal q = s;
  if (!kernel) {
    op->via = PostOp::Via::kOwner;
    const uint64_t token = pending_.add(op);
    if (!token) return post_failure();
    q.remote_addr = token;
    if (sequencer_.signal(q)) {
      send_signal_frame(token, id, s.remote_offset, s.add);
    } else {
      // Behind stream copies: they must complete (and be seen to) for it to leave.
      std::lock_guard<std::mutex> lk(post_mu_);
      mark_all_locked();
    }
    return Status::Ok();
  }
  op->via = PostOp::Via::kStream;
  op->counter = counter;
  op->lease_slot = rv.slot;
  op->lease_id = id;
  const uint64_t token = pending_.add(op);
  if (!token) return post_failure();
  std::unique_lock<std::mutex> lk(post_mu_);
  Status st = posts_stopped_ ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
  if (st.ok()) {
    try {
      int device = 0;
      if (!last_post_stream_ && cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
      op->stream = last_post_stream_ ? last_post_stream_ : post_stream(device);
      peer_access_locked(op->stream->device, rv.owner_device);
    } catch (const Error& e) {
      st = e.status();
    }
  }
  if (st.ok()) {
    q.remote_addr = token;
    // Behind PULL_WRITEs the owner has not answered: launched on the last answer.
    if (owner_seq_.signal(q)) st = launch_signal_locked(*op, token, false);
  }
  lk.unlock();
  if (!st.ok()) pending_.lane_done(token, st);
  return st;
}

Status NvlinkEndpoint::flush(std::chrono::milliseconds timeout) {
  // Posted while we wait, posts are marked at once (the core does not serialise flush with
  // posters).
  flushing_.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lk(post_mu_);
    mark_all_locked();
  }
  Status st = posts_.flush(timeout);
  flushing_.fetch_sub(1, std::memory_order_acq_rel);
  return st;
}

// The owner answered a post's PULL_WRITE or kSignal (control channel).
Status NvlinkEndpoint::owner_post_done(uint64_t token, const Status& st) {
  auto op = pending_.find(token);
  if (!op || !op->post) return {ErrorCode::kProtocol, "ack for an unknown operation"};
  auto& po = static_cast<PostOp&>(*op);
  if (po.via != PostOp::Via::kOwner) return {ErrorCode::kProtocol, "ack for a post the peer does not execute"};
  moved();
  if (!po.signal) owner_seq_.write_done(po.post_epoch, &ready_kernels_);
  op.reset();
  pending_.lane_done(token, st);
  for (const PostSignal& q : ready_kernels_) launch_deferred_signal(q.remote_addr);
  ready_kernels_.clear();
  return Status::Ok();
}

// A seq mark: passed once the kernel stored its seq. A kernel that faulted never stores it:
// after a millisecond the stream is asked (a CUDA call, off the fast path), and its error
// ends the mark.
cudaError_t NvlinkEndpoint::seq_mark_state(PostStream& ps, const PostStream::Mark& m) {
  if (__atomic_load_n(ps.done, __ATOMIC_ACQUIRE) >= m.seq) return cudaSuccess;
  if (std::chrono::steady_clock::now() - m.since < std::chrono::milliseconds(1)) return cudaErrorNotReady;
  return cudaStreamQuery(ps.stream);  // cudaSuccess: drained, the kernel finished
}

// Poller: completes the posts before every mark whose event fired, then sends the signal
// frames that were waiting for them.
bool NvlinkEndpoint::poll_posts() {
  if (post_marks_.load(std::memory_order_acquire) == 0) return false;
  {
    // Not while a poster holds the lock (a launch takes microseconds): blocking here would
    // make that poster wake us on its unlock, a system call on its path. The loop comes back.
    std::unique_lock<std::mutex> lk(post_mu_, std::try_to_lock);
    if (!lk.owns_lock()) return false;
    for (auto& ps : post_streams_) {
      while (!ps->marks.empty()) {
        PostStream::Mark& m = ps->marks.front();
        cudaError_t r = m.seq ? seq_mark_state(*ps, m) : m.event ? cudaEventQuery(m.event) : m.error;
        if (r == cudaErrorNotReady) break;
        if (r != cudaSuccess) cudaGetLastError();
        for (size_t i = 0; i < m.count && !ps->entries.empty(); ++i) {
          done_entries_.emplace_back(ps->entries.front(), r);
          ps->entries.pop();
        }
        if (m.event) give_event(ps->device, m.event);
        ps->marks.pop();
        post_marks_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }
  if (done_entries_.empty()) return false;
  pending_.touch();
  moved();
  for (const auto& [e, r] : done_entries_) {
    if (e.writes) sequencer_.write_done(e.epoch, &ready_frames_, e.writes);
    pending_.lane_done(e.token, r == cudaSuccess ? Status::Ok()
                                                 : Status{ErrorCode::kInternal, std::string("nvlink post: copy failed: ") +
                                                                                    cudaGetErrorString(r)});
  }
  done_entries_.clear();
  for (const PostSignal& q : ready_frames_) send_signal_frame(q.remote_addr, q.remote_id, q.remote_offset, q.add);
  ready_frames_.clear();
  return true;
}

// The endpoint fails or closes: every copy and kernel of ours finishes before any post is
// failed (the base fails them next, leaving their leases); nothing is enqueued after this.
void NvlinkEndpoint::stop_posts() {
  std::lock_guard<std::mutex> lk(post_mu_);
  posts_stopped_ = true;
  for (auto& ps : post_streams_) {
    cudaStreamSynchronize(ps->stream);
    while (!ps->marks.empty()) {
      if (ps->marks.front().event) give_event(ps->device, ps->marks.front().event);
      ps->marks.pop();
    }
    ps->entries.clear();
    ps->unmarked = 0;
    ps->unmarked_posts = 0;
  }
  unmarked_total_ = 0;
  post_marks_.store(0, std::memory_order_release);
  owner_seq_.clear();
}

}  // namespace sluice::detail::nvlink
