// One rdma endpoint: N RC queue pairs ("channels") to one peer, spread over the engine's rails
// (QP c on our rail c % L and the peer's rail c % R). See docs/rdma.md for the design; the
// implementation is split by concern:
//   endpoint.cpp   QP set-up, connection, teardown
//   data_path.cpp  READ / WRITE / WRITE_WITH_IMM: work requests, posting, back-pressure,
//                  completions, imm ordering
//   messages.cpp   control messages on QP 0: SEND/RECV rendezvous, region-gone notices
//   progress.cpp   completion polling (progress thread and polling waiters), failure
//   post_path.cpp  the thin post path: post_write / post_signal / flush on QP 0
//   failover.cpp   replacing a broken queue pair, moving off a rail that went down and back
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "transport/common/endpoint_base.hpp"
#include "transport/common/redialer.hpp"
#include "transport/rdma/rails.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::rdma {

constexpr int kRecvSlots = 1024;  // control receive WQEs pre-posted on QP 0
constexpr int kSlotBytes = 64;
constexpr int kMaxSends = 128;    // RTS in flight per direction
// Receive WQEs on QP 0 kept for control messages: the peer's RTS (at most kMaxSends), FINs
// answering our RTS (at most kMaxSends), GONE / GONE_ACK, and CREDIT messages. The rest is the
// peer's imm credit: an imm write takes one, and the receiver gives them back (CREDIT, every
// credit batch of reposted slots), so imm writes never find the receive queue empty.
constexpr int kCtrlReserve = 2 * kMaxSends + 16 + 32 + 2 * 64;  // + MOVE requests (64 channels at most)
constexpr int kCtrlSendSlots = 2 * kMaxSends + 64;
constexpr int kSignalEvery = 64;
constexpr uint64_t kMaxWrBytes = 1ull << 30;
constexpr int kMaxSge = 8;  // gather entries per WR we ask for (less if the device allows less)
constexpr std::chrono::milliseconds kCallerWindow{1};
constexpr std::chrono::milliseconds kCallersModeSleep{5};

// wr_id layout: the top two bits tag the kind.
constexpr uint64_t kTagCtx = 0ull << 62;    // signalled WR: channel << 40 | ring sequence
constexpr uint64_t kTagUnsig = 1ull << 62;  // unsignalled data WR: op token
constexpr uint64_t kTagRecv = 2ull << 62;   // receive slot index
constexpr uint64_t kTagMask = 3ull << 62;
constexpr uint64_t kSeqMask = (1ull << 40) - 1;

enum class CtxKind : uint8_t { kSlots, kLaneEnd, kImmChainEnd, kImmLaneEnd, kImmFinal, kCtrl, kRdvRead };

// What a signalled work request's completion must do.
struct WrCtx {
  CtxKind kind = CtxKind::kSlots;
  int slots = 0;       // send-queue slots it returns (itself and the unsignalled WRs before it)
  uint64_t token = 0;  // op token / rendezvous id
  uint32_t aux = 0;    // ctrl send slot / lane count
  uint64_t post_mark = 0;  // thin post path: posts queued on the QP up to and including this WR
};

struct Wr {
  ibv_send_wr wr{};
  std::array<ibv_sge, kMaxSge> sges;  // the first nsge are set; wr.sg_list points here once posted
  int nsge = 0;
  bool signal = false;
  CtxKind kind = CtxKind::kSlots;
  uint64_t token = 0;
  uint32_t aux = 0;
  uint64_t post_mark = 0;  // set by post(): Chan::posts_queued once this WR is queued
  bool post = false;       // the last WR of a thin-path post (post_write / post_signal)
};

// kMove: the accepting side asks the dialing side to replace channel `seq` (generation `addr`;
// status 1: its queue pair broke, 0: move it back to its home rail), since only the dialer
// dials replacements.
enum CtrlType : uint32_t { kRts = 1, kFin = 2, kGone = 3, kGoneAck = 4, kCredit = 5, kMove = 6 };

struct CtrlMsg {
  uint32_t type;
  uint32_t status;  // FIN: ErrorCode
  uint64_t seq;
  uint64_t addr;
  uint64_t len;
  uint32_t rkey;
  uint32_t pad;
};
static_assert(sizeof(CtrlMsg) <= kSlotBytes);

// One queue pair and its send-side state.
struct Chan {
  int rail = 0;       // our rail (under mu once connected: failover moves it)
  int peer_rail = 0;  // the peer's rail it connects to
  int home_rail = 0;  // where it belongs: failover brings it back here once the rail is up
  ibv_qp* qp = nullptr;
  std::mutex mu;
  // Failover (failover.cpp; channels other than 0). gen counts the queue pairs this channel
  // had (both sides agree: a replacement carries it); broken: the QP is in the error state and
  // its work was taken back, a replacement is due; usable: lanes may be placed here (false
  // from the break, or the start of a move back home, until the replacement is in).
  uint32_t gen = 0;
  bool broken = false;
  bool replacing = false;            // a replacement job is queued or running (dialing side)
  std::atomic<bool> usable{true};
  ibv_qp* retired_qp = nullptr;      // the previous QP: kept until the next replacement, so its
                                     // late completions never meet a reused QP number
  net::Socket retired_sock;          // the previous liveness socket, likewise
  int free = 0;
  int unsig = 0;
  std::deque<Wr> backlog;  // WRs waiting for send-queue slots, in order
  // Signalled WRs in flight, in posting order: an RC send queue completes in order, so the
  // completion of sequence s is ring[s % size] (no lookup table).
  std::vector<WrCtx> ring;
  uint64_t head = 0, tail = 0;
  net::Socket sock;
  bool sock_live = false;
  // Thin post path (QP 0 only; see post_path.cpp). Posts are numbered as they are queued; a
  // signalled WR's completion retires every post up to its mark (an RC send queue completes
  // in order), so most posts need no completion of their own.
  uint64_t posts_queued = 0;    // posts handed to post() (posted or in the backlog)
  uint64_t posts_signalled = 0; // the highest mark a signalled WR carries (posted or queued)
  uint64_t posts_retired = 0;   // posts whose completion arrived
  std::vector<RegionPin> post_pins;  // by post number % size: the source region, until retired
  std::condition_variable post_room;  // a poster waits here for room (posts in flight < bound)
  bool post_waiting = false;
};

// A lane whose work requests were on a channel that broke: sent again or failed.
struct LaneRef {
  uint64_t token = 0;
  uint32_t lane = 0;
};

// A completion queue (and its channel) per rail this endpoint has queue pairs on.
struct RailCq {
  int rail = 0;
  ibv_comp_channel* comp = nullptr;
  ibv_cq* cq = nullptr;
  unsigned events = 0;
};

struct Rendezvous {
  MessageMatcher::Claim claim;
  ibv_mr* stash_mr = nullptr;
};

// A write_with_imm batch whose imm is posted after its data (striped, or queued behind one).
struct ImmBatch {
  uint32_t imm = 0;
  uint32_t lanes = 0;
  uint32_t left = 0;
};

Status wc_status(const Verbs& v, const ibv_wc& wc, const std::string& what);

class RdmaEndpoint final : public EndpointBase,
                           public GoneListener,
                           public RailListener,
                           public ProgressSource,
                           public std::enable_shared_from_this<RdmaEndpoint> {
 public:
  RdmaEndpoint(std::shared_ptr<Rails> rails, const Registry* reg, const EndpointSetup& s,
               std::shared_ptr<Redialer> redialer);
  ~RdmaEndpoint() override;

  // TransportEndpoint
  void connect(const ChannelOpener& open) override;
  void peer_updated(const EngineInfo& peer) override;
  nlohmann::json attach(int index, const nlohmann::json& hello) override;
  bool adopt(int index, net::Socket sock) override;
  void submit(std::shared_ptr<TransferOp> op) override;
  void send(std::shared_ptr<MessageOp> op) override;
  std::shared_ptr<ProgressSource> progress_source() override { return shared_from_this(); }
  // The thin post path (post_path.cpp): every post goes to QP 0, so RC keeps them in order.
  Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) override;
  Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) override;
  Status flush(std::chrono::milliseconds timeout) override;
  // Per-operation deadlines (lane completions stamp their op): see PendingOps::expire. Only
  // counted: the core then closes the endpoint, which stops the queue pairs before failing
  // ops (the adapter may still be writing into an overdue read's buffer).
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override {
    return pending_.expire(now, timeout, what, /*fail=*/false);
  }
  void close(const Status& why) override;

  // GoneListener
  void region_gone(uint64_t id) override;
  // RailListener (failover.cpp)
  void rail_changed(int rail, bool up) override;
  bool replaces_channels() const override { return failover_; }
  std::pair<uint64_t, uint64_t> failover_counts() const override { return {replaced_.load(), retried_.load()}; }

  // ProgressSource: a waiter polls the CQs itself (no hand-off from the progress thread).
  bool progress() override;
  void begin_polling() override;
  void end_polling(bool satisfied) override;
  std::chrono::microseconds poll_budget() const override { return poll_budget_; }

 private:
  // endpoint.cpp
  RailCq& cq_for(int rail);
  void create_qp(int index, int rail, int peer_rail);
  ibv_qp* make_qp(int index, int rail);  // a QP in INIT on `rail`, not yet the channel's
  int peer_rail_up(int preferred) const;  // the peer's rail `preferred`, or one its info does not mark down
  QpAddress qp_address(const ibv_qp* qp, int rail) const;
  int retry_count_for(const Device& d) const;
  void bring_up_qp(ibv_qp* qp, int rail, const QpAddress& remote, const Negotiated& n);
  // Checks the peer's address against our port on `rail` (negotiate.hpp); throws naming both.
  Negotiated negotiate_with(int index, int rail, const QpAddress& remote) const;
  void bring_up(int index, const QpAddress& remote, const Negotiated& n);
  QpAddress local_qp_address(int index) const;
  nlohmann::json hello_body(int index);
  void take_peer(const nlohmann::json& j);
  void take_rkeys(const nlohmann::json& j);  // {"rkeys": {id: [rkey by rail]}}
  void take_region_keys(const EngineInfo& peer);  // the rkeys published with each region
  int peer_rails() const;
  void start_thread();
  void release();
  void flush_control(std::chrono::milliseconds limit);  // wait for control sends in flight
  // post_path.cpp
  Status post_admitted(Wr* wrs, size_t n, RegionPin&& pin, std::chrono::steady_clock::time_point deadline);
  void retire_posts(Chan& ch, uint64_t mark, const Status& st);  // ch.mu held
  // failover.cpp
  void configure_failover();  // rdma.failover, rdma.retry_rma, rdma.test_break_qp
  // ch.mu not held: retire c's QP and return its open lanes; *first: this call broke it.
  std::vector<LaneRef> take_back(int c, bool* first = nullptr);
  void adopt_replacement(int index, net::Socket sock);
  bool link_error(int c, int rail, const ibv_wc& wc);  // a completion error that breaks channel c only
  // The channel whose live QP on `rail` is number qpn (QP numbers are per device); -1: none
  // (a retired QP's).
  int chan_of_qp(int rail, uint32_t qpn);
  void break_channel(int c, const Status& why, bool tell_peer);
  void resend(const std::vector<LaneRef>& lanes, const Status& why);
  void schedule_replacement(int c, bool move_home);
  void replace(int c, bool move_home);  // redialer thread (dialing side)
  void install(int c, ibv_qp* qp, int rail, int peer_rail, uint32_t gen);
  nlohmann::json attach_replacement(int index, const nlohmann::json& h);
  void on_move(const CtrlMsg& m);
  void ask_peer_to_move(int c, bool broken);
  // data_path.cpp
  // Build lane `lane` of `op` for channel c (whose rails and generation the caller read under
  // its lock) and post it; false when the channel was replaced or broke meanwhile.
  [[nodiscard]] bool post_lane(const std::shared_ptr<TransferOp>& op, uint64_t token, int lane, int c, bool last_imm,
                               Status* st);
  // Post lane `lane` on a usable channel, preferring `c`, then the rails near `near_mask`.
  void place_lane(const std::shared_ptr<TransferOp>& op, uint64_t token, int lane, int c, uint32_t near_mask);
  [[nodiscard]] Status post(int c, Wr* wrs, size_t n);
  [[nodiscard]] Status post(int c, std::vector<Wr>& wrs) { return post(c, wrs.data(), wrs.size()); }
  [[nodiscard]] Status post_locked(Chan& ch, int c, Wr* wrs, size_t n);  // ch.mu held
  // ch.mu held: false (nothing posted) if channel c is no longer generation `gen` or broke.
  [[nodiscard]] bool post_gen_locked(Chan& ch, int c, uint32_t gen, Wr* wrs, size_t n, Status* st);
  Status drain(Chan& ch, int c);                            // ch.mu held
  void handle_send_completion(const ibv_wc& wc, int rail);  // rail: whose CQ it came from
  bool rkey_for(uint64_t remote_id, int peer_rail, uint32_t* rkey);
  const std::vector<int>& chans_near(uint32_t rails_mask);
  void release_imms();
  void post_imm(uint64_t token, uint32_t imm, uint32_t lanes);  // imm_mu_ held
  void fail_op(uint64_t token, const Status& st);
  // messages.cpp
  void post_recv_slot(uint32_t slot);
  void handle_recv(const ibv_wc& wc);
  void post_ctrl(const CtrlMsg& m);
  void start_send(std::shared_ptr<MessageOp> op);
  void on_rts(const CtrlMsg& m);
  void finish_rendezvous(uint64_t id, const Status& st);
  void on_fin(const CtrlMsg& m);
  // progress.cpp
  void run();
  int poll_locked();  // poll_mu_ held: poll every CQ once; the count or -1
  void handle(const ibv_wc& wc, int rail);
  bool arm_all();
  void sleep_on_events(int timeout_ms);
  void stop_io() override;  // EndpointBase::fail(): the queue pairs to the error state
  void wake();
  void wake_for_submit();  // a submit: records it and wakes the thread if it must watch the CQs

  std::shared_ptr<Rails> rails_;
  std::shared_ptr<Redialer> redialer_;
  ChannelOpener opener_;     // dialing side: replacements are dialed with it
  bool failover_ = true;     // rdma.failover
  bool retry_rma_ = true;    // rdma.retry_rma
  std::atomic<int> unusable_{0};  // channels with usable == false
  std::atomic<uint64_t> replaced_{0}, retried_{0};
  std::atomic<std::chrono::steady_clock::rep> local_error_at_{0};  // link_error(): the last excused local error
  int test_break_chan_ = -1;        // rdma.test_break_qp: test-only fault injection
  uint64_t test_break_after_ = 0;
  std::atomic<uint64_t> test_lanes_{0};
  std::mutex sock_mu_;  // the channels' liveness sockets (a replacement swaps one)
  // Held by a replacement under way (it creates queue pairs on our CQs); close() takes it
  // after stop_, so release() never runs under one. Recursive: fail() inside may call back.
  std::recursive_mutex replace_mu_;
  const Verbs& v_;
  const Registry* reg_;
  EndpointSetup setup_;
  const int nchan_;
  std::vector<std::unique_ptr<Chan>> chans_;
  std::vector<RailCq> cqs_;
  std::mutex cq_mu_;  // cqs_ grows while channels attach
  std::vector<QpAddress> remote_;
  int sq_depth_ = 0;
  uint32_t max_inline_ = 0;
  uint64_t max_wr_bytes_ = kMaxWrBytes;
  int max_sge_ = kMaxSge;     // gather entries per data WR (the devices' max_sge, SLUICE_RDMA_MAX_SGE)
  int max_sge_rd_ = kMaxSge;  // the same for RDMA READ (max_sge_rd, which some devices keep lower)
  // control slots (QP 0): receive ring and send ring, one registration on QP 0's rail
  std::vector<uint8_t> ctrl_mem_;
  ibv_mr* ctrl_mr_ = nullptr;
  uint64_t peer_scratch_addr_ = 0;
  uint32_t peer_scratch_rkey_ = 0;
  std::mutex ctrl_mu_;
  std::vector<uint32_t> ctrl_free_;
  // Thin post path: posts in flight on QP 0 at most post_bound_ (a share of its send queue,
  // so that posts alone never spill into the backlog); a post is signalled at least every
  // post_signal_every_ posts, so that the depth limit never waits for a completion that was
  // not asked for. post_atomics_: every rail can do IBV_WR_ATOMIC_FETCH_AND_ADD.
  uint64_t post_bound_ = 1;
  uint64_t post_signal_every_ = 1;
  bool post_atomics_ = true;
  std::atomic<uint64_t> posts_inflight_{0};  // for the progress thread's busy-poll rule

  // Channels by preferred-rail mask (every channel when L == 1).
  std::mutex near_mu_;
  std::unordered_map<uint32_t, std::vector<int>> near_;
  std::vector<int> all_chans_;

  // imms: each takes one of the peer's receive credits; batches whose imm follows their data
  // complete in submission order (imm_order_), and a single-lane batch chains its imm only
  // behind none.
  std::mutex imm_mu_;
  int64_t imm_credits_ = kRecvSlots - kCtrlReserve;  // set from the peer's recv_slots
  int64_t imm_credits_max_ = kRecvSlots - kCtrlReserve;
  // Receiving side (progress): imm slots reposted and not yet credited back to the peer.
  uint32_t recv_posted_ = 0;
  uint32_t imm_to_return_ = 0;
  uint32_t credit_batch_ = 64;
  std::unordered_map<uint64_t, ImmBatch> imm_batches_;
  std::deque<uint64_t> imm_order_;

  std::mutex send_mu_;
  int sends_inflight_ = 0;
  std::deque<std::shared_ptr<MessageOp>> send_wait_;

  std::mutex rdv_mu_;
  std::unordered_map<uint64_t, Rendezvous> rdv_;
  uint64_t next_rdv_ = 1;

  std::mutex rkey_mu_;
  std::unordered_map<uint64_t, std::vector<uint32_t>> rkeys_;  // region -> rkey by peer rail
  std::unordered_map<uint64_t, bool> gone_;                    // regions the peer unregistered
  std::mutex gone_mu_;
  std::condition_variable gone_cv_;
  uint64_t gone_sent_ = 0, gone_acked_ = 0;

  std::mutex attach_mu_;
  int attached_ = 0;
  std::thread thread_;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> closed_{false};
  std::atomic<bool> sleeping_{false};  // in poll() with the CQs armed
  std::atomic<bool> ready_{false};     // every QP is in RTS and the progress thread runs
  int min_mtu_ = 0;                    // rdma.min_mtu: the smallest path MTU we accept (0 = any)
  int ack_timeout_ = 14;               // rdma.timeout
  int retry_cnt_ = 7;                  // rdma.retry_cnt (see retry_count_for)
  uint32_t fault_rkey_xor_ = 0;        // test-only fault injection (SLUICE_RDMA_FAULT_RKEY_XOR)
  std::atomic<std::chrono::steady_clock::rep> last_submit_{0};
  std::chrono::microseconds spin_{50};
  std::chrono::milliseconds busy_{20};
  // Caller-driven progress: waiters poll the CQs under poll_mu_ (try_lock, so nobody blocks on
  // it); while any does, and for kCallerWindow after one left, the progress thread keeps out of
  // the CQs (unarmed: an armed CQ wakes it on every completion) and only watches the sockets;
  // a waiter that leaves operations behind hands the CQs back at once (handoff_).
  std::mutex poll_mu_;
  std::atomic<int> callers_polling_{0};
  std::atomic<std::chrono::steady_clock::rep> last_caller_end_{0};
  std::atomic<bool> handoff_{false};
  std::atomic<bool> callers_mode_{false};  // the thread sleeps with the CQs left to waiters
  std::atomic<std::thread::id> poll_owner_{};
  std::atomic<bool> released_{false};
  std::chrono::microseconds poll_budget_{20000};
};

}  // namespace sluice::detail::rdma
