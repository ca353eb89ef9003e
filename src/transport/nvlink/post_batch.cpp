// nvlink's batched thin post path (TransportEndpoint::post_batch; the port channel's proxy
// posts what it popped this way). One post at a time costs a copy-engine job per write and a
// signal kernel per signal, about 11 us a put+signal on H200 (docs/port-channel.md). Here a
// run of posts becomes ONE kernel launch on the post stream: each small write is an SM copy
// inside it, and its signals are raised by its last block once every copy of the launch is
// visible system-wide (cuda/post_batch_kernel.cu). A signal thus never overtakes a write
// before it, as with the single calls; it may wait for writes after it in the same launch,
// which the contract allows.
//
// What does not fit the kernel goes exactly as the single call would send it, after the run
// collected so far is launched, so stream order keeps every earlier post ahead of it:
//  - a write larger than nvlink.post_sm_copy_max, from host memory, into peer host memory,
//    or from another device than the run's: a copy-engine job (post_write);
//  - a signal into peer host memory (an owner's kSignal frame), or one while writes the owner
//    executes (PULL_WRITE) are unanswered (owner_seq_ must hold it back): post_signal.
// A run is ONE PostOp and token for all its posts (its pins, one lease per post, the count
// of posts), not one per post: that bookkeeping, taken twice per post against the poller
// completing them, was most of the proxy's time at 0.2 M requests/s (docs/port-channel.md).
// Each post still counts against post.depth, and completion (the kernel's own mark, see
// post_path.hpp), flush, failure and the region leases are those of the single calls for
// every post of the run. A post that finds post.depth full while the run holds admitted
// posts launches the run first (those posts can only finish once launched), then waits.
#include "transport/nvlink/endpoint.hpp"

namespace sluice::detail::nvlink {

// A kernel on `from` can dereference memory of device `to` (cached per pair).
bool NvlinkEndpoint::sm_reach_locked(int from, int to) {
  if (from == to) return from >= 0;
  if (from < 0 || to < 0 || from >= 64 || to >= 64) return false;
  const uint64_t bit = uint64_t(1) << to;
  if (!(peer_known_[from] & bit)) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess) {
      cudaGetLastError();
      can = 0;
    }
    if (can) peer_reach_[from] |= bit;
    peer_known_[from] |= bit;
  }
  return (peer_reach_[from] & bit) != 0;
}

// Room for one more post, without waiting while the run holds admitted posts (they finish
// only once launched): kTimeout with a non-empty run means "launch it, then come back".
Status NvlinkEndpoint::batch_admit(std::chrono::milliseconds timeout, size_t) {
  if (!group_.empty()) return posts_.admit(std::chrono::milliseconds(0));
  return posts_.admit(timeout);
}

// Admits one more post and enters the peer region's lease, as both batch_write and
// batch_signal must before they add to the run: kAdded when both are held, else what the
// caller returns (kLaunchFirst: launch the run and come back; kSingle with *st set: failed).
NvlinkEndpoint::Batched NvlinkEndpoint::batch_enter(const RemoteView& rv, uint64_t id, std::chrono::milliseconds timeout,
                                                    size_t index, Status* st) {
  if (Status a = batch_admit(timeout, index); !a.ok()) {
    if (a.code == ErrorCode::kTimeout && !group_.empty()) return Batched::kLaunchFirst;
    *st = a;
    return Batched::kSingle;
  }
  if (rv.slot == kNoLease || !leases_.enter(rv.slot, id)) {
    posts_.cancel();
    forget_region(id, gone(id));
    *st = gone(id);
    return Batched::kSingle;
  }
  return Batched::kAdded;
}

// The run's op, taken at its first post (post_mu_ held).
void NvlinkEndpoint::group_join_locked(PostStream* ps, size_t index) {
  if (!group_.empty()) return;
  group_.stream = ps;
  group_.first_item = index;
  group_.op = take_post();
  group_.op->bytes = 0;
}

// A post that entered its lease and was admitted but cannot join the run after all.
void NvlinkEndpoint::batch_leave(uint32_t slot, const Status& st) {
  leases_.leave(slot);
  posts_.done(st);
}

NvlinkEndpoint::Batched NvlinkEndpoint::batch_write(PostWrite& w, const RemoteView& rv,
                                                    std::chrono::milliseconds timeout, size_t index, Status* st) {
  const RegionEntry* src = w.pin.get();
  const uint64_t id = w.dst.remote_id, off = w.dst.remote_offset, n = w.dst.length;
  // An SM copy reads our GPU memory and writes the peer's GPU memory mapped here.
  if (src->location.is_host() || rv.host || !rv.ptr || n > post_sm_copy_max_) return Batched::kSingle;
  const int device = src->location.device;
  // Admitted first, so that the rest takes post_mu_ once (a post that turns out not to fit
  // the run leaves again: rare).
  if (Batched b = batch_enter(rv, id, timeout, index, st); b != Batched::kAdded) return b;
  std::unique_lock<std::mutex> lk(post_mu_);
  if ((!group_.empty() && group_.stream->device != device) || !sm_reach_locked(device, rv.owner_device)) {
    lk.unlock();
    batch_leave(rv.slot, Status::Ok());
    return Batched::kSingle;
  }
  Status s = posts_stopped_ ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
  PostStream* ps = nullptr;
  if (s.ok()) {
    try {
      ps = post_stream(device);
    } catch (const Error& e) {
      s = e.status();
    }
  }
  if (!s.ok()) {
    lk.unlock();
    batch_leave(rv.slot, s);
    *st = s;
    return Batched::kSingle;
  }
  peer_access_locked(device, rv.owner_device);
  group_join_locked(ps, index);
  PostOp& op = *group_.op;
  group_.args.copy[group_.args.copies++] = cuda::BatchCopy{w.src, rv.ptr + off, n};
  op.pins.push_back(std::move(w.pin));
  op.leases.push_back(rv.slot);
  op.bytes += n;
  ++group_.posts;
  ++group_.writes;
  last_post_stream_ = ps;
  return Batched::kAdded;
}

NvlinkEndpoint::Batched NvlinkEndpoint::batch_signal(const PostSignal& s, const RemoteView& rv,
                                                     std::chrono::milliseconds timeout, size_t index, Status* st) {
  // A counter in host memory is raised by its owner (a frame); a signal behind unanswered
  // PULL_WRITEs waits in owner_seq_: both as post_signal does it.
  if (rv.host || !owner_seq_.idle()) return Batched::kSingle;
  if (Batched b = batch_enter(rv, s.remote_id, timeout, index, st); b != Batched::kAdded) return b;
  std::unique_lock<std::mutex> lk(post_mu_);
  PostStream* ps = posts_stopped_ ? nullptr : group_.empty() ? last_post_stream_ : group_.stream;
  if (!ps && !posts_stopped_) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
    try {
      ps = post_stream(device);
    } catch (const Error&) {
      ps = nullptr;
    }
  }
  if (!ps) {  // closed, or no stream: post_signal reports it
    lk.unlock();
    batch_leave(rv.slot, Status::Ok());
    return Batched::kSingle;
  }
  peer_access_locked(ps->device, rv.owner_device);
  group_join_locked(ps, index);
  group_.op->leases.push_back(rv.slot);
  group_.op->bytes += 8;
  ++group_.posts;
  // Signals of a launch are all raised after all its copies, so consecutive ones into one
  // counter are one atomic (a port channel's run of put+signals: 64 remote atomics on one
  // address, serialized, were the batch kernel's tail).
  auto* counter = reinterpret_cast<uint64_t*>(rv.ptr + s.remote_offset);
  if (group_.args.signals > 0 && group_.args.signal[group_.args.signals - 1].counter == counter)
    group_.args.signal[group_.args.signals - 1].add += s.add;
  else
    group_.args.signal[group_.args.signals++] = cuda::BatchSignal{counter, s.add};
  return Batched::kAdded;
}

// Launches the run collected so far, as one op. On failure its posts finish with the error
// (flush reports it too, as for a single post that failed) and *failed_at is the batch index
// of its first post: none of the run was posted.
Status NvlinkEndpoint::launch_group(size_t* failed_at, bool mark_now) {
  if (group_.empty()) return Status::Ok();
  std::shared_ptr<PostOp> op = group_.op;
  op->kind = OpKind::kWrite;
  op->via = PostOp::Via::kStream;
  op->stream = group_.stream;
  op->posts = group_.posts;
  const uint64_t token = pending_.add(op);
  if (!token) {  // the endpoint failed: add() finished the op (leases left, posts done)
    *failed_at = group_.first_item;
    group_.clear();
    return post_failure();
  }
  std::unique_lock<std::mutex> lk(post_mu_);
  Status st = launch_group_locked(token, mark_now);
  lk.unlock();
  if (!st.ok()) {
    pending_.lane_done(token, st);
    *failed_at = group_.first_item;
  }
  group_.clear();
  return st;
}

Status NvlinkEndpoint::launch_group_locked(uint64_t token, bool mark_now) {
  PostStream& ps = *group_.stream;
  Status st = posts_stopped_ ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
  // Signals also wait for copies before them on other devices' post streams.
  if (st.ok() && group_.args.signals > 0) st = wait_other_streams_locked(ps);
  uint64_t epoch = 0;
  if (st.ok()) {
    DeviceScope scope(ps.device);
    if (!ps.arrivals) {
      // Stream-ordered, so that it never waits for a user's kernel spinning on the device.
      void* p = nullptr;
      st = cuda_status(cudaMallocAsync(&p, sizeof(unsigned), ps.stream), "cudaMallocAsync");
      if (st.ok()) st = cuda_status(cudaMemsetAsync(p, 0, sizeof(unsigned), ps.stream), "cudaMemsetAsync");
      if (st.ok()) ps.arrivals = static_cast<unsigned*>(p);
    }
    if (st.ok()) {
      // A signal frame posted after these writes waits for them (the sequencer); posters are
      // serialised, so no such frame came between the run's writes.
      if (group_.writes) epoch = sequencer_.write_posted(group_.writes);
      const uint64_t seq = ps.launched + 1;
      st = cuda_status(cuda::post_batch(group_.args, ps.arrivals, ps.done, seq, ps.stream), "batch kernel");
      if (st.ok()) ps.launched = seq;
      ps.tail_seq = st.ok() && ps.done ? seq : 0;
      if (!st.ok() && group_.writes) sequencer_.write_dropped(epoch, group_.writes);
    }
  }
  if (!st.ok()) return st;
  ps.entries.push({token, epoch, group_.writes});
  ++ps.unmarked;
  ps.unmarked_posts += group_.posts;
  unmarked_total_ += group_.posts;
  last_post_stream_ = &ps;
  if (mark_now || unmarked_total_ >= mark_every_ || flushing_.load(std::memory_order_acquire) > 0) mark_all_locked();
  return Status::Ok();
}

size_t NvlinkEndpoint::post_batch(std::span<PostItem> items, std::chrono::milliseconds timeout, Status* error) {
  if (!post_batching_) return TransportEndpoint::post_batch(items, timeout, error);
  group_.clear();
  size_t failed_at = 0;
  for (size_t i = 0; i < items.size();) {
    PostItem& it = items[i];
    // A full run is launched before the next post joins it.
    if (group_.args.copies == cuda::kBatchCopies || group_.args.signals == cuda::kBatchSignals) {
      if (Status ls = launch_group(&failed_at, false); !ls.ok()) {
        *error = ls;
        return failed_at;
      }
    }
    RemoteView rv;
    Status st = it.signal ? check_signal(it.sig, &rv) : check_write(it.write, &rv);
    Batched how = Batched::kSingle;
    if (st.ok())
      how = it.signal ? batch_signal(it.sig, rv, timeout, i, &st) : batch_write(it.write, rv, timeout, i, &st);
    if (st.ok() && how == Batched::kAdded) {
      ++i;
      continue;
    }
    // post.depth is full of this run's own posts: launch (and mark) it, then admit again.
    const bool retry = st.ok() && how == Batched::kLaunchFirst;
    if (Status ls = launch_group(&failed_at, retry); !ls.ok()) {
      *error = ls;
      return failed_at;
    }
    if (retry) continue;
    // Not for the kernel, or failed: posted alone, behind the run just launched.
    if (st.ok()) st = it.signal ? post_signal(it.sig, timeout) : post_write(std::move(it.write), timeout);
    if (!st.ok()) {
      *error = st;
      return i;
    }
    ++i;
  }
  if (Status ls = launch_group(&failed_at, false); !ls.ok()) {
    *error = ls;
    return failed_at;
  }
  return items.size();
}

}  // namespace sluice::detail::nvlink
