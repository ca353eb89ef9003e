// One shm endpoint: the control channel is a Unix-domain socket whose other end the kernel
// names (SO_PEERCRED), so every copy targets the process that proved itself, never a pid a
// message claimed. Who copies what:
// - reads: this side copies out of the peer's region (its mapped memfd, else process_vm_readv)
//   at the address the peer described over the authenticated socket, inside the peer's lease,
//   and keeps the bytes only if the lease still holds afterwards;
// - writes into a peer's memfd region (once described and mapped): this side copies into the
//   mapping, inside the lease; after the owner frees it those pages are the mapping's alone;
// - every other write is a PULL_WRITE: the owner copies the bytes into its own region with
//   process_vm_readv, so no peer ever writes into memory by address.
// This side's own memory is host memory only: CUDA pieces it initiates from or into are
// staged by the StagingEndpoint that the transport puts in front (shm_transport.cpp).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/common/lease_table.hpp"
#include "transport/shm/copy_pool.hpp"
#include "transport/common/endpoint_base.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_endpoints.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::shm {

using same_host::kMaxPullPieces;
using same_host::PullPiece;
using same_host::RtsSource;

// Whether an endpoint's Host is still there, for work that can outlive the endpoint's close
// (the answer to a describe, which arrives on a reactor and may find the user still holding a
// closed endpoint of an engine that is gone): the transport closes the gate first thing in
// its destructor, after waiting for a holder to finish.
class HostGate {
 public:
  // Runs f() while the host is alive; false, without running it, once it is gone.
  template <class F>
  bool run(F&& f) {
    std::shared_lock<std::shared_mutex> lk(mu_);
    if (!alive_) return false;
    f();
    return true;
  }
  void close() {
    std::unique_lock<std::shared_mutex> lk(mu_);
    alive_ = false;
  }

 private:
  std::shared_mutex mu_;
  bool alive_ = true;
};

// What endpoints need from their transport (it outlives their open life; see HostGate).
class Host {
 public:
  virtual ~Host() = default;
  virtual const Registry& registry() const = 0;
  virtual const std::string& engine_id() const = 0;
  virtual int lease_fd() const = 0;  // this engine's lease table (shared with peers), or -1
  virtual void forget(uint64_t token) = 0;
  virtual CopyPool& copy_pool() = 0;  // runs the copy jobs of every endpoint (copy_pool.hpp)
  virtual const std::shared_ptr<HostGate>& gate() = 0;
};

// A peer's memfd region mapped into this process.
struct Mapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  ~Mapping();
};

// One of the peer's regions as the peer described it over the authenticated socket.
struct RemoteRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t slot = kNoLease;
  std::shared_ptr<Mapping> map;  // null: moved with process_vm_readv
};

// One post of the thin post path (a write, or a signal that goes as a frame). Reused from the
// endpoint's free list, so a post allocates nothing in the steady state.
struct PostOp : TransferOp {
  // Executed by the owner (a PULL_WRITE, a SIGNAL frame): only then may an ACK complete it.
  // A post this side copies itself must never be completed by a frame (its source is read
  // until the copy ends, and an early completion would release its pin).
  bool by_peer = false;
  uint64_t token = 0;  // in pending_
  PullPiece pull{};  // the PULL_WRITE's payload
};

// One SEND's copy into its posted recv (serve_rts), cut into parts: the receiving thread
// copies part 0 and the copy pool the others, and whichever part ends last completes the recv
// and acks the sender (finish_send_copy). Nobody waits for the parts: the receiving thread goes
// on to the next message, so a batch of large SENDs keeps every copy thread busy (waiting for
// each message's parts held a batch of 1 MiB SENDs to one thread's process_vm_readv rate).
// Defined in shm_endpoint.cpp.
struct SendCopy;

// The describe id that names an endpoint's eager ring (never a region id: those stay below 2^52).
constexpr uint64_t kEagerRingId = ~uint64_t{0};

class ShmEndpoint final : public EndpointBase,
                          public StreamChannel::Handler,
                          public same_host::ProvenEndpoint,
                          public ProgressSource,
                          public CopyClient,
                          public CreditSink,
                          public RecvOfferer,
                          public std::enable_shared_from_this<ShmEndpoint> {
 public:
  ShmEndpoint(const EndpointSetup& s, Host& host, std::string peer_socket);
  ~ShmEndpoint() override;

  // ProgressSource: a thread that waits for one of our futures receives on the control
  // channel itself (WaiterReceive): the ACK of a PULL_WRITE, a SEND_ACK, is read and its op
  // completed on the waiter's own thread, with no reactor wake-up and no reactor-to-waiter
  // hand-off. Not when the thread's ops since its last wait all went to the copy pool
  // (mapped writes, reads): their completion never comes over the socket, and the waiter
  // then sleeps on its future as before. A completion made elsewhere (a copy pool job, a
  // failure, the watchdog) interrupts the driving waiter.
  std::shared_ptr<ProgressSource> progress_source() override { return shared_from_this(); }
  bool progress() override { return false; }
  std::chrono::microseconds poll_budget() const override { return {}; }
  bool blocking() const override { return true; }
  void interrupt() override { waiter_.interrupt(); }
  bool drive(const std::atomic<bool>& done, std::chrono::steady_clock::time_point deadline) override;

  void connect(const ChannelOpener& open) override;
  nlohmann::json attach(int index, const nlohmann::json& hello) override;
  bool adopt(int index, net::Socket sock) override;
  void submit(std::shared_ptr<TransferOp> op) override;
  void send(std::shared_ptr<MessageOp> op) override;
  // The thin post path: writes go as mapped copies (on the copy pool) or PULL_WRITEs, so
  // they finish out of order; sequencer_ holds each signal until the writes before it finished.
  Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) override;
  Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) override;
  // Per-operation deadlines (PendingOps::expire). An op past its own deadline is spared while
  // this endpoint keeps completing work of ours (lanes, answers to our requests): it waits in
  // our own queue behind a moving backlog. Frames the peer sends of its own accord (requests,
  // imms, chatter) keep nothing alive.
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override;
  void close(const Status& why) override;

  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override;
  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

  // Called by the transport's socket service.
  bool active() const { return active_; }
  // Passive side: the peer proved itself on our socket; takes the socket as control channel.
  void authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string& engine) override;
  // Answers the authenticated peer's question about one of our regions (*fd_out: its memfd).
  nlohmann::json describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const override;

  // CopyClient: a pool thread runs one of our jobs.
  void run_one() override;
  // CreditSink: a recv took an eager message of the peer's (or it was delivered on arrival):
  // the peer may queue that many bytes again.
  void release_credit(uint64_t bytes) override;
  // A message the matcher stashed in our eager ring was copied out (serve_ring).
  void release_held(uint64_t end) override;
  void copy_held(void* dst, const void* src, uint64_t n) override;
  // RecvOfferer (shm_offer.cpp): a recv that waits for its message, in a region of ours the
  // peer can map, is offered to the peer in our eager ring.
  void offer(MessageOp& recv, uint64_t seq, uint64_t incoming) override;
  // The answer to start_describe(id) (a reactor thread, or the caller when the ask could not
  // start): keeps the description and re-queues the jobs parked on it, with `st` if it failed.
  void described(uint64_t id, const Status& st, const nlohmann::json& reply, int fd);
  Host& host() const { return host_; }

 private:
  struct Job {
    enum Kind { kLane, kServe, kPart, kPopulate } kind = kLane;
    std::shared_ptr<TransferOp> op;
    uint64_t token = 0;
    size_t lane = 0;
    // kServe: a peer's PULL_WRITE
    FrameHeader hdr{};
    std::vector<PullPiece> pull;
    Status error;  // kLane: the region description it was parked on could not be had
    // kPart: one part of a SEND's copy (process_vm_readv of the peer's `src` into `dst`, or a
    // memcpy from `mapped`, our mapping of the sender's memfd region)
    std::shared_ptr<SendCopy> send;
    uint8_t* dst = nullptr;
    uint64_t src = 0, len = 0;
    const uint8_t* mapped = nullptr;
    // kPopulate: prefault [src, src + len) of our mapping of a peer region (see described())
    std::shared_ptr<Mapping> map;
  };

  void install(net::Socket sock);
  void enqueue(Job job);
  void run_here(Job& job);  // a small operation's lane, on the submitting thread
  // shm.take_back. After its own lane: takes back the lanes of `op` that no pool thread has
  // started yet (the pool's wake-up then costs the op nothing); false when none is left queued.
  bool take_back(const std::shared_ptr<TransferOp>& op, Job& out);
  // mu_ held: puts this endpoint in the pool's ready list if it has work and is not there.
  void schedule_locked();
  void run_job(Job& job);
  // Asks the peer to describe its region `id` without waiting (shm_describe.cpp); the caller
  // put id into describing_. The answer comes to described().
  void start_describe(uint64_t id);
  // A read lane needs the descriptions of the peer's regions it reads: true if one is still
  // unknown, and then the job waits in parked_ (and its description was asked for).
  bool park_if_undescribed(Job& job);
  Status run_lane(const TransferOp& op, const Lane& lane);
  Status run_read(const TransferOp& op, const Lane& lane);
  Status run_mapped_write(const TransferOp& op, const Lane& lane);
  void post_pull(const std::shared_ptr<TransferOp>& op, uint64_t token);
  void serve_pull(const Job& job);
  Status serve_rts(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload);
  // The copy of a SEND's n bytes into the recv it claimed: from our mapping of the sender's
  // memfd region when it is one, else from the sender's address with process_vm_readv; cut
  // into parts over the copy pool from shm.send_split_min on. Returns once part 0 is copied
  // (its byte count: the caller's share of the work); the last part completes the recv and
  // acks the sender.
  uint64_t copy_send(MessageMatcher::Claim&& claim, uint64_t op_id, uint64_t region, uint32_t slot, uint64_t addr,
                 uint64_t n);
  void send_part_done(const std::shared_ptr<SendCopy>& c, const Status& st);
  void finish_send_copy(SendCopy& c, const Status& st);  // acks the sender, completes the recv
  // Where [addr, addr+n) of the peer's region `id` lies in our mapping of it (the region as its
  // owner described it, `*keep` holding the mapping and `*slot` its lease), or null: not a
  // mapped memfd region, or not inside it. An unknown region is described in the background.
  const uint8_t* send_source(uint64_t id, uint64_t addr, uint64_t n, std::shared_ptr<Mapping>* keep, uint32_t* slot);
  Status take_pull(const FrameHeader& h, PayloadReader& payload);
  // Eager SENDs (shm.eager_max, shm.eager_credit). A small SEND goes with its bytes in the
  // frame and completes once it is queued, within buffer space the receiver granted (a
  // CREDIT frame, sent when the channel is installed and again as recvs take the messages):
  // no round trip, no process_vm_readv. The receiver enforces its own grant, so a peer that
  // ignores it is refused, never buffered without bound.
  // The bytes of an eager SEND go through the receiver's eager ring when the sender has it
  // mapped and it has room (shm_eager.cpp), else in the frame.
  void grant_credit();
  bool send_eager(const std::shared_ptr<MessageOp>& op);
  // Where place_in_ring put a message: not in the ring (it goes in its frame); in the ring with
  // a SEND_RING frame in *hdr (the queue was full); in the queue alone; in the queue, with a
  // RING_BELL frame in *hdr to wake the receiver.
  enum class Placed { kNo, kFrame, kQueued, kBell };
  Placed place_in_ring(const MessageOp& op, FrameHeader* hdr);
  Status serve_eager(const FrameHeader& h, PayloadReader& payload);
  Status serve_ring(const FrameHeader& h);
  // Takes the messages waiting in our ring's descriptor queue, in sequence order: it stops at
  // one whose turn has not come (a SEND or SEND_RTS frame with an earlier sequence is still on
  // its way), so every message frame is served between two drains. When the queue is empty it
  // tells the sender to ring again (RingControl::awake), then looks once more.
  Status drain_ring();
  // A frame that carries a message, served in sequence order with the queued ones.
  template <class Serve>
  Status in_order(Serve&& serve) {
    Status st = drain_ring();
    if (st.ok()) st = serve();
    return st.ok() ? drain_ring() : st;
  }
  Status serve_ring_message(uint64_t seq, uint64_t n, uint64_t pos);
  Status take_credit(const FrameHeader& h);
  // Recv offers (shm_offer.cpp, shm.recv_offers). A lone rendezvous SEND woke the receiver
  // (SEND_RTS), which copied and woke the sender back (SEND_ACK): two wake-ups around one
  // copy, 131 us for a 1 MiB message that memcpy moves in 51. The receiver now writes each
  // posted recv that waits for its message into its ring's offer slots (no frame); a sender
  // that finds the offer for its message copies into its mapping of the recv's buffer, sends
  // one SEND_PUT frame and completes at once.
  // Sending side: true if the offer for op's message was taken and the message went this way.
  bool send_offered(const std::shared_ptr<MessageOp>& op);
  Status serve_put(const FrameHeader& h, PayloadReader& payload);
  // The answer to start_describe(kEagerRingId): maps the peer's ring (sending side).
  void ring_described(const Status& st, const nlohmann::json& reply, int fd);
  // Our ring for the peer's eager SENDs (receiving side; allocated on the first ask): a
  // duplicate of its descriptor, and its size in *size (its layout in the others).
  int eager_ring_fd(uint64_t* size, uint64_t* data, uint64_t* slots, uint64_t* offers) const;
  Status take_ack(const FrameHeader& h, PayloadReader& payload);
  bool mapped_locked(uint64_t id) const;
  // EndpointBase: shuts the control channel and the job queue, then waits until no copy
  // into an op's memory is running (see begin_copy).
  void stop_io() override;
  void send_imm(uint64_t token, const std::shared_ptr<TransferOp>& op) override;
  // A copy into memory an op owns (a read's destination, a recv buffer) runs between these:
  // begin_copy() refuses once the endpoint stopped, and stop_io() waits for the copies that
  // began, so no op completes with a failure while a copy may still write into its memory.
  bool begin_copy();
  void end_copy();
  // Remember, for this thread's next wait, whether an op's answer comes over the control
  // channel (PULL_WRITE, SEND_RTS) or from the copy pool (see drive()).
  void note_submit(bool control);

  // Thin post path.
  std::shared_ptr<PostOp> take_post_op();
  void on_post_done(const std::shared_ptr<TransferOp>& op, const Status& st);
  void issue_signal(const PostSignal& s);
  Status run_post_write(const PostOp& op);
  Status serve_signal(StreamChannel& ch, const FrameHeader& h);
  void push_post_job(std::shared_ptr<TransferOp> op);

  Host& host_;
  const bool active_;
  const uint64_t token_;
  const std::string peer_socket_;
  const std::chrono::milliseconds timeout_;
  std::atomic<pid_t> pid_{0};  // set once the peer proved itself
  std::atomic<bool> authenticated_{false};
  std::mutex ctl_mu_;  // guards control_ being installed (a service thread) against fail()/close()
  std::unique_ptr<StreamChannel> control_;
  WaiterReceive waiter_;  // drive() and interrupt()
  std::atomic<std::chrono::steady_clock::rep> moving_{0};  // when work of ours last completed
  void moved() { moving_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  const int copy_delay_ms_;  // test only (shm.test_copy_delay_ms): a copy waits this long first
  const int put_delay_ms_;   // test only (shm.test_put_delay_ms): a copy into an offered recv too
  const uint64_t inline_max_;  // shm.inline_max
  const uint64_t inline_split_max_;  // shm.inline_split_max
  const bool take_back_;             // shm.take_back
  const int pool_wait_;              // shm.pool_wait_us
  const std::chrono::microseconds busy_wait_;  // EngineConfig::busy_wait_us, resolved
  const uint64_t split_min_;   // shm.send_split_min
  const uint64_t stream_min_;  // shm.stream_copy_min (bulk_copy.hpp)
  const uint64_t eager_max_;     // shm.eager_max: the largest eager SEND sent or taken
  const uint64_t eager_credit_;  // shm.eager_credit: eager bytes queued, either way, not yet taken
  std::atomic<uint64_t> send_credit_{0};     // eager bytes we may still queue to the peer
  std::atomic<uint64_t> peer_eager_max_{0};  // the largest eager SEND the peer takes (0: none)
  std::atomic<uint64_t> eager_held_{0};      // the peer's eager bytes that no recv took yet
  std::atomic<uint64_t> credit_owed_{0};     // taken by recvs, not yet given back (release_credit)
  // The eager ring (shm_eager.cpp). Receiving side: ours, which the peer writes into.
  const bool ring_eager_;  // shm.eager_ring
  const uint64_t ring_slots_;  // shm.eager_slots: descriptors in the queue of the ring we hand out
  const uint64_t populate_max_;  // shm.map_populate_max
  const uint64_t offers_;      // shm.recv_offers: offer slots in the ring we hand out (0: none, and we take none)
  const uint64_t offer_max_;   // shm.recv_offer_max: the largest SEND we copy into an offered recv
  mutable std::mutex rx_ring_mu_;
  mutable int rx_ring_fd_ = -1;
  mutable uint64_t rx_ring_size_ = 0;   // its data area (shm_ring.hpp)
  mutable uint64_t rx_ring_slots_ = 0;  // its descriptor queue
  uint64_t rx_desc_next_ = 0;           // the next descriptor to take (the channel reader's)
  mutable uint64_t rx_ring_offers_ = 0;  // its offer slots
  mutable std::atomic<uint8_t*> rx_ring_{nullptr};
  // What we offered in each offer slot (receiving side; sized with the ring): the slot is ours
  // to reuse once its message was claimed.
  struct OfferRecord {
    uint64_t seq = 0;
    const MessageOp* recv = nullptr;
    uint64_t capacity = 0;
    bool used = false;
  };
  std::mutex offers_mu_;  // never held while calling into the matcher (offer() runs under its lock)
  mutable std::vector<OfferRecord> rx_offers_;
  mutable std::shared_ptr<Mapping> rx_ring_map_;  // owns the mapping; stash slots that read it hold it too
  std::atomic<uint64_t> rx_ring_next_{0};  // where the next message goes (the channel reader moves it)
  // Ring messages not yet copied out, oldest first: their ends, and whether copied out. A
  // message stashed in place (no recv yet) is copied out by the recv that takes it, on that
  // thread, so they may finish out of order; the sender may write only behind the oldest one
  // still held (rx_ring_free_, sent in CREDIT frames).
  std::mutex rx_hold_mu_;
  std::deque<std::pair<uint64_t, bool>> rx_held_;
  std::atomic<uint64_t> rx_ring_free_{0};
  void ring_hold(uint64_t end);  // a message up to `end` was stashed in place
  void ring_done(uint64_t end);  // the message up to `end` was copied out (hold or not)
  // Sending side: the peer's, mapped here.
  std::atomic<bool> tx_ring_asked_{false};
  std::atomic<bool> tx_ring_mapped_{false};  // ring_described() ran (once)
  std::atomic<bool> tx_ring_ready_{false};   // tx_ring_ set
  std::shared_ptr<Mapping> tx_ring_;
  uint64_t tx_data_ = 0, tx_slots_ = 0;   // its data area and descriptor queue (set before ready)
  uint64_t tx_offers_ = 0;                // its offer slots (set before ready)
  uint64_t tx_desc_ = 0;                  // our next descriptor (under the send lock)
  uint64_t tx_head_ = 0;                  // where our next message goes (under the send lock)
  std::atomic<uint64_t> tx_tail_{0};      // everything before it the peer copied out

  std::mutex mu_;
  std::condition_variable idle_cv_;  // copies_ or running_ fell
  std::deque<Job> jobs_;
  // Mapped post writes waiting for a pool thread: a ring that only grows, so that queueing a
  // post allocates nothing in the steady state (a Job in jobs_ would).
  std::vector<std::shared_ptr<TransferOp>> post_ring_;
  size_t post_head_ = 0, post_count_ = 0;
  bool stop_ = false;
  int copies_ = 0;  // copies between begin_copy() and end_copy()
  bool scheduled_ = false;  // in the pool's ready list
  int running_ = 0;         // our jobs running on pool threads now (close() waits for them)

  // Post ops for reuse; one is free again once only this list holds it.
  std::mutex post_ops_mu_;
  std::vector<std::shared_ptr<PostOp>> post_ops_;
  size_t post_cursor_ = 0;

  mutable std::mutex map_mu_;
  PeerLeases leases_;
  std::unordered_map<uint64_t, RemoteRegion> regions_;  // peer region id -> description
  std::unordered_set<uint64_t> describing_;             // descriptions being fetched
  std::unordered_map<uint64_t, std::vector<Job>> parked_;  // read lanes waiting for one

  std::mutex imm_mu_;
  std::unordered_map<uint64_t, std::pair<uint32_t, bool>> imm_;  // owner side: lanes seen, failed
  // PULL_WRITE ops in flight on this side: frames still unanswered per lane (a lane of more
  // than kMaxPullPieces pieces goes as several frames).
  struct PullTrack {
    std::vector<std::pair<uint32_t, Status>> lanes;  // frames left, first error
  };
  std::mutex track_mu_;
  std::unordered_map<uint64_t, PullTrack> pulls_;
  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace sluice::detail::shm
