// rdma: RC queue pairs over libibverbs (loaded with dlopen). One QP per channel; lane c of a
// TransferOp goes to QP c. See docs/rdma.md for the design.
//
//  * READ / WRITE: one RDMA READ/WRITE work request per piece (split at max_msg_sz), posted as
//    one chain per lane with a single ibv_post_send; only the last WR of a lane (and every
//    kSignalEvery-th WR, so that send-queue slots come back) is signalled.
//  * WRITE_WITH_IMM: exactly one imm per batch, always on QP 0. A batch with one lane runs on
//    QP 0 and its last WR carries the imm (RC ordering makes every byte visible first). A
//    striped batch writes every lane with plain WRITEs and, once every lane's last WR has
//    completed (acked by the target), posts a zero-length WRITE_WITH_IMM on QP 0.
//  * SEND / RECV: sender-initiated rendezvous. The sender SENDs a 40-byte RTS {seq, addr, len,
//    rkey} on QP 0; the target claims the message in the core's MessageMatcher (the posted
//    recv buffer, or a stash for an early message), RDMA READs min(len, capacity) bytes
//    straight into it and SENDs back a FIN {seq, status}; the sender's future completes on FIN.
//    No payload ever goes through a receive buffer, so receive buffers are 64-byte control
//    slots and the window is bounded by counting: at most kMaxSends RTS and kMaxImms imms in
//    flight per direction, plus the FINs that answer the peer's RTS, never exceed the
//    kRecvSlots receive WQEs pre-posted on QP 0 (reposted as soon as they are polled).
//  * Back-pressure: each QP owns max_send_wr slots; a WR that finds no slot waits in the
//    QP's backlog and is posted by the progress thread when a signalled completion returns
//    slots (never a sleep loop).
//  * Progress: one thread per endpoint busy-polls the CQ for SLUICE_RDMA_SPIN_US, then arms the
//    completion channel and sleeps in poll() on it, an eventfd and the channel bootstrap
//    sockets (kept open: EOF means the peer process is gone, which fails pending ops at once).
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <unordered_map>

#include "bootstrap/messages.hpp"
#include "core/log.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/rdma/device.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

using rdma::Device;
using rdma::QpAddress;
using rdma::Verbs;
using nlohmann::json;

constexpr int kRecvSlots = 1024;     // control receive WQEs pre-posted on QP 0
constexpr int kSlotBytes = 64;
constexpr int kMaxSends = 128;       // RTS in flight per direction
constexpr int kMaxImms = 256;        // imm writes in flight per direction
constexpr int kCtrlSendSlots = 2 * kMaxSends + 16;
constexpr int kSignalEvery = 64;
constexpr uint64_t kMaxWrBytes = 1ull << 30;

// wr_id layout: top two bits tag the kind.
constexpr uint64_t kTagCtx = 0ull << 62;    // signalled WR: id of a WrCtx
constexpr uint64_t kTagUnsig = 1ull << 62;  // unsignalled data WR: op token
constexpr uint64_t kTagRecv = 2ull << 62;   // receive slot index
constexpr uint64_t kTagMask = 3ull << 62;

enum class CtxKind : uint8_t { kSlots, kLaneEnd, kImmLaneEnd, kImmFinal, kCtrl, kRdvRead };

struct WrCtx {
  CtxKind kind = CtxKind::kSlots;
  int chan = 0;
  int slots = 0;
  uint64_t token = 0;  // op token / rendezvous id
  uint32_t aux = 0;    // ctrl send slot / lane count
};

struct Wr {
  ibv_send_wr wr{};
  ibv_sge sge{};
  bool has_sge = false;
  bool signal = false;
  CtxKind kind = CtxKind::kSlots;
  uint64_t token = 0;
  uint32_t aux = 0;
};

enum CtrlType : uint32_t { kRts = 1, kFin = 2, kGone = 3, kGoneAck = 4 };

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

struct Chan {
  ibv_qp* qp = nullptr;
  std::mutex mu;
  int free = 0;
  int unsig = 0;
  std::deque<Wr> backlog;
  net::Socket sock;
  bool sock_live = false;
};

struct Rendezvous {
  MessageMatcher::Claim claim;
  ibv_mr* stash_mr = nullptr;
};

Status wc_status(const Verbs& v, const ibv_wc& wc, const std::string& what) {
  ErrorCode code = ErrorCode::kRemoteError;
  if (wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_RNR_RETRY_EXC_ERR) code = ErrorCode::kPeerLost;
  if (wc.status == IBV_WC_WR_FLUSH_ERR) code = ErrorCode::kPeerLost;
  if (wc.status == IBV_WC_LOC_PROT_ERR || wc.status == IBV_WC_LOC_LEN_ERR || wc.status == IBV_WC_LOC_QP_OP_ERR)
    code = ErrorCode::kInternal;
  return {code, "rdma " + what + " failed: " + v.wc_status_str(wc.status) + " (status " + std::to_string(wc.status) +
                    ", vendor error 0x" + [&] { char b[16]; std::snprintf(b, sizeof b, "%x", wc.vendor_err); return std::string(b); }() + ")"};
}

class RdmaTransport;

class RdmaEndpoint final : public TransportEndpoint, public rdma::GoneListener {
 public:
  RdmaEndpoint(std::shared_ptr<Device> dev, const Registry* reg, const EndpointSetup& s);
  ~RdmaEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  void connect(const ChannelOpener& open) override;
  bool attach(int index, net::Socket sock, const json& hello) override;
  void submit(std::shared_ptr<TransferOp> op) override;
  void send(std::shared_ptr<MessageOp> op) override;
  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }
  void close(const Status& why) override;
  void region_gone(uint64_t id) override;

 private:
  void setup_resources();
  ibv_qp* create_qp(int index);
  void bring_up(int index, const QpAddress& remote);
  QpAddress local_qp_address(int index) const;
  json hello_body(int index);
  void take_peer(const json& j);
  void start_thread();
  void progress();
  void handle(const ibv_wc& wc);
  void handle_recv(const ibv_wc& wc);
  void post_recv_slot(uint32_t slot);
  // Queue WRs on channel c and post what fits. Returns false (and fails the endpoint) if
  // ibv_post_send failed.
  void post(int c, std::vector<Wr>& wrs);
  Status drain(Chan& ch, int c);
  void fail(const Status& why, bool notify);
  bool rkey_for(uint64_t remote_id, uint32_t* rkey);
  void refresh_rkeys();
  void post_imm(uint64_t token, uint32_t imm, uint32_t lanes);
  void post_ctrl(const CtrlMsg& m);
  void start_send(std::shared_ptr<MessageOp> op);
  void on_rts(const CtrlMsg& m);
  void finish_rendezvous(uint64_t id, const Status& st);
  void on_fin(const CtrlMsg& m);
  void fail_op(uint64_t token, const Status& st);
  void wake();

  std::shared_ptr<Device> dev_;
  const Verbs& v_;
  const Registry* reg_;
  EndpointEvents* events_;
  EndpointSetup setup_;
  const int nchan_;
  std::vector<std::unique_ptr<Chan>> chans_;
  std::vector<QpAddress> remote_;
  ibv_comp_channel* comp_ = nullptr;
  ibv_cq* cq_ = nullptr;
  int sq_depth_ = 0;
  int cq_depth_ = 0;
  uint32_t max_inline_ = 0;
  uint64_t max_wr_bytes_ = kMaxWrBytes;
  int path_mtu_ = IBV_MTU_1024;
  // control slots: recv ring and send ring, one registration
  std::vector<uint8_t> ctrl_mem_;
  ibv_mr* ctrl_mr_ = nullptr;
  uint64_t peer_scratch_addr_ = 0;
  uint32_t peer_scratch_rkey_ = 0;
  std::mutex ctrl_mu_;
  std::vector<uint32_t> ctrl_free_;

  PendingOps pending_;
  std::mutex ctx_mu_;
  std::unordered_map<uint64_t, WrCtx> ctx_;
  uint64_t next_ctx_ = 1;

  std::mutex imm_mu_;
  std::unordered_map<uint64_t, std::pair<uint32_t, uint32_t>> imm_left_;  // token -> (lanes left, lanes)
  int imm_inflight_ = 0;
  std::deque<std::tuple<uint64_t, uint32_t, uint32_t>> imm_wait_;

  std::mutex send_mu_;
  int sends_inflight_ = 0;
  std::deque<std::shared_ptr<MessageOp>> send_wait_;

  std::mutex rdv_mu_;
  std::unordered_map<uint64_t, Rendezvous> rdv_;
  uint64_t next_rdv_ = 1;

  std::mutex rkey_mu_;
  std::unordered_map<uint64_t, uint32_t> rkeys_;
  std::unordered_map<uint64_t, bool> gone_;  // regions the peer unregistered
  std::mutex gone_mu_;
  std::condition_variable gone_cv_;
  uint64_t gone_sent_ = 0, gone_acked_ = 0;

  std::mutex attach_mu_;
  int attached_ = 0;
  std::thread thread_;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> closed_{false};
  std::atomic<bool> failing_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> ready_{false};      // every QP is in RTS and the progress thread runs
  uint32_t fault_rkey_xor_ = 0;         // test-only fault injection (SLUICE_RDMA_FAULT_RKEY_XOR)
  std::atomic<std::chrono::steady_clock::rep> last_submit_{0};  // the progress thread is (about to be) in poll()
  std::atomic<bool> notified_{false};
  unsigned cq_events_ = 0;
  std::chrono::microseconds spin_{50};
  std::chrono::milliseconds busy_{20};
};

RdmaEndpoint::RdmaEndpoint(std::shared_ptr<Device> dev, const Registry* reg, const EndpointSetup& s)
    : dev_(std::move(dev)), v_(dev_->v()), reg_(reg), events_(s.events), setup_(s), nchan_(s.channels), remote_(s.channels) {
  if (const char* e = std::getenv("SLUICE_RDMA_SPIN_US")) spin_ = std::chrono::microseconds(std::atoi(e));
  if (const char* e = std::getenv("SLUICE_RDMA_BUSY_MS")) busy_ = std::chrono::milliseconds(std::atoi(e));
  if (const char* e = std::getenv("SLUICE_RDMA_FAULT_RKEY_XOR")) fault_rkey_xor_ = static_cast<uint32_t>(std::strtoul(e, nullptr, 0));
  for (int i = 0; i < nchan_; ++i) chans_.push_back(std::make_unique<Chan>());
  try {
    setup_resources();
  } catch (...) {
    close({ErrorCode::kCancelled, "setup failed"});
    throw;
  }
  auto it = s.peer.transports.find("rdma");
  if (it != s.peer.transports.end()) take_peer(it->second);
}

void RdmaEndpoint::setup_resources() {
  const auto& a = dev_->attr();
  sq_depth_ = std::min(1024, a.max_qp_wr);
  int rq0 = std::min(kRecvSlots, a.max_qp_wr);
  cq_depth_ = std::min(a.max_cqe, nchan_ * sq_depth_ + rq0 + 64);
  max_wr_bytes_ = kMaxWrBytes;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  comp_ = v_.create_comp_channel(dev_->ctx());
  if (!comp_) throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_comp_channel: ") + std::strerror(errno));
  ::fcntl(comp_->fd, F_SETFL, ::fcntl(comp_->fd, F_GETFL) | O_NONBLOCK);
  cq_ = v_.create_cq(dev_->ctx(), cq_depth_, nullptr, comp_, 0);
  if (!cq_) throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_cq: ") + std::strerror(errno));
  ctrl_mem_.assign(size_t(kRecvSlots + kCtrlSendSlots) * kSlotBytes, 0);
  ctrl_mr_ = v_.reg_mr(dev_->pd(), ctrl_mem_.data(), ctrl_mem_.size(), rdma::kAccess);
  if (!ctrl_mr_) throw Error(ErrorCode::kSystem, std::string("rdma: cannot register control slots: ") + std::strerror(errno));
  for (uint32_t i = 0; i < kCtrlSendSlots; ++i) ctrl_free_.push_back(kRecvSlots + i);
  for (int i = 0; i < nchan_; ++i) chans_[i]->qp = create_qp(i);
  for (uint32_t i = 0; i < static_cast<uint32_t>(rq0); ++i) post_recv_slot(i);
}

ibv_qp* RdmaEndpoint::create_qp(int index) {
  ibv_qp_init_attr ia{};
  ia.send_cq = cq_;
  ia.recv_cq = cq_;
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap.max_send_wr = sq_depth_;
  ia.cap.max_recv_wr = index == 0 ? std::min(kRecvSlots, dev_->attr().max_qp_wr) : 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = nullptr;
  for (uint32_t inl : {256u, 64u, 0u}) {
    ia.cap.max_inline_data = inl;
    qp = v_.create_qp(dev_->pd(), &ia);
    if (qp) break;
  }
  if (!qp) throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_qp: ") + std::strerror(errno));
  max_inline_ = ia.cap.max_inline_data;
  chans_[index]->free = sq_depth_;
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_INIT;
  at.pkey_index = 0;
  at.port_num = static_cast<uint8_t>(dev_->port());
  at.qp_access_flags = rdma::kAccess;
  if (int rc = v_.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    v_.destroy_qp(qp);
    throw Error(ErrorCode::kSystem, std::string("rdma: QP to INIT: ") + std::strerror(rc));
  }
  return qp;
}

QpAddress RdmaEndpoint::local_qp_address(int index) const {
  QpAddress a;
  a.qpn = chans_[index]->qp->qp_num;
  a.psn = (a.qpn * 2654435761u) & 0xffffff;
  a.gid = Device::gid_text(dev_->gid());
  a.lid = dev_->lid();
  a.mtu = dev_->active_mtu();
  return a;
}

void RdmaEndpoint::bring_up(int index, const QpAddress& r) {
  ibv_qp* qp = chans_[index]->qp;
  ibv_gid dgid{};
  if (!Device::parse_gid(r.gid, &dgid)) throw Error(ErrorCode::kProtocol, "rdma: peer sent a malformed GID");
  path_mtu_ = std::min(dev_->active_mtu(), r.mtu);
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = static_cast<ibv_mtu>(path_mtu_);
  at.dest_qp_num = r.qpn;
  at.rq_psn = r.psn;
  at.max_dest_rd_atomic = static_cast<uint8_t>(std::max(1, std::min(16, dev_->attr().max_qp_rd_atom)));
  at.min_rnr_timer = 12;
  at.ah_attr.port_num = static_cast<uint8_t>(dev_->port());
  if (dev_->ethernet()) {
    at.ah_attr.is_global = 1;
    at.ah_attr.grh.dgid = dgid;
    at.ah_attr.grh.sgid_index = static_cast<uint8_t>(dev_->gid_index());
    at.ah_attr.grh.hop_limit = 64;
  } else {
    at.ah_attr.dlid = r.lid;  // IB: route by the remote LID
  }
  int rc = v_.modify_qp(qp, &at,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) throw Error(ErrorCode::kSystem, std::string("rdma: QP to RTR: ") + std::strerror(rc));
  ibv_qp_attr rts{};
  rts.qp_state = IBV_QPS_RTS;
  rts.timeout = 14;   // 4.096 us * 2^14 = 67 ms per try
  rts.retry_cnt = 7;
  rts.rnr_retry = 7;  // the window accounting keeps RNR away; this is only a safety net
  rts.sq_psn = local_qp_address(index).psn;
  rts.max_rd_atomic = static_cast<uint8_t>(std::max(1, std::min(16, dev_->attr().max_qp_rd_atom)));
  rc = v_.modify_qp(qp, &rts,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) throw Error(ErrorCode::kSystem, std::string("rdma: QP to RTS: ") + std::strerror(rc));
  remote_[index] = r;
}

json RdmaEndpoint::hello_body(int index) {
  json j = local_qp_address(index).to_json();
  if (index == 0) {
    j["rkeys"] = dev_->rkeys(*reg_);
    j["scratch_addr"] = reinterpret_cast<uintptr_t>(ctrl_mem_.data());
    j["scratch_rkey"] = ctrl_mr_->rkey;
  }
  return j;
}

void RdmaEndpoint::take_peer(const json& j) {
  if (!j.is_object()) return;
  if (j.contains("rkeys") && j["rkeys"].is_object()) {
    std::lock_guard<std::mutex> lk(rkey_mu_);
    for (auto& [k, val] : j["rkeys"].items()) {
      uint64_t id = std::stoull(k);
      if (!gone_.count(id)) rkeys_[id] = val.get<uint32_t>();
    }
  }
  if (j.contains("scratch_rkey")) {
    peer_scratch_addr_ = j["scratch_addr"].get<uint64_t>();
    peer_scratch_rkey_ = j["scratch_rkey"].get<uint32_t>();
  }
}

void RdmaEndpoint::connect(const ChannelOpener& open) {
  for (int i = 0; i < nchan_; ++i) {
    auto [sock, reply] = open(i, {{"rdma", hello_body(i)}});
    if (!reply.contains("rdma")) throw Error(ErrorCode::kProtocol, "rdma: channel reply without queue pair address");
    take_peer(reply["rdma"]);
    bring_up(i, QpAddress::from_json(reply["rdma"]));
    chans_[i]->sock = std::move(sock);
    chans_[i]->sock_live = true;
  }
  start_thread();
}

bool RdmaEndpoint::attach(int index, net::Socket sock, const json& hello) {
  std::lock_guard<std::mutex> lk(attach_mu_);
  if (chans_[index]->sock_live) throw Error(ErrorCode::kProtocol, "channel " + std::to_string(index) + " attached twice");
  if (!hello.contains("rdma")) throw Error(ErrorCode::kProtocol, "rdma: channel hello without queue pair address");
  take_peer(hello["rdma"]);
  bring_up(index, QpAddress::from_json(hello["rdma"]));
  bootstrap::send_msg(sock.fd(), bootstrap::MsgKind::kReply, {{"rdma", hello_body(index)}});
  chans_[index]->sock = std::move(sock);
  chans_[index]->sock_live = true;
  if (++attached_ == nchan_) {
    start_thread();
    return true;
  }
  return false;
}

void RdmaEndpoint::start_thread() {
  thread_ = std::thread([this] { progress(); });
  ready_.store(true);
}

void RdmaEndpoint::post_recv_slot(uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(ctrl_mem_.data()) + uint64_t(slot) * kSlotBytes, kSlotBytes, ctrl_mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kTagRecv | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  if (int rc = ibv_post_recv(chans_[0]->qp, &wr, &bad))
    fail({ErrorCode::kSystem, std::string("rdma: ibv_post_recv: ") + std::strerror(rc)}, true);
}

void RdmaEndpoint::post(int c, std::vector<Wr>& wrs) {
  Chan& ch = *chans_[c];
  Status st;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    for (auto& w : wrs) ch.backlog.push_back(std::move(w));
    st = drain(ch, c);
  }
  if (!st.ok()) fail(st, true);
}

// Called with ch.mu held.
Status RdmaEndpoint::drain(Chan& ch, int c) {
  if (failed_.load()) {
    ch.backlog.clear();
    return Status::Ok();
  }
  while (!ch.backlog.empty() && ch.free > 0) {
    size_t n = std::min<size_t>(ch.backlog.size(), ch.free);
    std::vector<Wr> batch;
    batch.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      batch.push_back(std::move(ch.backlog.front()));
      ch.backlog.pop_front();
    }
    {
      std::lock_guard<std::mutex> lk(ctx_mu_);
      for (size_t i = 0; i < n; ++i) {
        Wr& w = batch[i];
        ch.free--;
        bool sig = w.signal || ch.unsig + 1 >= kSignalEvery || ch.free == 0;
        if (sig) {
          uint64_t id = next_ctx_++;
          ctx_[id] = {w.kind, c, ch.unsig + 1, w.token, w.aux};
          ch.unsig = 0;
          w.wr.wr_id = kTagCtx | id;
          w.wr.send_flags |= IBV_SEND_SIGNALED;
        } else {
          ch.unsig++;
          w.wr.wr_id = kTagUnsig | w.token;
        }
        w.wr.sg_list = w.has_sge ? &w.sge : nullptr;
        w.wr.num_sge = w.has_sge ? 1 : 0;
        w.wr.next = i + 1 < n ? &batch[i + 1].wr : nullptr;
      }
    }
    ibv_send_wr* bad = nullptr;
    if (int rc = ibv_post_send(ch.qp, &batch[0].wr, &bad)) {
      Status st{ErrorCode::kSystem, std::string("rdma: ibv_post_send on QP ") + std::to_string(ch.qp->qp_num) + ": " +
                                        std::strerror(rc)};
      ch.backlog.clear();
      return st;
    }
  }
  return Status::Ok();
}

bool RdmaEndpoint::rkey_for(uint64_t remote_id, uint32_t* rkey) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    {
      std::lock_guard<std::mutex> lk(rkey_mu_);
      auto it = rkeys_.find(remote_id);
      if (it != rkeys_.end()) {
        *rkey = it->second;
        return true;
      }
      if (gone_.count(remote_id)) return false;
    }
    if (attempt == 0) refresh_rkeys();
  }
  return false;
}

// A region the peer registered after we connected: ask its listener for its current info,
// whose rdma part carries the rkeys of every region it has (registering them lazily).
void RdmaEndpoint::refresh_rkeys() {
  try {
    net::Socket s = net::connect_tcp(setup_.peer.listen_host, setup_.peer.listen_port, setup_.config.connect_timeout);
    net::set_io_timeout(s.fd(), setup_.config.connect_timeout);
    bootstrap::send_msg(s.fd(), bootstrap::MsgKind::kInfo, json::object());
    json reply = bootstrap::expect_reply(s.fd(), "rdma rkey refresh");
    if (reply.contains("info") && reply["info"].contains("transports") && reply["info"]["transports"].contains("rdma"))
      take_peer(reply["info"]["transports"]["rdma"]);
  } catch (const std::exception& e) {
    SLUICE_LOG(kWarn, "rdma: cannot refresh the peer's memory keys: " << e.what());
  }
}

void RdmaEndpoint::fail_op(uint64_t token, const Status& st) {
  auto op = pending_.find(token);
  if (!op) return;
  op->future->complete(st);
  // drop it from the table: complete the remaining parts (no-ops on a completed future)
  for (size_t i = 0; i < op->lanes.size(); ++i)
    if (!pending_.lane_done(token, st)) break;
}

void RdmaEndpoint::submit(std::shared_ptr<TransferOp> op) {
  auto keep = op;
  uint64_t token = pending_.add(std::move(op));
  if (!token) return;
  last_submit_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  if (sleeping_.load()) wake();  // start busy-polling while the WRs travel
  std::vector<int> lanes;
  for (size_t c = 0; c < keep->lanes.size(); ++c)
    if (!keep->lanes[c].pieces.empty()) lanes.push_back(static_cast<int>(c));
  const bool is_read = keep->kind == OpKind::kRead;
  const bool imm = keep->kind == OpKind::kWriteImm;
  const bool imm_chained = imm && lanes.size() == 1;
  if (imm && !imm_chained) {
    std::lock_guard<std::mutex> lk(imm_mu_);
    imm_left_[token] = {static_cast<uint32_t>(lanes.size()), static_cast<uint32_t>(lanes.size())};
  }
  // Resolve every key first so that a failure transfers nothing.
  std::vector<std::vector<Wr>> chains(lanes.size());
  for (size_t li = 0; li < lanes.size(); ++li) {
    auto& pieces = keep->lanes[lanes[li]].pieces;
    auto& wrs = chains[li];
    for (const Piece& p : pieces) {
      const RegionEntry* region = nullptr;
      for (auto& pin : keep->pins) {
        RegionEntry* e = pin.get();
        if (p.local >= e->base && p.local + p.length <= e->base + e->length) {
          region = e;
          break;
        }
      }
      Status st;
      ibv_mr* mr = region ? dev_->mr_for(*reg_, region, &st) : nullptr;
      if (!region) st = {ErrorCode::kInternal, "rdma: piece outside its pinned regions"};
      uint32_t rkey = 0;
      if (mr && !rkey_for(p.remote_id, &rkey))
        st = {ErrorCode::kUnknownHandle, "rdma: peer " + setup_.peer.engine_id + " unregistered region " +
                                             std::to_string(p.remote_id) + " (or advertised no memory key for it)"};
      if (!st.ok()) {
        if (imm && !imm_chained) {
          std::lock_guard<std::mutex> lk(imm_mu_);
          imm_left_.erase(token);
        }
        fail_op(token, st);
        return;
      }
      for (uint64_t off = 0; off < p.length; off += max_wr_bytes_) {
        uint64_t n = std::min(max_wr_bytes_, p.length - off);
        Wr w;
        w.has_sge = true;
        w.sge = {reinterpret_cast<uintptr_t>(p.local + off), static_cast<uint32_t>(n), mr->lkey};
        w.wr.opcode = is_read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
        w.wr.wr.rdma.remote_addr = p.remote_addr + off;
        w.wr.wr.rdma.rkey = rkey ^ fault_rkey_xor_;
        if (!is_read && n <= max_inline_) w.wr.send_flags |= IBV_SEND_INLINE;
        w.token = token;
        wrs.push_back(w);
      }
    }
    Wr& last = wrs.back();
    last.signal = true;
    last.kind = imm && !imm_chained ? CtxKind::kImmLaneEnd : CtxKind::kLaneEnd;
    if (imm_chained) {
      last.wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      last.wr.imm_data = htonl(keep->imm);
    }
  }
  if (imm_chained) {
    // Counted against the peer's receive window like a striped batch's final imm.
    std::unique_lock<std::mutex> lk(imm_mu_);
    if (imm_inflight_ >= kMaxImms) {
      // Rare: fall back to the two-step path, which queues.
      imm_left_[token] = {1, 1};
      chains[0].back().wr.opcode = IBV_WR_RDMA_WRITE;
      chains[0].back().kind = CtxKind::kImmLaneEnd;
      lk.unlock();
      post(lanes[0], chains[0]);
      return;
    }
    imm_inflight_++;
    lk.unlock();
    post(0, chains[0]);
    return;
  }
  for (size_t li = 0; li < lanes.size(); ++li) post(lanes[li], chains[li]);
}

void RdmaEndpoint::post_imm(uint64_t token, uint32_t imm, uint32_t lanes) {
  {
    std::lock_guard<std::mutex> lk(imm_mu_);
    if (imm_inflight_ >= kMaxImms) {
      imm_wait_.emplace_back(token, imm, lanes);
      return;
    }
    imm_inflight_++;
  }
  std::vector<Wr> w(1);
  w[0].wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w[0].wr.imm_data = htonl(imm);
  w[0].wr.wr.rdma.remote_addr = peer_scratch_addr_;
  w[0].wr.wr.rdma.rkey = peer_scratch_rkey_;
  w[0].signal = true;
  w[0].kind = CtxKind::kImmFinal;
  w[0].token = token;
  w[0].aux = lanes;
  post(0, w);
}

void RdmaEndpoint::post_ctrl(const CtrlMsg& m) {
  uint32_t slot;
  {
    std::lock_guard<std::mutex> lk(ctrl_mu_);
    if (ctrl_free_.empty()) {
      fail({ErrorCode::kProtocol, "rdma: control window exhausted (peer exceeded its message window)"}, true);
      return;
    }
    slot = ctrl_free_.back();
    ctrl_free_.pop_back();
  }
  uint8_t* buf = ctrl_mem_.data() + size_t(slot) * kSlotBytes;
  std::memcpy(buf, &m, sizeof m);
  std::vector<Wr> w(1);
  w[0].has_sge = true;
  w[0].sge = {reinterpret_cast<uintptr_t>(buf), sizeof(CtrlMsg), ctrl_mr_->lkey};
  w[0].wr.opcode = IBV_WR_SEND;
  if (sizeof(CtrlMsg) <= max_inline_) w[0].wr.send_flags |= IBV_SEND_INLINE;
  w[0].signal = true;
  w[0].kind = CtxKind::kCtrl;
  w[0].aux = slot;
  post(0, w);
}

void RdmaEndpoint::send(std::shared_ptr<MessageOp> op) {
  std::lock_guard<std::mutex> lk(send_mu_);  // keeps RTS in submission order
  if (!pending_.add_send(op)) return;
  last_submit_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  if (sleeping_.load()) wake();
  if (sends_inflight_ >= kMaxSends || !send_wait_.empty()) {
    send_wait_.push_back(std::move(op));
    return;
  }
  sends_inflight_++;
  start_send(std::move(op));
}

// send_mu_ held.
void RdmaEndpoint::start_send(std::shared_ptr<MessageOp> op) {
  CtrlMsg m{};
  m.type = kRts;
  m.seq = op->seq;
  m.addr = reinterpret_cast<uintptr_t>(op->ptr);
  m.len = op->length;
  if (op->length) {
    Status st;
    ibv_mr* mr = dev_->mr_for(*reg_, op->pin.get(), &st);
    if (!mr) {
      // The peer still expects message seq: announce it empty-handed with an error length
      // would desynchronise matching, so fail the endpoint instead.
      auto o = pending_.take_send(op->seq);
      if (o) o->future->complete(st);
      fail(st, true);
      return;
    }
    m.rkey = mr->rkey;
  }
  post_ctrl(m);
}

void RdmaEndpoint::on_rts(const CtrlMsg& m) {
  auto claim = events_->matcher().claim(m.seq, m.len);
  if (claim.error.code == ErrorCode::kProtocol) {
    fail(claim.error, true);
    return;
  }
  uint64_t n = claim.dest ? std::min(m.len, claim.capacity) : 0;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    id = next_rdv_++;
    rdv_[id].claim = std::move(claim);
  }
  if (n == 0) {
    finish_rendezvous(id, Status::Ok());
    return;
  }
  Rendezvous* r;
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    r = &rdv_[id];
  }
  uint32_t lkey = 0;
  Status st;
  if (r->claim.recv) {
    ibv_mr* mr = dev_->mr_for(*reg_, r->claim.recv->pin.get(), &st);
    if (mr) lkey = mr->lkey;
  } else {
    r->stash_mr = v_.reg_mr(dev_->pd(), r->claim.dest, n, IBV_ACCESS_LOCAL_WRITE);
    if (r->stash_mr) lkey = r->stash_mr->lkey;
    else st = {ErrorCode::kSystem, std::string("rdma: cannot register an unexpected-message buffer: ") + std::strerror(errno)};
  }
  if (!st.ok()) {
    finish_rendezvous(id, st);
    return;
  }
  std::vector<Wr> wrs;
  for (uint64_t off = 0; off < n; off += max_wr_bytes_) {
    Wr w;
    uint64_t k = std::min(max_wr_bytes_, n - off);
    w.has_sge = true;
    w.sge = {reinterpret_cast<uintptr_t>(r->claim.dest + off), static_cast<uint32_t>(k), lkey};
    w.wr.opcode = IBV_WR_RDMA_READ;
    w.wr.wr.rdma.remote_addr = m.addr + off;
    w.wr.wr.rdma.rkey = m.rkey;
    w.token = 0;
    wrs.push_back(w);
  }
  wrs.back().signal = true;
  wrs.back().kind = CtxKind::kRdvRead;
  wrs.back().token = id;
  post(0, wrs);
}

void RdmaEndpoint::finish_rendezvous(uint64_t id, const Status& transfer) {
  Rendezvous r;
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    auto it = rdv_.find(id);
    if (it == rdv_.end()) return;
    r = std::move(it->second);
    rdv_.erase(it);
  }
  if (r.stash_mr) v_.dereg_mr(r.stash_mr);
  uint64_t seq = r.claim.seq;
  Status st = events_->matcher().deliver(r.claim, transfer);
  CtrlMsg fin{};
  fin.type = kFin;
  fin.seq = seq;
  fin.status = static_cast<uint32_t>(st.code);
  post_ctrl(fin);
}

void RdmaEndpoint::on_fin(const CtrlMsg& m) {
  auto op = pending_.take_send(m.seq);
  if (!op) {
    fail({ErrorCode::kProtocol, "rdma: FIN for an unknown message"}, true);
    return;
  }
  Status st;
  if (m.status != 0) {
    auto code = m.status <= static_cast<uint32_t>(ErrorCode::kInternal) ? static_cast<ErrorCode>(m.status) : ErrorCode::kRemoteError;
    st = {code, std::string("peer: ") + (code == ErrorCode::kTruncated ? "message of " + std::to_string(op->length) +
                                                                             " bytes truncated by a smaller receive buffer"
                                                                       : "receive failed (" + std::string(to_string(code)) + ")")};
  }
  op->future->complete(st);
  std::lock_guard<std::mutex> lk(send_mu_);
  sends_inflight_--;
  while (sends_inflight_ < kMaxSends && !send_wait_.empty()) {
    auto next = std::move(send_wait_.front());
    send_wait_.pop_front();
    sends_inflight_++;
    start_send(std::move(next));
  }
}

void RdmaEndpoint::handle_recv(const ibv_wc& wc) {
  uint32_t slot = static_cast<uint32_t>(wc.wr_id & ~kTagMask);
  if (wc.status != IBV_WC_SUCCESS) {
    fail(wc_status(v_, wc, "receive"), true);
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    post_recv_slot(slot);
    events_->matcher().push_imm(ntohl(wc.imm_data));
    return;
  }
  CtrlMsg m;
  std::memcpy(&m, ctrl_mem_.data() + size_t(slot) * kSlotBytes, sizeof m);
  post_recv_slot(slot);
  if (wc.byte_len != sizeof(CtrlMsg)) {
    fail({ErrorCode::kProtocol, "rdma: malformed control message"}, true);
    return;
  }
  if (m.type == kRts) on_rts(m);
  else if (m.type == kFin) on_fin(m);
  else if (m.type == kGone) {
    {
      std::lock_guard<std::mutex> lk(rkey_mu_);
      rkeys_.erase(m.seq);
      gone_[m.seq] = true;
    }
    CtrlMsg ack{};
    ack.type = kGoneAck;
    ack.seq = m.seq;
    ack.addr = m.addr;
    post_ctrl(ack);
  } else if (m.type == kGoneAck) {
    std::lock_guard<std::mutex> lk(gone_mu_);
    gone_acked_ = std::max<uint64_t>(gone_acked_, m.addr);
    gone_cv_.notify_all();
  }
  else fail({ErrorCode::kProtocol, "rdma: unknown control message " + std::to_string(m.type)}, true);
}

void RdmaEndpoint::handle(const ibv_wc& wc) {
  pending_.touch();
  uint64_t tag = wc.wr_id & kTagMask;
  if (tag == kTagRecv) {
    handle_recv(wc);
    return;
  }
  if (tag == kTagUnsig) {
    // Only errors come back for unsignalled WRs.
    uint64_t token = wc.wr_id & ~kTagMask;
    if (wc.status != IBV_WC_SUCCESS) {
      Status st = wc_status(v_, wc, "transfer");
      if (token && wc.status != IBV_WC_WR_FLUSH_ERR) fail_op(token, st);
      fail({st.code, "QP in error state after: " + st.message}, true);
    }
    return;
  }
  WrCtx ctx;
  {
    std::lock_guard<std::mutex> lk(ctx_mu_);
    auto it = ctx_.find(wc.wr_id & ~kTagMask);
    if (it == ctx_.end()) return;
    ctx = it->second;
    ctx_.erase(it);
  }
  {
    Chan& ch = *chans_[ctx.chan];
    Status st;
    {
      std::lock_guard<std::mutex> lk(ch.mu);
      ch.free += ctx.slots;
      st = drain(ch, ctx.chan);
    }
    if (!st.ok()) fail(st, true);
  }
  if (ctx.kind == CtxKind::kCtrl) {
    std::lock_guard<std::mutex> lk(ctrl_mu_);
    ctrl_free_.push_back(ctx.aux);
  }
  if (wc.status != IBV_WC_SUCCESS) {
    const char* what = ctx.kind == CtxKind::kCtrl ? "control send" : ctx.kind == CtxKind::kRdvRead ? "message read" : "transfer";
    Status st = wc_status(v_, wc, what);
    if (wc.status != IBV_WC_WR_FLUSH_ERR) {
      if (ctx.kind == CtxKind::kLaneEnd || ctx.kind == CtxKind::kImmLaneEnd || ctx.kind == CtxKind::kImmFinal)
        fail_op(ctx.token, st);
      if (ctx.kind == CtxKind::kRdvRead) finish_rendezvous(ctx.token, st);
    }
    fail({st.code, "QP " + std::to_string(chans_[ctx.chan]->qp->qp_num) + " in error state after: " + st.message}, true);
    return;
  }
  switch (ctx.kind) {
    case CtxKind::kSlots:
    case CtxKind::kCtrl: break;
    case CtxKind::kLaneEnd: {
      auto op = pending_.find(ctx.token);
      bool chained_imm = op && op->kind == OpKind::kWriteImm;
      pending_.lane_done(ctx.token, Status::Ok());
      if (chained_imm) {
        std::lock_guard<std::mutex> lk(imm_mu_);
        imm_inflight_--;
      }
      if (chained_imm) goto imm_released;
      break;
    }
    case CtxKind::kImmLaneEnd: {
      uint32_t lanes = 0;
      bool ready = false;
      {
        std::lock_guard<std::mutex> lk(imm_mu_);
        auto it = imm_left_.find(ctx.token);
        if (it == imm_left_.end()) break;
        if (--it->second.first == 0) {
          ready = true;
          lanes = it->second.second;
          imm_left_.erase(it);
        }
      }
      if (ready) {
        auto op = pending_.find(ctx.token);
        if (op) post_imm(ctx.token, op->imm, lanes);
      }
      break;
    }
    case CtxKind::kImmFinal: {
      for (uint32_t i = 0; i < ctx.aux; ++i) pending_.lane_done(ctx.token, Status::Ok());
      {
        std::lock_guard<std::mutex> lk(imm_mu_);
        imm_inflight_--;
      }
      goto imm_released;
    }
    case CtxKind::kRdvRead: finish_rendezvous(ctx.token, Status::Ok()); break;
  }
  return;
imm_released:
  for (;;) {
    std::tuple<uint64_t, uint32_t, uint32_t> next;
    {
      std::lock_guard<std::mutex> lk(imm_mu_);
      if (imm_wait_.empty() || imm_inflight_ >= kMaxImms) return;
      next = imm_wait_.front();
      imm_wait_.pop_front();
    }
    post_imm(std::get<0>(next), std::get<1>(next), std::get<2>(next));
  }
}

void RdmaEndpoint::wake() {
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wake_fd_, &one, sizeof one);
  }
}

void RdmaEndpoint::progress() {
  ibv_wc wcs[32];
  auto idle_since = std::chrono::steady_clock::now();
  bool armed = false;
  while (!stop_.load(std::memory_order_acquire)) {
    int n = ibv_poll_cq(cq_, 32, wcs);
    if (n < 0) {
      fail({ErrorCode::kSystem, "rdma: ibv_poll_cq failed"}, true);
      break;
    }
    if (n > 0) {
      for (int i = 0; i < n; ++i) handle(wcs[i]);
      idle_since = std::chrono::steady_clock::now();
      armed = false;
      continue;
    }
    auto now = std::chrono::steady_clock::now();
    // Busy-poll while operations are outstanding (their completions are a round trip
    // away) and for spin_ after the last completion; sleep on the channel only when idle.
    // (Bounded: SLUICE_RDMA_BUSY_MS, default 20 ms, without any completion or submission
    // and it sleeps anyway; 0 = never spin for pending operations.)
    auto last = std::max(idle_since, std::chrono::steady_clock::time_point(
                                         std::chrono::steady_clock::duration(last_submit_.load(std::memory_order_relaxed))));
    if (now - last < spin_ || (pending_.size() > 0 && now - last < busy_)) continue;
    if (!armed) {
      if (ibv_req_notify_cq(cq_, 0)) {
        fail({ErrorCode::kSystem, "rdma: ibv_req_notify_cq failed"}, true);
        break;
      }
      armed = true;
      continue;  // poll once more: a completion may have raced the arming
    }
    std::vector<pollfd> fds;
    fds.push_back({comp_->fd, POLLIN, 0});
    fds.push_back({wake_fd_, POLLIN, 0});
    std::vector<int> which;
    for (int c = 0; c < nchan_; ++c)
      if (chans_[c]->sock_live && !failed_.load()) {
        fds.push_back({chans_[c]->sock.fd(), POLLIN, 0});
        which.push_back(c);
      }
    sleeping_.store(true);
    if (std::chrono::steady_clock::now() - std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(
                                                 last_submit_.load())) < std::chrono::milliseconds(1)) {  // raced a submit
      sleeping_.store(false);
      continue;
    }
    int rc = ::poll(fds.data(), fds.size(), 100);
    sleeping_.store(false);
    if (rc <= 0) continue;
    if (fds[0].revents & POLLIN) {
      ibv_cq* ev_cq;
      void* ev_ctx;
      while (v_.get_cq_event(comp_, &ev_cq, &ev_ctx) == 0) cq_events_++;
      if (cq_events_ >= 64) {
        v_.ack_cq_events(cq_, cq_events_);
        cq_events_ = 0;
      }
      armed = false;
      idle_since = std::chrono::steady_clock::now();
    }
    if (fds[1].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);
    }
    for (size_t i = 0; i < which.size(); ++i) {
      if (!fds[2 + i].revents) continue;
      char b;
      ssize_t k = ::recv(fds[2 + i].fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        chans_[which[i]]->sock_live = false;
        fail({ErrorCode::kPeerLost, "rdma: peer " + setup_.peer.engine_id + " closed channel " + std::to_string(which[i]) +
                                        " (process exited or endpoint closed)"},
             true);
      } else if (k > 0) {
        chans_[which[i]]->sock_live = false;  // nothing is ever sent after the reply
      }
    }
  }
}

void RdmaEndpoint::fail(const Status& why, bool notify) {
  failed_.store(true);
  if (!failing_.exchange(true)) {
    SLUICE_LOG(kDebug, "rdma: endpoint failed: " << why.message);
    // Flush the queues: every outstanding WR completes with IBV_WC_WR_FLUSH_ERR.
    for (auto& ch : chans_) {
      std::lock_guard<std::mutex> lk(ch->mu);
      ch->backlog.clear();
      if (!ch->qp) continue;
      ibv_qp_attr at{};
      at.qp_state = IBV_QPS_ERR;
      v_.modify_qp(ch->qp, &at, IBV_QP_STATE);
    }
    pending_.fail_all(why);
    {
      std::lock_guard<std::mutex> lk(send_mu_);
      send_wait_.clear();
    }
  }
  {
    std::lock_guard<std::mutex> lk(gone_mu_);
    gone_cv_.notify_all();
  }
  if (notify && events_ && !notified_.exchange(true)) events_->on_failure(why);
}

// A local region is being unregistered: tell the peer and wait (bounded) for its ack, so that
// it refuses the region from now on instead of hitting the deregistered MR.
void RdmaEndpoint::region_gone(uint64_t id) {
  if (failed_.load() || !ready_.load()) return;
  uint64_t nonce;
  {
    std::lock_guard<std::mutex> lk(gone_mu_);
    nonce = ++gone_sent_;
  }
  CtrlMsg m{};
  m.type = kGone;
  m.seq = id;
  m.addr = nonce;
  post_ctrl(m);
  std::unique_lock<std::mutex> lk(gone_mu_);
  gone_cv_.wait_for(lk, std::chrono::milliseconds(1000), [&] { return gone_acked_ >= nonce || failed_.load(); });
}

void RdmaEndpoint::close(const Status& why) {
  fail(why, false);
  if (closed_.exchange(true)) return;
  stop_.store(true, std::memory_order_release);
  wake();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }
  for (auto& ch : chans_) {
    ch->sock.shutdown();
    ch->sock.close();
  }
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    for (auto& [id, r] : rdv_)
      if (r.stash_mr) v_.dereg_mr(r.stash_mr);
    rdv_.clear();
  }
  for (auto& ch : chans_)
    if (ch->qp) {
      v_.destroy_qp(ch->qp);
      ch->qp = nullptr;
    }
  if (cq_) {
    if (cq_events_) v_.ack_cq_events(cq_, cq_events_);
    v_.destroy_cq(cq_);
    cq_ = nullptr;
  }
  if (comp_) {
    v_.destroy_comp_channel(comp_);
    comp_ = nullptr;
  }
  if (ctrl_mr_) {
    v_.dereg_mr(ctrl_mr_);
    ctrl_mr_ = nullptr;
  }
  if (wake_fd_ >= 0) {
    ::close(wake_fd_);
    wake_fd_ = -1;
  }
}

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(std::shared_ptr<Device> dev, const Registry* reg) : dev_(std::move(dev)), reg_(reg) {}
  std::string name() const override { return "rdma"; }
  // Above tcp, below shm: on one host shared memory is faster than the NIC loopback.
  int priority() const override { return 15; }
  bool supports(const Location&) const override { return true; }
  json local_address() const override {
    json j = dev_->address();
    j["rkeys"] = dev_->rkeys(*reg_);  // registers regions lazily: peers learn rkeys from the info blob
    return j;
  }
  bool can_reach(const EngineInfo& peer, std::string* why) override {
    auto it = peer.transports.find("rdma");
    if (it == peer.transports.end()) {
      if (why) *why = "peer has no rdma transport";
      return false;
    }
    std::string link = it->second.value("link", "");
    if (link != (dev_->ethernet() ? "eth" : "ib")) {
      if (why) *why = "peer's RDMA link layer (" + link + ") differs from ours";
      return false;
    }
    return true;
  }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto ep = std::make_shared<RdmaEndpoint>(dev_, reg_, setup);
    dev_->add_listener(ep);
    return ep;
  }

 private:
  std::shared_ptr<Device> dev_;
  const Registry* reg_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(rdma, "rdma", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  const Verbs* v = Verbs::get(why);
  if (!v) return nullptr;
  const char* hca = std::getenv("SLUICE_IB_HCA");
  const char* gidx = std::getenv("SLUICE_IB_GID_INDEX");
  auto dev = Device::open(v, hca ? hca : "", gidx ? gidx : "", why);
  if (!dev) return nullptr;
  dev->start_sweeper(ctx.registry);
  return std::make_unique<RdmaTransport>(std::move(dev), ctx.registry);
});

}  // namespace sluice::detail
