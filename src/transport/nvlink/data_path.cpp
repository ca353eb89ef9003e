// nvlink data path: submit resolves and leases the peer's regions an op touches, then enqueues
// its copies (merged per contiguous range, split over streams) on per-device streams, or moves
// host bytes with memcpy / CMA / PULL_WRITE; the streams and the event pool (see endpoint.hpp).
#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>

#include "cuda/copy_kernels.hpp"
#include "cuda/staging.hpp"
#include "transport/common/cma.hpp"
#include "transport/nvlink/endpoint.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail::nvlink {
namespace {

const RegionEntry* pin_of(const TransferOp& op, const uint8_t* p) {
  for (const auto& pin : op.pins) {
    const RegionEntry* e = pin.get();
    if (p >= e->base && p < e->base + e->length) return e;
  }
  return nullptr;
}

// Reads of a peer's host memory that is not mapped here (not a memfd: e.g. a torch pinned
// tensor) into local GPU memory: process_vm_readv into page-locked chunks, each uploaded while
// the next is read, in up to kStageLanes lanes (threads), each over a contiguous share of the
// op's pieces. One synchronous pageable copy per piece (a zero-filled scratch, then the
// driver's bounce buffers) ran at 3.1 GB/s on 1xH100 (docs/weights.md); this at 22 GB/s on
// 1xH200 (docs/mooncake-compat.md). Returns once every upload is done, also on failure:
// nothing writes the destinations after this returns.
constexpr uint64_t kStageChunk = 4ull << 20;
constexpr uint64_t kStageLaneMin = 16ull << 20;  // bytes a lane gets at least
constexpr uint64_t kStageLanes = 4;

Status staged_lane(pid_t pid, const std::vector<StagedRead>& work, int device, cudaStream_t s,
                   const std::function<Status()>& still) {
  std::shared_ptr<uint8_t> buf[2];
  cudaEvent_t done[2] = {nullptr, nullptr};
  Status st;
  try {
    cu::check(cudaSetDevice(device), "cudaSetDevice");
    for (int k = 0; k < 2; ++k) {
      buf[k] = staging::pinned(kStageChunk);
      cu::check(cudaEventCreateWithFlags(&done[k], cudaEventDisableTiming), "cudaEventCreate");
    }
    int k = 0;
    for (const StagedRead& r : work) {
      for (uint64_t off = 0; off < r.length && st.ok(); off += kStageChunk, k ^= 1) {
        const uint64_t m = std::min(kStageChunk, r.length - off);
        cu::check(cudaEventSynchronize(done[k]), "cudaEventSynchronize");  // the upload that last used buf[k]
        st = cma::read(pid, {{buf[k].get(), r.remote + off, m}});
        if (st.ok()) st = still();  // bytes of a region withdrawn meanwhile are not delivered
        if (!st.ok()) break;
        cu::check(cudaMemcpyAsync(r.local + off, buf[k].get(), m, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync (staged)");
        cu::check(cudaEventRecord(done[k], s), "cudaEventRecord");
      }
      if (!st.ok()) break;
    }
  } catch (const Error& e) {
    if (st.ok()) st = e.status();
  }
  try {
    cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize (staged read)");  // before the chunks go back to the pool
  } catch (const Error& e) {
    if (st.ok()) st = e.status();
  }
  for (cudaEvent_t ev : done)
    if (ev) cudaEventDestroy(ev);
  return st;
}

// Cuts `reads` into one contiguous share of about total / lanes bytes per lane (a piece may
// be split between two lanes) and runs the lanes; `stream_of(k)` is lane k's stream.
Status staged_read(pid_t pid, const std::vector<StagedRead>& reads, int device,
                   const std::function<cudaStream_t(int)>& stream_of, const std::function<Status()>& still) {
  uint64_t total = 0;
  for (const StagedRead& r : reads) total += r.length;
  const uint64_t lanes = std::clamp<uint64_t>(total / kStageLaneMin, 1, kStageLanes);
  const uint64_t share = (total + lanes - 1) / lanes;
  std::vector<std::vector<StagedRead>> work(lanes);
  size_t lane = 0;
  uint64_t room = share;
  for (StagedRead r : reads) {
    while (r.length > 0) {
      const uint64_t n = lane + 1 == lanes ? r.length : std::min(r.length, room);
      work[lane].push_back({r.local, r.remote, n});
      r.local += n;
      r.remote += n;
      r.length -= n;
      room -= std::min(room, n);
      if (room == 0 && lane + 1 < lanes) {
        ++lane;
        room = share;
      }
    }
  }
  std::vector<cudaStream_t> streams;
  for (uint64_t k = 0; k < lanes; ++k) streams.push_back(stream_of(static_cast<int>(k)));
  std::vector<Status> st(lanes);
  std::vector<std::thread> helpers;
  for (uint64_t k = 1; k < lanes; ++k)
    helpers.emplace_back([&, k] {
      ::sluice::detail::name_this_thread("sluice-stage");
      st[k] = staged_lane(pid, work[k], device, streams[k], still);
    });
  st[0] = staged_lane(pid, work[0], device, streams[0], still);
  for (auto& t : helpers) t.join();
  for (const Status& s : st)
    if (!s.ok()) return s;
  return Status::Ok();
}

}  // namespace

void NvlinkEndpoint::submit(std::shared_ptr<TransferOp> op) {
  uint64_t token = pending_.add(op);
  if (!token) return;
  // An op of no lanes completes in one step (finish_all), not through the lane count.
  for (const Lane& l : op->lanes)
    if (!l.pieces.empty()) {
      track_lanes(token, *op);
      break;
    }
  start(op, token, false);
}

// Resolves, leases and enqueues the op's copies. On the submitting thread (background false)
// only peer regions already described are used: an op that needs another is handed to the
// poller, which describes it and calls this again (background true); see peer_view.cpp.
void NvlinkEndpoint::start(const std::shared_ptr<TransferOp>& op, uint64_t token, bool background) {
  Inflight f;
  f.op = op;
  f.token = token;
  for (auto& l : op->lanes) f.lanes += l.pieces.empty() ? 0 : 1;
  f.leases = std::make_shared<LeaseHold>();
  f.leases->leases = &leases_;
  // The caller's stream travels with the op (the core admitted it: stream_ordered).
  auto* user = static_cast<cudaStream_t>(op->options.cuda_stream);
  Status st = failed() ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
  std::unordered_map<uint64_t, RemoteView> views;
  bool missing = false;
  if (st.ok()) st = resolve(*op, &f.device, &views, background, &missing);
  if (st.ok() && missing) {
    if (!user) {
      std::unique_lock<std::mutex> lk(mu_);
      if (!stop_) {
        deferred_.emplace_back(op, token);
        has_work_.store(true, std::memory_order_release);
        lk.unlock();
        cv_.notify_one();
        return;
      }
      lk.unlock();
      st = {ErrorCode::kCancelled, "endpoint closed"};
    } else {
      // Its copies must be enqueued on the caller's stream now, in the caller's order.
      st = {ErrorCode::kUnknownHandle,
            "nvlink: a peer region of this stream-ordered op is not mapped here yet (the peer's regions are "
            "described after connect/accept in the background); call refresh_remote_regions() first"};
    }
  }
  if (st.ok()) st = hold_leases(views, *f.leases);
  if (st.ok()) st = enqueue(*op, user, &f, views);
  if (!st.ok() || f.events.empty()) {
    for (auto e : f.events) {
      cudaEventSynchronize(e);
      give_event(f.device, e);
    }
    f.events.clear();
    if (st.ok() && op->kind == OpKind::kRead) st = f.leases->still();
    settle(f, st);
    return;
  }
  // Small ops: wait here a moment, so that the caller's Future is already complete (no
  // thread hand-off on the latency path). Never with a user stream: its earlier work may
  // take any time; never on the poller. Not where waiters complete their own ops: the
  // submitting thread polling here was measured slower than returning and letting the
  // waiter poll (2xH200, 8 B: 11.2 against 9.8 us; raw copy + sync 7.7; docs/peers.md).
  if (!user && !background && !waiters_complete_ && op->bytes <= inline_max_) {
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
    while (std::chrono::steady_clock::now() < until) {
      if (events_done(f) != cudaErrorNotReady) break;
    }
    cudaError_t e = events_done(f);
    if (e != cudaErrorNotReady) {
      complete(f, e);
      return;
    }
  }
  if (poll_waiters_ && !background) {  // on the poller the caller may be waiting already
    // ~300 GB/s over NVLink, plus the completion path; at most 2 ms.
    uint64_t us = std::min<uint64_t>(op->bytes / 300000 + 30, 2000);
    op->future->set_busy_wait(std::chrono::microseconds(us));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    inflight_.push_back(std::move(f));
    has_work_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
}

// The device that drives the op's copies: its first local cuda piece's, else the current one.
int NvlinkEndpoint::op_device(const TransferOp& op) {
  for (const Lane& lane : op.lanes)
    for (const Piece& p : lane.pieces) {
      int d = local_device(op, p.local);
      if (d >= 0) return d;
    }
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

// Every peer region the op touches, as its owner described it, with each piece checked
// against it. Without may_block only regions already described are used: *missing says
// that one is not (describing it waits for the peer).
Status NvlinkEndpoint::resolve(const TransferOp& op, int* device, std::unordered_map<uint64_t, RemoteView>* out,
                               bool may_block, bool* missing) {
  try {
    *device = op_device(op);
    for (const Lane& lane : op.lanes)
      for (const Piece& p : lane.pieces) {
        auto it = out->find(p.remote_id);
        if (it == out->end()) {
          RemoteView rv;
          if (!cached_view(p.remote_id, &rv, nullptr)) {
            if (!may_block) {
              *missing = true;
              return Status::Ok();
            }
            rv = view(p.remote_id, *device);
          }
          it = out->emplace(p.remote_id, std::move(rv)).first;
        }
        if (!in_bounds(p.remote_offset, p.length, it->second.length))
          return {ErrorCode::kOutOfRange, "peer region " + std::to_string(p.remote_id) + " is " +
                                              std::to_string(it->second.length) + " bytes (as its owner describes it); " +
                                              std::to_string(p.length) + " bytes at offset " +
                                              std::to_string(p.remote_offset) + " do not fit"};
      }
    return Status::Ok();
  } catch (const Error& e) {
    return e.status();
  }
}

Status NvlinkEndpoint::hold_leases(const std::unordered_map<uint64_t, RemoteView>& views, LeaseHold& h) {
  for (const auto& [id, v] : views) {
    if (v.slot == kNoLease || !leases_.enter(v.slot, id)) {
      Status st{ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + " is no longer registered"};
      forget_region(id, st);
      return st;
    }
    h.slots.push_back(v.slot);
    h.ids.push_back(id);
  }
  return Status::Ok();
}

cudaStream_t NvlinkEndpoint::stream(int device, size_t lane) {
  std::lock_guard<std::mutex> lk(res_mu_);
  auto& s = streams_[{device, lane}];
  if (!s) {
    cu::check(cudaSetDevice(device), "cudaSetDevice");
    cu::check(cu::load_kernels(), "loading the copy kernels");  // before any user kernel spins (copy_kernels.hpp)
    cu::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  return s;
}

cudaEvent_t NvlinkEndpoint::take_event(int device) {
  std::lock_guard<std::mutex> lk(res_mu_);
  auto& pool = event_pool_[device];
  if (!pool.empty()) {
    auto e = pool.back();
    pool.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  cu::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}

void NvlinkEndpoint::give_event(int device, cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(res_mu_);
  event_pool_[device].push_back(e);
}

// The device of local address p (from the op's pins), or -1 for host memory.
int NvlinkEndpoint::local_device(const TransferOp& op, const uint8_t* p) {
  for (const auto& pin : op.pins) {
    const RegionEntry* e = pin.get();
    if (p >= e->base && p < e->base + e->length) return e->location.is_host() ? -1 : e->location.device;
  }
  return cu::pointer_device(p);
}

namespace {

// The op's pieces as copies: pieces contiguous on both sides are merged back into one copy
// (the core cut them for stream transports).
std::vector<Seg> merged_segs(const TransferOp& op) {
  std::vector<Seg> segs;
  for (const Lane& lane : op.lanes)
    for (const Piece& p : lane.pieces) segs.push_back({p.local, p.remote_id, p.remote_offset, p.length});
  if (op.lanes.size() > 1)
    std::sort(segs.begin(), segs.end(), [](const Seg& a, const Seg& b) {
      return a.remote_id != b.remote_id ? a.remote_id < b.remote_id : a.remote_offset < b.remote_offset;
    });
  std::vector<Seg> merged;
  for (const Seg& g : segs) {
    if (!merged.empty()) {
      Seg& m = merged.back();
      if (m.remote_id == g.remote_id && m.remote_offset + m.length == g.remote_offset && m.local + m.length == g.local) {
        m.length += g.length;
        continue;
      }
    }
    merged.push_back(g);
  }
  return merged;
}

}  // namespace

// One enqueue() call: what its copy cases share, and what they leave for its last steps.
struct CopyPlan {
  const TransferOp* op = nullptr;
  cudaStream_t user = nullptr;  // the caller's stream, if the op has one
  int device = 0;
  bool write = false;
  bool local_cuda = false;      // some copy has a local cuda side
  int nstreams = 1;
  pid_t pid = 0;
  std::vector<bool> used;       // the streams (of nstreams) that got copies: one event each
  std::vector<cma::Span> spans;  // CMA reads, done together
  std::vector<StagedRead> staged_reads;  // CMA reads into local GPU memory, done together
  std::vector<same_host::PullPiece> pulls;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> staged;
  std::vector<std::shared_ptr<void>> keep;  // pinned mappings async copies use (Inflight::keep)
  int next = 0;                 // the stream of the next cuda copy
};

// Enqueue every copy of the op (its regions resolved and leased in `views`): pieces
// contiguous on both sides are merged back into one copy (the core cut them for stream
// transports), large copies are split over SLUICE_NVLINK_STREAMS streams. Appends one event
// per stream used to f->events (none when everything completed synchronously).
Status NvlinkEndpoint::enqueue(const TransferOp& op, cudaStream_t user, Inflight* f,
                               const std::unordered_map<uint64_t, RemoteView>& views) {
  CopyPlan c;
  try {
    c.op = &op;
    c.user = user;
    c.write = op.kind != OpKind::kRead;
    const std::vector<Seg> merged = merged_segs(op);
    c.device = f->device;
    for (const Seg& g : merged) c.local_cuda |= local_device(op, g.local) >= 0;
    cu::check(cudaSetDevice(c.device), "cudaSetDevice");
    c.nstreams = user ? 1 : nstreams_;
    c.used.assign(c.nstreams, false);
    c.pid = pid_.load();
    for (const Seg& g : merged) {
      // resolve() checked every piece against the described region; merging keeps that.
      const RemoteView& rv = views.at(g.remote_id);
      if (rv.host && rv.ptr) {
        copy_mapped_host(c, g, rv);
      } else if (rv.host) {
        Status st = copy_unmapped_host(c, g, rv, *f);
        if (!st.ok()) return st;
      } else {
        copy_cuda(c, g, rv);
      }
    }
    if (!c.spans.empty()) {  // reads only: writes into such memory are pulled by its owner
      Status st = cma::read(c.pid, c.spans);
      if (!st.ok()) return st;
    }
    if (!c.staged_reads.empty()) {
      // On the caller's stream if the op has one (its order kept), else on lanes of our own.
      Status st = staged_read(
          c.pid, c.staged_reads, c.device, [&](int k) { return c.user ? c.user : stream(c.device, static_cast<size_t>(k)); },
          [f] { return f->leases->still(); });
      if (!st.ok()) return st;
    }
    for (int k = 0; k < c.nstreams; ++k) {
      if (!c.used[k]) continue;
      cudaEvent_t e = take_event(c.device);
      f->events.push_back(e);
      cu::check(cudaEventRecord(e, stream_at(c, k)), "cudaEventRecord");
    }
    if (!c.pulls.empty()) post_pulls(f, c.pulls, std::move(c.staged));
    f->keep = std::move(c.keep);
    return Status::Ok();
  } catch (const Error& e) {
    // Copies enqueued before the failure may still read or write the mappings: they stay
    // mapped until those copies ended (the op fails once this returns).
    if (!c.keep.empty())
      for (int k = 0; k < c.nstreams; ++k)
        if (k < static_cast<int>(c.used.size()) && c.used[k]) (void)cudaStreamSynchronize(stream_at(c, k));
    return e.status();
  }
}

// The stream for the plan's k-th lane of copies: the caller's, if the op has one.
cudaStream_t NvlinkEndpoint::stream_at(const CopyPlan& c, int k) {
  return c.user ? c.user : stream(c.device, static_cast<size_t>(k));
}

// Copy case: the peer's memfd memory is mapped here: a plain memcpy, or a copy from / to the GPU.
void NvlinkEndpoint::copy_mapped_host(CopyPlan& c, const Seg& g, const RemoteView& rv) {
  uint8_t* remote = rv.ptr + g.remote_offset;
  if (!c.local_cuda || local_device(*c.op, g.local) < 0) {
    if (c.write) std::memcpy(remote, g.local, g.length);
    else std::memcpy(g.local, remote, g.length);
  } else {
    // From page-locked memory the copy engine runs at full speed and asynchronously (pageable
    // memory goes through the driver's bounce buffers); the op then keeps the mapping.
    if (pin_host_ && rv.mapping && rv.mapping->pin()) c.keep.push_back(rv.keep);
    cudaStream_t s = stream_at(c, 0);
    c.used[0] = true;
    cu::check(cudaMemcpyAsync(c.write ? remote : g.local, c.write ? g.local : remote, g.length, cudaMemcpyDefault, s),
              "cudaMemcpyAsync");
  }
}

// Copy case: the peer's host memory is not mapped here. Writes become PULL_WRITE pieces,
// reads into host memory CMA spans; reads into local GPU memory are staged through host
// memory now. Throws Error (cuda).
Status NvlinkEndpoint::copy_unmapped_host(CopyPlan& c, const Seg& g, const RemoteView& rv, Inflight& f) {
  const uint64_t at = rv.addr + g.remote_offset;  // the owner's address, as it described it
  const bool here_cuda = c.local_cuda && local_device(*c.op, g.local) >= 0;
  if (c.write) {
    same_host::PullPiece pp{g.remote_id, g.remote_offset, g.length, reinterpret_cast<uint64_t>(g.local), 0, kNoLease, 0};
    if (here_cuda) {
      // The owner pulls a host copy of our cuda bytes, kept until it answered.
      cudaStream_t s = stream_at(c, 0);
      auto tmp = std::make_shared<std::vector<uint8_t>>(g.length);
      cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      cu::check(cudaMemcpy(tmp->data(), g.local, g.length, cudaMemcpyDefault), "cudaMemcpy");
      pp.src_addr = reinterpret_cast<uint64_t>(tmp->data());
      c.staged.push_back(std::move(tmp));
    } else if (const RegionEntry* e = pin_of(*c.op, g.local)) {
      pp.src_region = e->id;  // the owner holds our lease on it while it copies
      pp.src_slot = e->lease_slot;
    }
    c.pulls.push_back(pp);
    return Status::Ok();
  }
  if (!here_cuda) {
    c.spans.push_back({g.local, at, g.length});
    return Status::Ok();
  }
  // Local GPU, remote host: staged through page-locked chunks, all of the op's such pieces
  // together once every copy is enqueued (staged_read).
  c.staged_reads.push_back({g.local, at, g.length});
  return Status::Ok();
}

// Copy case: cuda memory of the peer, mapped here; large copies are split over the streams.
void NvlinkEndpoint::copy_cuda(CopyPlan& c, const Seg& g, const RemoteView& rv) {
  uint8_t* remote = rv.ptr + g.remote_offset;
  // Our side in host memory: an engine-allocated (memfd) region is page-locked once, on its
  // first copy (from pageable memory the copy runs through the driver's bounce buffers, at a
  // tenth of the copy engine's speed: a trainer pushing out of WeightPublisher.share()'s block).
  if (pin_host_ && local_device(*c.op, g.local) < 0)
    if (const RegionEntry* e = pin_of(*c.op, g.local); e && e->memfd >= 0) host_.pin_local(*e);
  uint8_t* dst = c.write ? remote : g.local;
  const uint8_t* src = c.write ? g.local : remote;
  int parts = g.length >= split_min_ ? c.nstreams : 1;
  uint64_t step = (g.length / parts + 4095) / 4096 * 4096;
  for (uint64_t off = 0; off < g.length; off += step) {
    uint64_t n = std::min(step, g.length - off);
    int k = c.next++ % c.nstreams;
    cudaStream_t s = stream_at(c, k);
    c.used[k] = true;
    if (c.local_cuda && n <= sm_copy_max_)
      cu::check(cu::sm_copy(dst + off, src + off, n, s), "sm_copy");
    else
      cu::check(cudaMemcpyAsync(dst + off, src + off, n, cudaMemcpyDefault, s), "cudaMemcpyAsync");
  }
}

// Last step of enqueue: the owner is asked to pull `pulls` (at most kMaxPullPieces a frame).
void NvlinkEndpoint::post_pulls(Inflight* f, const std::vector<same_host::PullPiece>& pulls,
                                std::vector<std::shared_ptr<std::vector<uint8_t>>> staged) {
  auto p = std::make_shared<PullState>();
  p->staged = std::move(staged);
  p->frames_left = static_cast<int>((pulls.size() + same_host::kMaxPullPieces - 1) / same_host::kMaxPullPieces);
  f->pull = p;
  {
    std::lock_guard<std::mutex> lk(pull_mu_);
    pulls_[f->token] = p;
  }
  for (size_t first = 0; first < pulls.size(); first += same_host::kMaxPullPieces) {
    auto buf = std::make_shared<std::vector<same_host::PullPiece>>(
        pulls.begin() + first, pulls.begin() + std::min(pulls.size(), first + same_host::kMaxPullPieces));
    OutFrame fr;
    fr.hdr = make_frame(FrameType::kPullWrite, f->token, 0, 0, buf->size() * sizeof(same_host::PullPiece));
    fr.data = reinterpret_cast<const uint8_t*>(buf->data());
    fr.keep = buf;
    control_->post(std::move(fr));
  }
}

}  // namespace sluice::detail::nvlink
