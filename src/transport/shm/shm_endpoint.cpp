#include "transport/shm/shm_endpoint.hpp"
#include "transport/shm/held_leases.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "core/log.hpp"
#include "core/params.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/shm/bulk_copy.hpp"
#include "transport/common/cma.hpp"
#include "transport/shm/shm_test_describe.hpp"

namespace sluice::detail::shm {
namespace {

constexpr size_t kMaxImmInProgress = 1 << 16;
constexpr uint64_t kInlinePull = 64 << 10;  // PULL_WRITEs up to this many bytes are served on the reader

// Test only: every copy into an op's memory waits this long first, so a test can fail the
// endpoint while a copy is in flight (read when an endpoint is created).
const Param<int> kCopyDelayMs{"shm.test_copy_delay_ms", "SLUICE_SHM_TEST_COPY_DELAY_MS", 0, int_in(0, 60000),
                              "test only: each shm copy into an op's memory sleeps this many ms first",
                              ParamScope::kTest};
// Test only: a SEND copied into an offered recv (shm_offer.cpp) waits this long after taking
// the offer, so a test can hold an offer taken past the receiver's recv_timeout.
const Param<int> kPutDelayMs{"shm.test_put_delay_ms", "SLUICE_SHM_TEST_PUT_DELAY_MS", 0, int_in(0, 60000),
                             "test only: a SEND copied into a recv its peer offered sleeps this many ms after "
                             "taking the offer", ParamScope::kTest};
// A lone small copy costs less than handing it to a pool thread and waking the waiter
// afterwards (peers bench: a 4 KiB read took about 15 us through the pool, where Open MPI's
// vader took 3); bigger ones go to the pool, whose threads copy lanes in parallel.
const Param<uint64_t> kInlineMax{"shm.inline_max", "SLUICE_SHM_INLINE_MAX", 64 << 10, size_in(0, 1ull << 30),
                                 "a read, or a write into a mapped memfd region, of at most this many bytes (the whole "
                                 "operation) is copied on the submitting thread instead of the copy pool; 0 = never"};

// One process_vm_readv moves about one core's worth of memory bandwidth; a large SEND was
// copied by the one thread that received it (a torch rendezvous of 64 MiB: 4.9 GB/s on a
// 16-core host, where gloo does 3.8).
// The fixed cost of handing a lane to a pool thread (its wake-up, then the waiter's) was 28 us
// of a lone 1 MiB read of a mapped region that memcpy alone moves in 55 us (84 against 55 us in
// the peers bench); beyond about a MiB it is lost in the copy, and a submitting thread held for
// longer would stall a caller that pipelines.
const Param<uint64_t> kInlineSplitMax{"shm.inline_split_max", "SLUICE_SHM_INLINE_SPLIT_MAX", 1 << 20, size_in(0, 1ull << 30),
                                      "an operation larger than shm.inline_max and at most this many bytes has its first "
                                      "lane copied on the submitting thread while the copy pool copies the others; "
                                      "0 = never"};
// A lone 1 MiB read on 2 cores waited for a pool thread to wake and copy its second lane
// after the submitting thread had copied its first (docs/peers.md, "Lone 1 MiB reads").
const Param<bool> kTakeBack{"shm.take_back", "SLUICE_SHM_TAKE_BACK", true, boolean(),
                            "a submitting thread that copied its operation's first lane (shm.inline_split_max) "
                            "then copies the operation's other lanes that no copy-pool thread has started yet, "
                            "instead of waiting for them; false = they stay with the pool"};
// A waiter slept while a pool thread copied its operation, and was woken after: a lone 256 KiB
// read moved 4.1-4.2 GB/s on 2 vCPUs (one pool lane, its wake-up and then the waiter's), 6.6-6.7
// with its waiter polling; a lone 1 MiB read 12.4-12.9 and 16.0-17.3; 8 in flight no worse
// (docs/peers.md, "Waiters of pool copies poll"). Bounded by the time the copy should take, at
// 4 GB/s, so a waiter that a busy host keeps from its copy sleeps soon.
const Param<int> kPoolWait{"shm.pool_wait_us", "SLUICE_SHM_POOL_WAIT_US", -1, int_in(-1, 100000),
                           "the waiter of an operation larger than shm.inline_max and at most shm.inline_split_max, "
                           "which the copy pool copies (all of it, or the lanes besides the submitting thread's), "
                           "polls for its completion this many microseconds before sleeping; -1 = 20 plus the "
                           "operation's bytes at 4 GB/s (85 us for 256 KiB); 0 = as any waiter (busy_wait_us)"};
const Param<uint64_t> kSendSplitMin{"shm.send_split_min", "SLUICE_SHM_SEND_SPLIT_MIN", 1 << 20, size_in(0, 1ull << 40),
                                    "a received SEND of at least this many bytes into a posted recv is copied in parts "
                                    "(of at least half this) by the receiving thread and the copy pool together; 0 = never"};

// A plain copy reads every destination line before it writes it; into a large buffer of
// another process's, which no cache of ours holds, that doubled the memory traffic (one 1 MiB
// copy into a cold 64 MiB slot range: 88 us with memcpy, 49 with streaming stores; bulk_copy.hpp).
const Param<uint64_t> kStreamCopyMin{"shm.stream_copy_min", "SLUICE_SHM_STREAM_COPY_MIN", 64 << 10,
                                     size_in(0, 1ull << 40),
                                     "a copy between this process's memory and a peer's mapped memfd region (a read, a "
                                     "mapped write, a SEND into an offered recv or out of a mapped sender, an eager "
                                     "SEND into or out of the receiver's eager ring) of at least this many bytes uses "
                                     "non-temporal stores, which do not read the destination into the cache first "
                                     "(x86-64); 0 = never"};

// A lone small SEND waited for a round trip (the receiver's thread woke, copied with
// process_vm_readv and answered): 61 us for 4 KiB in the peers bench, where Open MPI's vader,
// which completes a small send once it is in the receiver's queue, took 3.7.
const Param<uint64_t> kEagerMax{"shm.eager_max", "SLUICE_SHM_EAGER_MAX", 64 << 10, size_in(0, 16 << 20),
                                "a SEND of at most this many bytes goes eagerly (its bytes in the receiver's eager "
                                "ring, or in its frame) and completes once queued (within the receiver's "
                                "shm.eager_credit), not once received; "
                                "0 = every SEND waits for the receiver"};
const Param<bool> kEagerRing{"shm.eager_ring", "SLUICE_SHM_EAGER_RING", true, boolean(),
                             "eager SENDs go through the receiver's eager ring (shared memory of eager_credit + "
                             "eager_max bytes and shm.eager_slots descriptors per endpoint, which the receiver "
                             "allocates when its peer asks) instead of through the control socket: a memcpy each "
                             "way instead of two socket copies; false = this side does not ask for its peer's ring"};
const Param<uint64_t> kEagerSlots{"shm.eager_slots", "SLUICE_SHM_EAGER_SLOTS", 1024, size_in(0, 1 << 20),
                                  "descriptors in the queue of the eager ring this endpoint hands its peer: the "
                                  "peer announces a ring message there instead of with a SEND_RING frame, and "
                                  "wakes this side with a frame only when it stopped looking (32 bytes each); "
                                  "0 = every ring message comes with its frame"};
// 32 MiB: a burst that outruns the grant sends its overflow as rendezvous, copied by the
// receiver's one thread. 512 SENDs of 64 KiB in flight (64 x 8 in the peers bench, after the
// bench's other SEND cells, C++ adapter, memfd, 3 runs, MB/s): 8 MiB 4,951-5,446; 16 MiB
// 3,803-11,273; 32 MiB 8,667-11,402; Open MPI's vader beside them 5,993-7,048. The ring it sizes is populated
// when the peer asks for it: made page by page instead, the first pass of a burst through it
// paid a page fault per 4 KiB on both sides (64 KiB lone SENDs: 1,250 instead of 9,000 MB/s).
const Param<uint64_t> kEagerCredit{"shm.eager_credit", "SLUICE_SHM_EAGER_CREDIT", 32 << 20, size_in(0, 1ull << 32),
                                   "bytes of eager SENDs (each counted with its 56-byte header) that a peer may have "
                                   "queued to this endpoint and no recv took yet, and that this endpoint queues to a "
                                   "peer; 0 = this side takes no eager SEND"};
// A peer region this side maps (to read from, write into, or copy SENDs in and out of) was
// faulted in page by page on its first use: 1 us a 4 KiB page here, 256 us for the first copy
// into each MiB against 48 us for the copy (peers bench, lone 1 MiB SENDs over a fresh 64 MiB
// region). Prefaulting a 64 MiB mapping takes 7 ms, 1 GiB 107 ms, off the data path; beyond
// the bound the page tables (2 MiB a GiB) are not worth spending up front.
const Param<uint64_t> kMapPopulateMax{"shm.map_populate_max", "SLUICE_SHM_MAP_POPULATE_MAX", 1ull << 30,
                                      size_in(0, 1ull << 44),
                                      "a peer's memfd region of at most this many bytes that this side maps is "
                                      "prefaulted in the background on the copy pool (64 MiB a job) instead of page "
                                      "by page on its first copies; 0 = never"};

// 64 slots: a receiver keeps more recvs posted ahead than that only for batches, whose SENDs
// go as SEND_RTS anyway (send_offered).
const Param<uint64_t> kRecvOffers{"shm.recv_offers", "SLUICE_SHM_RECV_OFFERS", 64, size_in(0, 1 << 16),
                                  "posted recvs (in engine-allocated memory) that this side offers its peer in the "
                                  "eager ring it hands out, so that a lone rendezvous SEND is copied by its sender "
                                  "straight into the recv's buffer with one frame and no round trip (32 bytes each); "
                                  "0 = this side neither offers recvs nor takes offers"};
// The sending thread copies an offered recv's message alone, where SEND_RTS has the receiver
// split a message of shm.send_split_min or more over its copy pool. Lone SENDs here (2 cores,
// sluice-bench, offers against main's SEND_RTS, interleaved medians): 1 MiB 1.57x, 2 MiB 1.22x,
// 8 MiB 1.23x, but 16 MiB 0.80x and 32 MiB 0.72x; a host with more copy threads gains more
// from the split, so the bound is set low.
const Param<uint64_t> kRecvOfferMax{"shm.recv_offer_max", "SLUICE_SHM_RECV_OFFER_MAX", 2ull << 20,
                                    size_in(0, 1ull << 44),
                                    "a SEND of at most this many bytes may be copied by the sending thread into "
                                    "the recv its peer offered (shm.recv_offers); a larger one goes as SEND_RTS, "
                                    "whose copy the receiver splits over its copy pool (shm.send_split_min); 0 = "
                                    "this side takes no offer"};

// What this thread submitted on an endpoint since its last wait (the last endpoint it used):
// whether an answer will come over the control channel, and whether only copy pool
// complete its ops (see ShmEndpoint::drive). Only a hint: any completion reaches a waiter.
struct SubmitHint {
  const void* endpoint = nullptr;
  bool control = false;
  bool workers = false;
};
thread_local SubmitHint tls_hint;

// The endpoint whose job this pool thread runs now (close() from inside it must not wait
// for itself).
thread_local const void* tls_running = nullptr;
struct RunningMark {
  const void* saved;
  explicit RunningMark(const void* ep) : saved(tls_running) { tls_running = ep; }
  ~RunningMark() { tls_running = saved; }
};

struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

struct SendCopy {
  explicit SendCopy(PeerLeases& l) : held(l) {}
  MessageMatcher::Claim claim;  // the posted recv the bytes go into
  uint64_t op_id = 0;           // the sender's sequence, for its SEND_ACK
  Held held;                    // the sender's region, while any part may read it
  std::shared_ptr<Mapping> keep;  // our mapping of it (memfd), while any part may read it
  std::atomic<int> left{0};     // parts not yet done
  std::mutex mu;
  Status st;  // the first part's failure
};

namespace {
// One part of a SEND's copy: out of our mapping of the sender's memfd region, or with
// process_vm_readv from the sender's address.
Status copy_part(pid_t pid, uint8_t* dst, uint64_t src, const uint8_t* mapped, uint64_t len, uint64_t stream_min) {
  if (!mapped) return cma::read(pid, {{dst, src, len}});
  bulk_copy(dst, mapped, len, stream_min);
  return Status::Ok();
}
}  // namespace

namespace {

// The op's local region that holds p; null for memory the op does not pin. An op from a
// StagingEndpoint pins nothing: its staged pieces are host copies that are no region (the
// adapter keeps them alive until the op completed) and the caller's op, which the adapter
// also keeps, holds the pins of the others.
const RegionEntry* pin_of(const TransferOp& op, const uint8_t* p) {
  for (const auto& pin : op.pins) {
    const RegionEntry* e = pin.get();
    if (p >= e->base && p < e->base + e->length) return e;
  }
  return nullptr;
}

}  // namespace

Mapping::~Mapping() {
  if (base) ::munmap(base, length);
}

ShmEndpoint::ShmEndpoint(const EndpointSetup& s, Host& host, std::string peer_socket)
    : EndpointBase(s),
      host_(host),
      active_(s.active),
      token_(s.token),
      peer_socket_(std::move(peer_socket)),
      timeout_(s.config.connect_timeout),
      waiter_(busy_wait_of(s.config)),
      copy_delay_ms_(kCopyDelayMs.read()),
      put_delay_ms_(kPutDelayMs.read()),
      inline_max_(kInlineMax.get(s.config)),
      inline_split_max_(kInlineSplitMax.get(s.config)),
      take_back_(kTakeBack.get(s.config)),
      pool_wait_(kPoolWait.get(s.config)),
      busy_wait_(busy_wait_of(s.config)),
      split_min_(kSendSplitMin.get(s.config)),
      stream_min_(kStreamCopyMin.get(s.config)),
      eager_max_(kEagerMax.get(s.config)),
      eager_credit_(kEagerCredit.get(s.config)),
      ring_eager_(kEagerRing.get(s.config)),
      ring_slots_(kEagerSlots.get(s.config)),
      populate_max_(kMapPopulateMax.get(s.config)),
      offers_(ring_eager_ ? kRecvOffers.get(s.config) : 0),
      offer_max_(kRecvOfferMax.get(s.config)) {
  pending_.set_post_handler([this](const std::shared_ptr<TransferOp>& op, const Status& st) { on_post_done(op, st); });
  // Cleared in stop_io(), before this goes away. Offers start once the peer maps our ring.
  if (offers_ && events_) events_->matcher().set_offerer(this);
}

ShmEndpoint::~ShmEndpoint() {
  close({ErrorCode::kCancelled, "endpoint destroyed"});
  // The ring's mapping goes with the last stash slot that still reads from it (rx_ring_map_).
  if (rx_ring_fd_ >= 0) ::close(rx_ring_fd_);
}

void ShmEndpoint::connect(const ChannelOpener& open) {
  // Prove ourselves on the peer's same-host socket first and learn, from the kernel, which
  // process answers; only then ask the listener to complete the endpoint.
  same_host::Proof proof = same_host::prove(peer_socket_, token_, host_.engine_id(), host_.lease_fd(), "",
                                            same_host::Clock::now() + timeout_, "shm");
  FdGuard guard{proof.lease_fd};
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (!leases_.map_fd(proof.lease_fd))
      throw Error(ErrorCode::kProtocol, "shm: the peer did not pass a lease table (a memfd sealed against shrinking) on its same-host socket");
  }
  pid_ = proof.cred.pid;
  authenticated_ = true;
  install(std::move(proof.sock));
  grant_credit();
  open(0, nlohmann::json::object());
}

void ShmEndpoint::authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string&) {
  FdGuard guard{lease_fd};
  if (active_ || authenticated_.load()) throw Error(ErrorCode::kProtocol, "shm: endpoint already authenticated");
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (lease_fd < 0 || !same_host::is_memfd(lease_fd, sizeof(LeaseSlot)) || !leases_.map_fd(lease_fd))
      throw Error(ErrorCode::kProtocol, "shm: no lease table (a memfd sealed against shrinking) came with the authentication");
  }
  // Installed and proven before the answer leaves: the peer attaches over the listener as
  // soon as it has the answer, and sends nothing on this socket before it (so the channel's
  // reader cannot take the answer's bytes).
  pid_ = cred.pid;
  const int fd = sock.fd();
  install(std::move(sock));
  authenticated_ = true;
  same_host::send(fd, {{"ok", true}, {"engine", host_.engine_id()}}, host_.lease_fd());
  grant_credit();  // after the answer, which the peer reads off the raw socket
}

nlohmann::json ShmEndpoint::attach(int index, const nlohmann::json&) {
  // The listener's channel only completes the endpoint: the peer must already have proven
  // on our Unix socket that it is a process on this host (a remote peer never can).
  if (index != 0) throw Error(ErrorCode::kProtocol, "shm takes one channel");
  if (!authenticated_.load())
    throw Error(ErrorCode::kProtocol, "shm: the peer has not proven that it is a process on this host "
                                      "(no authenticated same-host socket for this endpoint)");
  return nlohmann::json::object();
}

// The listener's socket carried only the handshake; the same-host socket is the channel.
bool ShmEndpoint::adopt(int, net::Socket) { return true; }

nlohmann::json ShmEndpoint::describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const {
  *fd_out = -1;
  if (!authenticated_.load() || cred.pid != pid_.load())
    throw Error(ErrorCode::kProtocol, "describe from a process that is not this endpoint's peer");
  if (id == kEagerRingId) {
    // This endpoint's own ring, to its proven peer alone: it holds nothing but that peer's messages.
    uint64_t size = 0, data = 0, slots = 0, offers = 0;
    *fd_out = eager_ring_fd(&size, &data, &slots, &offers);
    return {{"addr", 0}, {"length", size}, {"slot", kNoLease}, {"data", data}, {"slots", slots}, {"offers", offers}};
  }
  Status st;
  // Pinned while we answer: a memfd is closed only after its region's pins drain, so the
  // descriptor we duplicate is the region's and not a number reused by another open().
  wait_while_test_describes_held();  // test only: a stalled peer
  RegionPin pin = host_.registry().pin(id, 0, 1, &st, "target");
  if (!pin) throw Error(st.code, st.message);
  const RegionEntry* e = pin.get();
  if (!e->location.is_host()) throw Error(ErrorCode::kUnsupported, "region " + std::to_string(id) + " is " + e->location.to_string() + " memory");
  if (e->memfd >= 0) *fd_out = ::fcntl(e->memfd, F_DUPFD_CLOEXEC, 0);
  return {{"addr", reinterpret_cast<uint64_t>(e->base)}, {"length", e->length}, {"slot", e->lease_slot}};
}

bool ShmEndpoint::mapped_locked(uint64_t id) const {
  auto it = regions_.find(id);
  return it != regions_.end() && it->second.map;
}

void ShmEndpoint::note_submit(bool control) {
  if (tls_hint.endpoint != this) tls_hint = {this, false, false};
  (control ? tls_hint.control : tls_hint.workers) = true;
}

bool ShmEndpoint::drive(const std::atomic<bool>& done, std::chrono::steady_clock::time_point deadline) {
  auto lend = [&](StreamChannel** lent, int) {
    // A thread whose ops all went to the copy pool would only be interrupted by them (an
    // eventfd write and a poll wake-up instead of the future's own wake-up, plus taking the
    // socket from the reactor and giving it back): it waits on its future instead.
    const bool mine = tls_hint.endpoint == this;
    const bool workers_only = mine && tls_hint.workers && !tls_hint.control;
    if (mine) tls_hint.control = tls_hint.workers = false;
    if (workers_only || failed()) return 0;
    std::lock_guard<std::mutex> lk(ctl_mu_);
    if (!control_ || !control_->lend()) return 0;
    lent[0] = control_.get();
    return 1;
  };
  return waiter_.drive(lend, done, deadline, "shm");
}

void ShmEndpoint::install(net::Socket sock) {
  std::lock_guard<std::mutex> lk(ctl_mu_);  // fail() and close() may run on other threads
  control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
  control_->start();
  if (failed()) control_->shutdown();
}

void ShmEndpoint::enqueue(Job job) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) return;  // stop_io() ran: fail_all() fails the op
  jobs_.push_back(std::move(job));
  schedule_locked();
}

void ShmEndpoint::schedule_locked() {
  if (scheduled_ || stop_ || (jobs_.empty() && post_count_ == 0)) return;
  scheduled_ = true;
  host_.copy_pool().schedule(weak_from_this());
}

void ShmEndpoint::submit(std::shared_ptr<TransferOp> op) {
  uint64_t token = pending_.add(op);
  if (!token) return;
  if (op->kind != OpKind::kRead) {
    bool local = true;
    std::vector<uint64_t> unknown;
    {
      std::lock_guard<std::mutex> lk(map_mu_);
      for (const auto& lane : op->lanes)
        for (const auto& p : lane.pieces) {
          if (mapped_locked(p.remote_id)) continue;
          local = false;
          if (!regions_.count(p.remote_id) && describing_.insert(p.remote_id).second) unknown.push_back(p.remote_id);
        }
    }
    // Learn about regions in the background: a memfd region is written through its mapping
    // from then on (no round trip to the owner).
    for (uint64_t id : unknown) start_describe(id);
    if (!local) {
      note_submit(true);
      post_pull(op, token);
      return;
    }
  }
  // The lanes run on the copy pool (a small operation right here: shm.inline_max); a
  // write_with_imm's imm goes after its last lane (EndpointBase::lane_finished, send_imm).
  const bool here = op->bytes <= inline_max_;
  if (!here) note_submit(false);
  track_lanes(token, *op);
  // Up to shm.inline_split_max, the first lane is ours while the pool takes the others (queued
  // first, so that they start while we copy). Never the only lane: a caller that pipelines
  // single-lane operations keeps the pool's threads busy, not its own.
  size_t mine = op->lanes.size(), busy = 0;
  if (!here && op->bytes <= inline_split_max_)
    for (size_t l = 0; l < op->lanes.size(); ++l)
      if (!op->lanes[l].pieces.empty() && busy++ == 0) mine = l;
  if (busy < 2) mine = op->lanes.size();
  for (size_t l = 0; l < op->lanes.size(); ++l)
    if (!op->lanes[l].pieces.empty() && l != mine) {
      Job j;
      j.op = op;
      j.token = token;
      j.lane = l;
      if (here)
        run_here(j);
      else
        enqueue(std::move(j));
    }
  if (mine < op->lanes.size()) {
    Job j;
    j.op = op;
    j.token = token;
    j.lane = mine;
    run_here(j);
    // Our lane is done; a lane of ours that the pool has not started yet is copied here too
    // rather than waited for (a pool thread that wakes late finds nothing to do).
    if (take_back_)
      while (take_back(op, j)) run_here(j);
  }
  // What is left is the pool's: its waiter polls about as long as that copy should take
  // (shm.pool_wait_us) instead of sleeping through a pool thread's wake-up and its own.
  if (!here && op->bytes <= inline_split_max_ && pool_wait_ != 0 && op->future && !op->future->done()) {
    const auto us = std::chrono::microseconds(pool_wait_ > 0 ? pool_wait_ : 20 + static_cast<int64_t>(op->bytes / 4000));
    op->future->set_busy_wait(std::max(us, busy_wait_));
  }
}

bool ShmEndpoint::take_back(const std::shared_ptr<TransferOp>& op, Job& out) {
  // Our lanes went in last, so they are near the back; a deep queue (a pipelining caller) is
  // not searched further than that.
  constexpr size_t kLook = 64;
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) return false;  // stop_io() ran: fail_all() fails what is queued
  size_t looked = 0;
  for (auto it = jobs_.end(); it != jobs_.begin() && looked++ < kLook;) {
    --it;
    if (it->kind == Job::kLane && it->op == op) {
      out = std::move(*it);
      jobs_.erase(it);
      return true;
    }
  }
  return false;
}

void ShmEndpoint::run_here(Job& job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;  // stop_io() ran: fail_all() fails the op
    ++running_;          // close() waits for it as for a pool thread's job
  }
  {
    RunningMark mark(this);
    run_job(job);
    job = Job{};
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (--running_ == 0) idle_cv_.notify_all();
}

void ShmEndpoint::post_pull(const std::shared_ptr<TransferOp>& op, uint64_t token) {
  // Frames per lane (a lane longer than kMaxPullPieces is cut), and in total: an imm is
  // delivered by the owner once every frame of the op has landed.
  std::vector<uint32_t> frames(op->lanes.size(), 0);
  uint32_t total = 0;
  for (size_t c = 0; c < op->lanes.size(); ++c) {
    size_t n = op->lanes[c].pieces.size();
    frames[c] = static_cast<uint32_t>((n + kMaxPullPieces - 1) / kMaxPullPieces);
    total += frames[c];
  }
  {
    std::lock_guard<std::mutex> lk(track_mu_);
    auto& t = pulls_[token];
    for (uint32_t f : frames) t.lanes.emplace_back(f, Status::Ok());
  }
  const bool imm = op->kind == OpKind::kWriteImm;
  for (size_t c = 0; c < op->lanes.size(); ++c) {
    const auto& pieces = op->lanes[c].pieces;
    for (size_t first = 0; first < pieces.size(); first += kMaxPullPieces) {
      size_t last = std::min(pieces.size(), first + kMaxPullPieces);
      auto buf = std::make_shared<std::vector<PullPiece>>();
      buf->reserve(last - first);
      for (size_t i = first; i < last; ++i) {
        const Piece& p = pieces[i];
        // The owner reads our bytes at src_addr with process_vm_readv on our pid. A piece in
        // a registered region names it (id + lease slot) so that the owner discards the copy
        // if we unregister it meanwhile. A piece in no region (src_region 0: a staged host
        // copy, kept alive by the StagingEndpoint until this op completed) is read by address
        // alone. "No region" gives a peer nothing: it is our own memory that the owner reads,
        // and the owner still writes only inside its registered, pinned region (serve_pull).
        const RegionEntry* e = pin_of(*op, p.local);
        buf->push_back(PullPiece{p.remote_id, p.remote_offset, p.length, reinterpret_cast<uint64_t>(p.local),
                                 e ? e->id : 0, e ? e->lease_slot : kNoLease, 0});
      }
      OutFrame f;
      f.hdr = make_frame(FrameType::kPullWrite, token, c, 0, buf->size() * sizeof(PullPiece), imm ? kImmPart : 0,
                         imm ? op->imm : 0, imm ? total : 0);
      f.data = reinterpret_cast<const uint8_t*>(buf->data());
      f.keep = buf;
      control_->post(std::move(f));
    }
  }
}

void ShmEndpoint::send(std::shared_ptr<MessageOp> op) {
  if (send_eager(op) || send_offered(op)) return;
  if (!pending_.add_send(op)) return;
  // No pin: a StagingEndpoint's host copy of a CUDA message, alive until the send completed;
  // the receiver reads it by address (region 0, see serve_rts). shm itself moves host memory
  // only: CUDA memory reaches it only through that adapter.
  const RegionEntry* e = op->pin.get();
  if (e && !e->location.is_host()) {
    if (auto o = pending_.take_send(op->seq))
      o->future->complete({ErrorCode::kUnsupported, "shm: send from " + e->location.to_string() + " memory"});
    return;
  }
  auto src = std::make_shared<RtsSource>(RtsSource{e ? e->id : 0, e ? e->lease_slot : kNoLease, 0});
  note_submit(true);
  OutFrame f;
  f.hdr = make_frame(FrameType::kSendRts, op->seq, reinterpret_cast<uint64_t>(op->ptr), 0, sizeof(RtsSource), 0,
                     static_cast<uint32_t>(op->length), static_cast<uint32_t>(op->length >> 32));
  f.data = reinterpret_cast<const uint8_t*>(src.get());
  f.keep = src;
  control_->post(std::move(f));
}

void ShmEndpoint::close(const Status& why) {
  if (why.code == ErrorCode::kCancelled && !failed()) {
    // A local close: eager SENDs completed once queued, so the frames still queued carry
    // messages their senders were told are sent. They leave first (bounded: a peer that stopped
    // reading holds the close at most this long, then they are dropped with the channel).
    StreamChannel* ch;
    {
      std::lock_guard<std::mutex> clk(ctl_mu_);
      ch = control_.get();
    }
    if (ch && !ch->on_own_thread() && !ch->flush(std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(5))))
      SLUICE_LOG(kWarn, "shm: endpoint closed with frames still queued for a peer that is not reading (eager SENDs among them are lost)");
  }
  fail(why, false);
  std::lock_guard<std::mutex> lk(close_mu_);  // a second closer waits for the first
  if (closed_) return;
  closed_ = true;
  StreamChannel* ch;
  {
    std::lock_guard<std::mutex> clk(ctl_mu_);
    ch = control_.get();
  }
  if (ch) ch->join();
  {
    // No job of ours runs on the pool once we return (stop_io() keeps new ones from starting),
    // except the one this thread may be running itself.
    std::unique_lock<std::mutex> lk(mu_);
    const int self = tls_running == this ? 1 : 0;
    idle_cv_.wait(lk, [&] { return running_ <= self; });
  }
  host_.forget(token_);
}

size_t ShmEndpoint::expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                               std::string* what) {
  auto moving = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(moving_.load()));
  return pending_.expire(now, timeout, what, /*fail=*/false,
                         [&](const TransferOp*) { return now - moving < timeout; });
}

Status ShmEndpoint::on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
  pending_.touch();
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kImm:
      events_->matcher().push_imm(h.imm);
      return Status::Ok();
    case FrameType::kPullWrite: return take_pull(h, payload);
    case FrameType::kAck:
    case FrameType::kNack: return take_ack(h, payload);
    case FrameType::kSendRts: return in_order([&] { return serve_rts(ch, h, payload); });
    case FrameType::kSignal: return serve_signal(ch, h);
    case FrameType::kSendAck:
      moved();
      return complete_send_ack(pending_, h, payload);
    case FrameType::kSend: return in_order([&] { return serve_eager(h, payload); });
    case FrameType::kSendRing: return in_order([&] { return serve_ring(h); });
    case FrameType::kSendPut: return in_order([&] { return serve_put(h, payload); });
    case FrameType::kRingBell: return drain_ring();
    case FrameType::kCredit: return take_credit(h);
    case FrameType::kError: return peer_error(payload);
    default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on shm control"};
  }
}

Status ShmEndpoint::take_pull(const FrameHeader& h, PayloadReader& payload) {
  if (h.length % sizeof(PullPiece) != 0 || h.length == 0 || h.length / sizeof(PullPiece) > kMaxPullPieces)
    return {ErrorCode::kProtocol, "PULL_WRITE of " + std::to_string(h.length) + " bytes (pieces of " + std::to_string(sizeof(PullPiece)) + " bytes, at most " +
                                      std::to_string(kMaxPullPieces) + ")"};
  Job j;
  j.kind = Job::kServe;
  j.hdr = h;
  j.pull.resize(h.length / sizeof(PullPiece));
  if (!payload.read(j.pull.data(), h.length)) return {ErrorCode::kPeerLost, "connection lost mid-frame"};
  // A small pull is copied right here: a hand-off to a worker would cost more than the copy.
  uint64_t bytes = 0;
  for (const PullPiece& p : j.pull) bytes += std::min<uint64_t>(p.length, kInlinePull + 1);
  if (bytes <= kInlinePull) {
    serve_pull(j);
    return Status::Ok();
  }
  enqueue(std::move(j));
  return Status::Ok();
}

Status ShmEndpoint::take_ack(const FrameHeader& h, PayloadReader& payload) {
  Status st = frame_status(h, payload);
  if (h.type == static_cast<uint8_t>(FrameType::kNack) && st.ok()) st = {ErrorCode::kRemoteError, "peer refused the write"};
  bool done = false, gone = false;
  {
    std::lock_guard<std::mutex> lk(track_mu_);
    auto it = pulls_.find(h.op_id);
    if (it == pulls_.end()) {
      // A post the peer executes (PULL_WRITE, SIGNAL): one frame, one answer. Posts this side
      // copies itself are never completed by a frame, whatever the peer sends.
      auto op = pending_.find(h.op_id);
      if (!op || op->future || !op->post || !static_cast<const PostOp&>(*op).by_peer || h.region != 0)
        return {ErrorCode::kProtocol, "ack for an unknown operation"};
      done = true;
    } else if (h.region >= it->second.lanes.size() || it->second.lanes[h.region].first == 0) {
      return {ErrorCode::kProtocol, "ack for an unknown operation"};
    } else {
      auto& lane = it->second.lanes[h.region];
      if (lane.second.ok() && !st.ok()) lane.second = st;
      if (--lane.first == 0) {
        done = true;
        st = lane.second;
        gone = true;
        for (auto& l : it->second.lanes) gone &= l.first == 0;
        if (gone) pulls_.erase(it);  // every frame was answered
      }
    }
  }
  moved();
  pending_.progress(h.op_id);
  if (done && !pending_.lane_done(h.op_id, st)) return {ErrorCode::kProtocol, "ack for an unknown operation"};
  return Status::Ok();
}

void ShmEndpoint::run_one() {
  Job job;
  std::shared_ptr<TransferOp> post;
  {
    std::lock_guard<std::mutex> lk(mu_);
    scheduled_ = false;
    if (stop_) return;
    if (post_count_ > 0) {
      post = std::move(post_ring_[post_head_]);
      post_head_ = (post_head_ + 1) % post_ring_.size();
      --post_count_;
    } else if (!jobs_.empty()) {
      job = std::move(jobs_.front());
      jobs_.pop_front();
    } else {
      return;
    }
    ++running_;
    // Back at the end of the pool's list if more is queued: endpoints take turns job by job,
    // and another pool thread may run our next job meanwhile.
    schedule_locked();
  }
  {
    RunningMark mark(this);
    if (post) {
      const auto& p = static_cast<const PostOp&>(*post);
      Status st = run_post_write(p);
      pending_.touch();
      moved();
      pending_.lane_done(p.token, st);
    } else {
      run_job(job);
    }
    post.reset();
    job = Job{};  // drop the op before close() may go on
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (--running_ == 0) idle_cv_.notify_all();
}

void ShmEndpoint::run_job(Job& job) {
  if (job.kind == Job::kPopulate) {
#ifdef MADV_POPULATE_WRITE
    // Faults the pages in as a first write would, and writes nothing. A kernel without it
    // (before 5.14) says EINVAL: the copies fault them in as before.
    if (!failed()) ::madvise(job.map->base + job.src, job.len, MADV_POPULATE_WRITE);
#endif
    return;
  }
  if (job.kind == Job::kPart) {
    // Counted as a copy (copy_send) until the last part is done; job.send holds the mapping.
    send_part_done(job.send, copy_part(pid_.load(), job.dst, job.src, job.mapped, job.len, stream_min_));
    return;
  }
  if (job.kind == Job::kServe) {
    serve_pull(job);
    pending_.touch();
    return;
  }
  if (!failed() && job.error.ok() && job.op->kind == OpKind::kRead && park_if_undescribed(job)) return;
  Status st = failed()            ? Status{ErrorCode::kCancelled, "endpoint closed"}
              : !job.error.ok() ? job.error
                                : run_lane(*job.op, job.op->lanes[job.lane]);
  pending_.touch();
  moved();
  if (st.code == ErrorCode::kPeerLost) {
    fail(st, true);
    return;
  }
  lane_finished(job.token, st);
}

void ShmEndpoint::send_imm(uint64_t token, const std::shared_ptr<TransferOp>& op) {
  // Every byte is in the peer's memory (the copies of every lane returned); now the imm.
  OutFrame f;
  f.hdr = make_frame(FrameType::kImm, token, 0, 0, 0, 0, op->imm);
  control_->post(std::move(f));
  pending_.lane_done(token, Status::Ok());
}

Status ShmEndpoint::run_lane(const TransferOp& op, const Lane& lane) {
  try {
    return op.kind == OpKind::kRead ? run_read(op, lane) : run_mapped_write(op, lane);
  } catch (const Error& e) {
    return e.status();
  }
}

Status ShmEndpoint::run_read(const TransferOp& op, const Lane& lane) {
  std::vector<RemoteRegion> where(lane.pieces.size());
  {
    // Described before the lane ran (park_if_undescribed); forgotten since only when a lease
    // showed the region gone.
    std::lock_guard<std::mutex> lk(map_mu_);
    for (size_t i = 0; i < lane.pieces.size(); ++i) {
      auto it = regions_.find(lane.pieces[i].remote_id);
      if (it == regions_.end())
        return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(lane.pieces[i].remote_id) + " is no longer registered"};
      where[i] = it->second;
    }
  }
  for (size_t i = 0; i < lane.pieces.size(); ++i) {
    const Piece& p = lane.pieces[i];
    if (!in_bounds(p.remote_offset, p.length, where[i].length))
      return {ErrorCode::kOutOfRange, "peer region " + std::to_string(p.remote_id) + " is " +
                                          std::to_string(where[i].length) + " bytes on its same-host socket"};
  }
  Held held(leases_);
  for (size_t i = 0; i < lane.pieces.size(); ++i)
    if (Status st = held.enter(where[i].slot, lane.pieces[i].remote_id, "peer"); !st.ok()) {
      std::lock_guard<std::mutex> lk(map_mu_);
      regions_.erase(lane.pieces[i].remote_id);  // gone: forget its description and mapping
      return st;
    }
  std::vector<cma::Span> spans;
  // From here on the op's destination is written: a failure of the endpoint waits for this.
  if (!begin_copy()) return {ErrorCode::kCancelled, "endpoint closed"};
  struct CopyEnd {
    ShmEndpoint* ep;
    ~CopyEnd() { ep->end_copy(); }
  } copy_end{this};
  for (size_t i = 0; i < lane.pieces.size(); ++i) {
    // Host memory: ours, or a StagingEndpoint's copy that it uploads once the op completed.
    const Piece& p = lane.pieces[i];
    if (where[i].map) bulk_copy(p.local, where[i].map->base + p.remote_offset, p.length, stream_min_);
    else spans.push_back({p.local, where[i].addr + p.remote_offset, p.length});
  }
  if (!spans.empty())
    if (Status st = cma::read(pid_.load(), spans); !st.ok()) return st;
  return held.still("peer");
}

Status ShmEndpoint::run_mapped_write(const TransferOp& op, const Lane& lane) {
  std::vector<RemoteRegion> where(lane.pieces.size());
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (size_t i = 0; i < lane.pieces.size(); ++i) {
      auto it = regions_.find(lane.pieces[i].remote_id);
      if (it == regions_.end() || !it->second.map)
        return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(lane.pieces[i].remote_id) + " is no longer registered"};
      where[i] = it->second;
    }
  }
  Held held(leases_);
  for (size_t i = 0; i < lane.pieces.size(); ++i) {
    const Piece& p = lane.pieces[i];
    if (!in_bounds(p.remote_offset, p.length, where[i].length))
      return {ErrorCode::kOutOfRange, "peer region " + std::to_string(p.remote_id) + " is " +
                                          std::to_string(where[i].length) + " bytes on its same-host socket"};
    if (Status st = held.enter(where[i].slot, p.remote_id, "peer"); !st.ok()) {
      std::lock_guard<std::mutex> lk(map_mu_);
      regions_.erase(p.remote_id);
      return st;
    }
  }
  // Host memory (a CUDA piece arrives as a StagingEndpoint's host copy).
  for (size_t i = 0; i < lane.pieces.size(); ++i) {
    const Piece& p = lane.pieces[i];
    bulk_copy(where[i].map->base + p.remote_offset, p.local, p.length, stream_min_);
  }
  // Our bytes went to the region's pages; if the owner withdrew it meanwhile they went to pages
  // it no longer maps (harmless to it) and the write did not happen as far as we can tell.
  return held.still("peer");
}

void ShmEndpoint::serve_pull(const Job& job) {
  const FrameHeader& h = job.hdr;
  Status st;
  std::vector<RegionPin> pins;
  std::vector<cma::Span> spans;
  Held held(leases_);
  for (const PullPiece& p : job.pull) {
    RegionPin pin = events_->registry().pin(p.dst_region, p.dst_offset, p.length, &st, "target");
    if (!pin) break;
    if (!pin.get()->location.is_host()) {
      st = {ErrorCode::kUnsupported, "shm cannot write region " + std::to_string(p.dst_region) + " (" +
                                         pin.get()->location.to_string() + " memory)"};
      break;
    }
    if (p.src_region != 0 && !(st = held.enter(p.src_slot, p.src_region, "your source")).ok()) break;
    spans.push_back({pin.get()->base + p.dst_offset, p.src_addr, p.length});
    pins.push_back(std::move(pin));
  }
  if (st.ok()) st = cma::read(pid_.load(), spans);
  if (st.ok()) st = held.still("your source");
  if (!st.ok()) SLUICE_LOG(kDebug, "shm: refused a write: " << st.message);
  pins.clear();
  if (h.flags & kImmPart) {
    bool deliver = false, overflow = false;
    {
      std::lock_guard<std::mutex> lk(imm_mu_);
      if (imm_.size() >= kMaxImmInProgress && !imm_.count(h.op_id)) {
        overflow = true;
      } else {
        auto& p = imm_[h.op_id];
        p.first++;
        p.second |= !st.ok();
        if (p.first >= h.aux) {
          deliver = !p.second;
          imm_.erase(h.op_id);
        }
      }
    }
    if (overflow) {
      fail({ErrorCode::kProtocol, "peer has more than 65536 write_with_imm batches in progress"}, true);
      return;
    }
    if (deliver) events_->matcher().push_imm(h.imm);
  }
  OutFrame f;
  f.text = st.message.substr(0, kMaxMessageText);
  f.hdr = make_frame(st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, h.region, 0, f.text.size(), kLaneEnd, 0, 0,
                     static_cast<uint16_t>(st.code));
  if (control_) control_->post(std::move(f));
}

Status ShmEndpoint::serve_rts(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
  RtsSource src{};
  if (h.length != sizeof(src) || !payload.read(&src, sizeof(src)))
    return {ErrorCode::kProtocol, "SEND_RTS without its 16-byte source"};
  uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
  auto claim = events_->matcher().claim(h.op_id, length, /*lazy=*/true);
  if (claim.error.code == ErrorCode::kProtocol) return claim.error;
  Status st = claim.error;
  // Region 0: the sender names no region of its own (a StagingEndpoint's host copy, alive
  // until this send is acked), so there is no lease to check and the copy goes by address.
  // That gives the sender nothing: we read only the sender's own memory (process_vm_readv
  // on its pid, which the kernel named), at most n bytes, into the recv buffer or the
  // bounded stash; a named region was never a bound on the address either.
  // Engine-allocated (memfd) memory of the sender that we mapped: copied with memcpy out of
  // the mapping, checked against the region as its owner described it (a sender that names
  // an address outside it is read with process_vm_readv, its own memory only, as above).
  if (claim.dest && st.ok() && std::min(length, claim.capacity) > 0) {
    // Into a posted recv: the last part of the copy completes it and acks (send_part_done).
    ch.worked(copy_send(std::move(claim), h.op_id, src.region, src.slot, h.region, std::min(length, claim.capacity)));
    return Status::Ok();
  }
  if (claim.stash && length > 0) {
    Held held(leases_);
    std::shared_ptr<Mapping> keep;
    uint32_t slot = src.slot;
    const uint8_t* mapped = src.region != 0 ? send_source(src.region, h.region, length, &keep, &slot) : nullptr;
    if (src.region != 0) st = held.enter(slot, src.region, "the sender's");
    // The copy writes into a recv's buffer once one takes the stash: a failure of the
    // endpoint waits for it.
    const bool copying = st.ok() && begin_copy();
    if (st.ok() && !copying) st = {ErrorCode::kCancelled, "endpoint closed"};
    // No recv posted: the buffer grows chunk by chunk as the copy succeeds, so an announced
    // size that the sender's memory does not back costs nothing.
    constexpr uint64_t kChunk = 1 << 20;
    for (uint64_t off = 0; st.ok() && off < length;) {
      uint64_t k = std::min(kChunk, length - off);
      uint8_t* dst = MessageMatcher::stash_room(claim, off + k);
      if (mapped) std::memcpy(dst + off, mapped + off, k);
      else st = cma::read(pid_.load(), {{dst + off, h.region + off, k}});
      off += k;
    }
    ch.worked(length);
    if (st.ok()) st = held.still("the sender's");
    if (copying) end_copy();
  }
  st = events_->matcher().deliver(claim, st);
  post_status(ch, FrameType::kSendAck, h.op_id, 0, st);
  return Status::Ok();
}

namespace {
// Region descriptions that SEND_RTS frames may have in flight (send_source); past it such a
// SEND is copied with process_vm_readv, as it would be anyway until the description arrives.
constexpr size_t kRtsDescribes = 16;
}  // namespace

const uint8_t* ShmEndpoint::send_source(uint64_t id, uint64_t addr, uint64_t n, std::shared_ptr<Mapping>* keep,
                                        uint32_t* slot) {
  bool describe = false;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto it = regions_.find(id);
    if (it != regions_.end()) {
      const RemoteRegion& rr = it->second;
      // Overflow-safe: addr - rr.addr and rr.length - n are computed only once they cannot wrap.
      if (!rr.map || addr < rr.addr || n > rr.length || addr - rr.addr > rr.length - n) return nullptr;
      *keep = rr.map;
      *slot = rr.slot;
      return rr.map->base + (addr - rr.addr);
    }
    // The id comes from the peer's SEND_RTS: at most kRtsDescribes of its descriptions are
    // fetched at once, so a peer naming ids by the thousand starts no more than that.
    describe = describing_.size() < kRtsDescribes && describing_.insert(id).second;
  }
  // Learned once, in the background, like a write's destination (shm_post.cpp): this SEND goes
  // with process_vm_readv, the next ones from this region through the mapping if it is a memfd.
  if (describe) start_describe(id);
  return nullptr;
}

uint64_t ShmEndpoint::copy_send(MessageMatcher::Claim&& claim, uint64_t op_id, uint64_t region, uint32_t slot,
                                uint64_t addr, uint64_t n) {
  auto c = std::make_shared<SendCopy>(leases_);
  c->claim = std::move(claim);
  c->op_id = op_id;
  uint8_t* const dst = c->claim.dest;
  const uint8_t* mapped = region != 0 ? send_source(region, addr, n, &c->keep, &slot) : nullptr;
  Status st = region != 0 ? c->held.enter(slot, region, "the sender's") : Status::Ok();
  // The copy writes into the recv's buffer: a failure of the endpoint waits for it (the copy
  // count is held until the last part is done, see send_part_done).
  if (st.ok() && !begin_copy()) {
    st = {ErrorCode::kCancelled, "endpoint closed"};
    c->keep.reset();
  }
  if (!st.ok()) {
    finish_send_copy(*c, st);
    return 0;
  }
  const uint64_t part_min = std::max<uint64_t>(split_min_ / 2, 1);
  const int parts = split_min_ == 0 || n < split_min_
                        ? 1
                        : static_cast<int>(std::min<uint64_t>(n / part_min, host_.copy_pool().size() + 1));
  // Page-aligned parts, so that no two threads copy into one page.
  const uint64_t step = parts <= 1 ? n : (n / parts + 4095) & ~uint64_t(4095);
  std::vector<Job> queued;
  for (uint64_t off = step; off < n; off += step) {
    Job j;
    j.kind = Job::kPart;
    j.send = c;
    j.dst = dst + off;
    j.src = addr + off;
    j.mapped = mapped ? mapped + off : nullptr;
    j.len = std::min(step, n - off);
    queued.push_back(std::move(j));
  }
  c->left.store(static_cast<int>(queued.size()) + 1, std::memory_order_relaxed);
  if (!queued.empty()) {
    bool stopped;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stopped = stop_;
      if (!stopped) {
        for (auto& j : queued) jobs_.push_back(std::move(j));
        schedule_locked();
      }
    }
    if (stopped)
      for (size_t i = 0; i < queued.size(); ++i) send_part_done(c, {ErrorCode::kCancelled, "endpoint closed"});
  }
  // No shm.take_back here: a receiving thread that took back the parts of SENDs in a burst
  // copied whole messages instead of reading the next SEND_RTS for the pool (64 x 8 of 2-4 MiB
  // over CMA: 25-35 % slower) for a lone 1 MiB SEND's 5-25 % (docs/peers.md, "take back").
  send_part_done(c, copy_part(pid_.load(), dst, addr, mapped, std::min(step, n), stream_min_));
  return std::min(step, n);
}

void ShmEndpoint::send_part_done(const std::shared_ptr<SendCopy>& c, const Status& part) {
  if (!part.ok()) {
    std::lock_guard<std::mutex> lk(c->mu);
    if (c->st.ok()) c->st = part;
  }
  if (c->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Status st;
  {
    std::lock_guard<std::mutex> lk(c->mu);
    st = c->st;
  }
  if (st.ok()) st = c->held.still("the sender's");
  end_copy();
  finish_send_copy(*c, st);
}

void ShmEndpoint::finish_send_copy(SendCopy& c, const Status& st) {
  // The sender's answer first: a receiver that closes as soon as its recv completes still
  // acks the message it took.
  if (control_) post_status(*control_, FrameType::kSendAck, c.op_id, 0, MessageMatcher::sender_status(c.claim, st));
  events_->matcher().deliver(c.claim, st);
}

void ShmEndpoint::stop_io() {
  if (events_) events_->matcher().clear_offerer(this);  // no offer() runs once this returned
  {
    std::lock_guard<std::mutex> lk(ctl_mu_);
    if (control_) control_->shutdown();
  }
  std::vector<std::shared_ptr<SendCopy>> parts;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    // Parts of a SEND's copy that no pool thread started: failed below, outside mu_ (the
    // last part of a copy completes its recv and gives back the copy count we wait for).
    for (auto& j : jobs_)
      if (j.kind == Job::kPart) parts.push_back(std::move(j.send));
    jobs_.clear();
    for (; post_count_ > 0; --post_count_, post_head_ = (post_head_ + 1) % post_ring_.size())
      post_ring_[post_head_].reset();
  }
  for (auto& c : parts) send_part_done(c, {ErrorCode::kCancelled, "endpoint closed"});
  {
    std::unique_lock<std::mutex> lk(mu_);
    // EndpointBase::fail() fails the ops next: no copy may still be writing into their memory
    // then. Running jobs are not waited for here (this may run on a pool thread, inside one
    // of ours, which is never inside a copy here); copies that began are waited for, and no
    // new one begins (begin_copy). close() waits for the running jobs.
    idle_cv_.wait(lk, [&] { return copies_ == 0; });
  }
  {
    // Lanes waiting for a region description: their ops are failed with the others.
    std::lock_guard<std::mutex> lk(map_mu_);
    parked_.clear();
  }
  std::lock_guard<std::mutex> lk(track_mu_);
  pulls_.clear();
}

bool ShmEndpoint::begin_copy() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) return false;
  ++copies_;
  if (copy_delay_ms_ > 0) {
    // Test only: the copy is in flight (counted) but has not written yet.
    mu_.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(copy_delay_ms_));
    mu_.lock();
  }
  return true;
}

void ShmEndpoint::end_copy() {
  std::lock_guard<std::mutex> lk(mu_);
  if (--copies_ == 0) idle_cv_.notify_all();
}

}  // namespace sluice::detail::shm
