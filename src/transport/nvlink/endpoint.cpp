// nvlink endpoint set-up and teardown: proving ourselves to the peer (active side) or taking
// its proof (passive side), attach, describing our regions to the proven peer, per-op
// deadlines, close and failure (see endpoint.hpp).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/log.hpp"
#include "core/params.hpp"
#include "transport/nvlink/endpoint.hpp"
#include "transport/nvlink/local_pins.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail::nvlink {
namespace {

const Param<uint64_t> kSmCopyMax{"nvlink.sm_copy_max", "SLUICE_NVLINK_SM_COPY_MAX", 0, size_in(0, 1ull << 40),
                                  "copies up to this size from local GPU memory use an SM kernel, not the copy engine; 0 = off"};
const Param<int> kStreams{"nvlink.streams", "SLUICE_NVLINK_STREAMS", 1, int_in(1, 16),
                          "copy streams per endpoint; copies of at least nvlink.split_min are split over them"};
const Param<uint64_t> kSplitMin{"nvlink.split_min", "SLUICE_NVLINK_SPLIT_MIN", 8ull << 20, size_in(1, 1ull << 40),
                                "copies at least this large are split over nvlink.streams streams"};
const Param<uint64_t> kInlineMax{"nvlink.inline_max", "SLUICE_NVLINK_INLINE_MAX", 64ull << 10, size_in(0, 1ull << 30),
                                 "where waiters do not complete their own ops (nvlink.waiters_poll), ops up to this size "
                                 "are polled to completion on the submitting thread (no hand-off)"};

const Param<bool> kPinHostMappings{"nvlink.pin_host_mappings", "SLUICE_NVLINK_PIN_HOST_MAPPINGS", true, boolean(),
                                   "a peer's memfd host region mapped here, and our own engine-allocated host region, is "
                                   "page-locked for CUDA (cudaHostRegister) on its first copy to or from a GPU if all its "
                                   "pages are in memory, so those copies run at copy-engine speed and asynchronously; "
                                   "false = pageable copies"};
const Param<bool> kWaitersPoll{"nvlink.waiters_poll", "SLUICE_NVLINK_WAITERS_POLL", true, boolean(),
                               "where waiters may poll (engine busy_wait > 0), a thread waiting for an op queries its "
                               "copies' events and completes it itself, without waiting for the poller thread to wake; "
                               "false = the poller completes every op above nvlink.inline_max"};
const Param<int> kPollerSpin{"nvlink.poller_spin_us", "SLUICE_NVLINK_POLLER_SPIN_US", 200, int_in(0, 1000000),
                             "the endpoint's poller thread keeps polling this long after its last op before it "
                             "sleeps (an op submitted meanwhile costs no wake-up; a core while it polls)"};
const Param<bool> kPostBatch{"nvlink.post_batch", "SLUICE_NVLINK_POST_BATCH", true, boolean(),
                             "thin post path: post_batch (the port channel's proxy) turns a run of small writes and "
                             "their signals into one kernel; false = one copy-engine job or signal kernel per post"};
const Param<uint64_t> kPostSmCopyMax{"nvlink.post_sm_copy_max", "SLUICE_NVLINK_POST_SM_COPY_MAX", 64 << 10,
                                      size_in(0, 1ull << 30),
                                      "thin post path: in post_batch, writes from local GPU memory into the peer's GPU "
                                      "memory up to this size are SM copies inside the batch kernel, larger ones "
                                      "copy-engine jobs; 0 = every write on the copy engine (signals still batched)"};

}  // namespace


bool HostMapping::pin() {
  std::call_once(pin_once_, [this] {
    if (int64_t absent = absent_pages(base, length); absent != 0) {
      SLUICE_LOG(kInfo, "nvlink: a peer's mapped host region of " << length << " bytes is not page-locked: "
                            << (absent < 0 ? std::string("mincore failed") : std::to_string(absent) + " of its pages are not in memory")
                            << "; copies between it and the GPU stay pageable");
      return;
    }
    cudaError_t e = cudaHostRegister(base, length, cudaHostRegisterPortable);
    pinned_ = e == cudaSuccess;
    if (!pinned_) {
      (void)cudaGetLastError();  // not sticky, but leave no error for the next call to find
      SLUICE_LOG(kWarn, "nvlink: cannot page-lock a peer's mapped host region of " << length << " bytes ("
                      << cudaGetErrorString(e) << "); copies between it and the GPU stay pageable (slower)");
    }
  });
  return pinned_;
}

HostMapping::~HostMapping() {
  if (pinned_) (void)cudaHostUnregister(base);  // at exit CUDA may be gone already: nothing to do then
  if (base) ::munmap(base, length);
}

NvlinkEndpoint::NvlinkEndpoint(const EndpointSetup& s, NvlinkHost& host, std::string peer_socket)
    : EndpointBase(s), host_(host), active_(s.active), token_(s.token), peer_socket_(std::move(peer_socket)),
      peer_engine_(s.peer.engine_id), timeout_(s.config.connect_timeout) {
  sm_copy_max_ = kSmCopyMax.get(s.config);
  nstreams_ = kStreams.get(s.config);
  split_min_ = kSplitMin.get(s.config);
  inline_max_ = kInlineMax.get(s.config);
  poller_spin_ = std::chrono::microseconds(kPollerSpin.get(s.config));
  pin_host_ = kPinHostMappings.get(s.config);
  post_batching_ = kPostBatch.get(s.config);
  post_sm_copy_max_ = kPostSmCopyMax.get(s.config);
  // Where the engine lets waiters poll (spare cores), let them poll for about as long as
  // the copy should take, as cudaStreamSynchronize does: a sleeping waiter wakes late.
  poll_waiters_ = busy_wait_of(s.config).count() > 0;
  waiters_complete_ = poll_waiters_ && kWaitersPoll.get(s.config);
  // A mark every few posts, never more than the depth: a poster held back by post.depth
  // waits for a post that a mark will complete.
  mark_every_ = std::min<size_t>(16, post_depth(s.config));
  pending_.set_post_handler([this](const std::shared_ptr<TransferOp>& op, const Status& st) { post_finished(op, st); });
  for (const auto& r : s.peer.regions) known_.push_back(r.info.id);
  poller_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-nvlink");
    poll();
  });
}

void NvlinkEndpoint::connect(const ChannelOpener& open) {
  // Prove ourselves on the peer's same-host socket and learn from the kernel which process
  // answers; only then ask the listener to complete the endpoint.
  same_host::Proof proof = same_host::prove(peer_socket_, token_, host_.engine_id(), host_.lease_fd(), peer_engine_,
                                            same_host::Clock::now() + timeout_, "nvlink");
  FdGuard guard{proof.lease_fd};
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (!leases_.map_fd(proof.lease_fd))
      throw Error(ErrorCode::kProtocol, "nvlink: the peer did not pass a lease table (a memfd) on its same-host socket");
  }
  proven(proof.cred.pid);
  install(std::move(proof.sock));
  // Describe the peer's regions now, on the connecting thread (connect is allowed to wait for
  // the peer), so that no submit has to (peer_view.cpp).
  resolve_known();
  open(0, nlohmann::json::object());
}

nlohmann::json NvlinkEndpoint::attach(int index, const nlohmann::json&) {
  // The listener's channel only completes the endpoint: the peer must already have proven
  // on our Unix socket that it is a process on this host (a remote peer never can).
  if (index != 0) throw Error(ErrorCode::kProtocol, "nvlink takes one channel");
  if (!authenticated_.load())
    throw Error(ErrorCode::kProtocol, "nvlink: the peer has not proven that it is a process on this host "
                                      "(no authenticated same-host socket for this endpoint)");
  return nlohmann::json::object();
}

bool NvlinkEndpoint::adopt(int, net::Socket) {
  // The active side proved itself before it opened this channel: its socket service answers
  // our describes now. The poller describes its regions; ops that come first wait for that
  // on the poller (data_path.cpp), never on the caller.
  {
    std::lock_guard<std::mutex> lk(mu_);
    resolve_wanted_ = true;
    has_work_.store(true, std::memory_order_release);
  }
  cv_.notify_one();
  return true;
}

// Passive side: the process `cred` proved itself with this endpoint's token; its socket
// becomes the control channel.
// `sock` is taken only on success (else the service answers the refusal on it).
void NvlinkEndpoint::authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string& engine) {
  FdGuard guard{lease_fd};
  if (active_ || authenticated_.load()) throw Error(ErrorCode::kProtocol, "nvlink: endpoint already authenticated");
  if (engine != peer_engine_)
    throw Error(ErrorCode::kProtocol, "nvlink: engine '" + engine + "' proved itself for the endpoint that engine '" +
                                          peer_engine_ + "' opened");
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (lease_fd < 0 || !same_host::is_memfd(lease_fd, sizeof(LeaseSlot)) || !leases_.map_fd(lease_fd))
      throw Error(ErrorCode::kProtocol, "nvlink: no lease table (a memfd sealed against shrinking) came with the authentication");
  }
  // Proven, and the control channel running, before we answer: the peer opens the TCP
  // channel as soon as it reads the answer, and attach() (after which the application may
  // send) must find both. The peer sends nothing on the socket before it has the answer.
  proven(cred.pid);
  const int fd = sock.fd();
  install(std::move(sock));
  try {
    same_host::send(fd, {{"ok", true}, {"engine", host_.engine_id()}}, host_.lease_fd());
  } catch (const Error& e) {
    fail(e.status(), false);
  }
}

// Answers the authenticated peer's question about one of our regions (*fd_out: a descriptor
// to pass with the answer, or -1).
nlohmann::json NvlinkEndpoint::describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const {
  *fd_out = -1;
  if (!authenticated_.load() || cred.pid != pid_.load())
    throw Error(ErrorCode::kProtocol, "describe from a process that is not this endpoint's peer");
  Status st;
  // Pinned while we answer: the region's memory (and its memfd or cuda export) stays while
  // we describe it.
  RegionPin pin = host_.registry().pin(id, 0, 1, &st, "target");
  if (!pin) throw Error(st.code, st.message);
  const RegionEntry* e = pin.get();
  const auto addr = reinterpret_cast<uint64_t>(e->base);
  nlohmann::json d{{"addr", addr}, {"length", e->length}, {"slot", e->lease_slot}, {"host", e->location.is_host()}};
  if (e->location.is_host()) {
    if (e->memfd >= 0) *fd_out = ::fcntl(e->memfd, F_DUPFD_CLOEXEC, 0);
    return d;
  }
  if (e->location.kind != Location::Kind::kCuda)
    throw Error(ErrorCode::kUnsupported, "region " + std::to_string(id) + " is " + e->location.to_string() + " memory");
  if (cred.pid == ::getpid()) {
    // Another engine of this process: the address is valid there as it is here.
    d["export"] = {{"kind", "local"}, {"base", addr}, {"offset", 0}, {"base_size", e->length},
                   {"device", e->location.device}};
    return d;
  }
  d["export"] = cu::export_region(e->base, e->length, fd_out);
  return d;
}

// Per-operation deadlines (PendingOps::expire), an op past its own deadline spared while
// work of ours keeps completing (as shm): frames the peer sends of its own accord keep
// nothing alive.
size_t NvlinkEndpoint::expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                                  std::string* what) {
  auto moving = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(moving_.load()));
  return pending_.expire(now, timeout, what, /*fail=*/false,
                         [&](const TransferOp*) { return now - moving < timeout; });
}

void NvlinkEndpoint::close(const Status& why) {
  fail(why, false);
  std::lock_guard<std::mutex> close_lk(close_mu_);  // a second closer waits for the first
  if (closed_) return;
  closed_ = true;
  if (control_) control_->join();
  if (poller_.joinable() && poller_.get_id() != std::this_thread::get_id()) poller_.join();
  stop_posts();
  {
    std::lock_guard<std::mutex> lk(post_mu_);
    for (auto& ps : post_streams_) {
      if (ps->arrivals) cudaFreeAsync(ps->arrivals, ps->stream);  // stream-ordered: never waits for user kernels
      cudaStreamDestroy(ps->stream);
      cuda::give_mapped_word(ps->done);  // stop_posts synchronised the stream: no kernel writes it
    }
    post_streams_.clear();
    last_post_stream_ = nullptr;
  }
  {
    std::lock_guard<std::mutex> lk(res_mu_);
    for (auto& [key, s] : streams_) cudaStreamSynchronize(s);
    for (auto& [key, s] : streams_) cudaStreamDestroy(s);
    streams_.clear();
    for (auto& [dev, pool] : event_pool_)
      for (auto e : pool) cudaEventDestroy(e);
    event_pool_.clear();
  }
  {
    std::lock_guard<std::mutex> lk2(map_mu_);
    views_.clear();
    imports_.clear();
  }
  host_.forget(token_);
}

void NvlinkEndpoint::proven(pid_t pid) {
  pid_ = pid;
  same_process_ = pid == ::getpid();
  authenticated_ = true;
}

void NvlinkEndpoint::install(net::Socket sock) {
  control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
  control_->start();
  if (failed()) control_->shutdown();
}

// The failure latch is EndpointBase::fail(); this is nvlink's part of it: the control channel
// shuts, the poller stops, and every copy of ours has finished before any op or post fails
// (our copies may still write into the peer's memory until then, under its leases).
void NvlinkEndpoint::stop_io() {
  if (control_) control_->shutdown();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    stop_flag_.store(true);
    cv_.notify_all();
  }
  if (poller_.joinable() && poller_.get_id() != std::this_thread::get_id()) poller_.join();
  drain_active();
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& f : inflight_)
      for (auto e : f.events) {
        cudaEventSynchronize(e);
        give_event(f.device, e);
      }
    inflight_.clear();
    deferred_.clear();
  }
  stop_posts();
  {
    // Ops waiting for the owner's answers (failed next, by the base): their leases and
    // staged copies go now.
    std::lock_guard<std::mutex> lk(pull_mu_);
    pulls_.clear();
  }
}

}  // namespace sluice::detail::nvlink
