// rdma endpoint: queue-pair set-up, connection and teardown (see endpoint.hpp).
#include <algorithm>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <charconv>
#include <mutex>
#include <cstring>

#include "core/log.hpp"
#include "core/params.hpp"
#include "transport/rdma/endpoint.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail::rdma {

using nlohmann::json;

namespace {

const Param<int> kSpinUs{"rdma.spin_us", "SLUICE_RDMA_SPIN_US", 50, int_in(0, 1000000),
                         "the progress thread polls the CQs this long after the last completion before sleeping"};
const Param<int> kBusyMs{"rdma.busy_ms", "SLUICE_RDMA_BUSY_MS", 20, int_in(0, 60000),
                         "the progress thread busy-polls while ops are outstanding, up to this long without a completion; 0 = off"};
const Param<int> kPollUs{"rdma.poll_us", "SLUICE_RDMA_POLL_US", 20000, int_in(0, 10000000),
                         "a waiter polls the CQs itself up to this long without a completion before it sleeps; 0 = never"};
// A fabric whose ports differ in MTU still connects at the smaller one; where that would be
// a misconfiguration worth failing on (a jumbo-frame fabric with one port left at 1500), a
// minimum makes it a named error at connect instead of a slow endpoint.
const Param<int> kMinMtu{"rdma.min_mtu", "SLUICE_RDMA_MIN_MTU", 0,
                         [](const std::string& where, const std::string& text) {
                           int v = -1;
                           auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
                           if (ec != std::errc() || p != text.data() + text.size() ||
                               (v != 0 && v != 256 && v != 512 && v != 1024 && v != 2048 && v != 4096))
                             param_error(where, text, "is not 0, 256, 512, 1024, 2048 or 4096");
                           return v;
                         },
                         "smallest path MTU (bytes) an endpoint accepts; connecting over a smaller one fails "
                         "naming both ports; 0 = any"};
// The queue pairs' transport timer and retry count (NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT): a
// packet or its ACK lost is sent again after 4.096 us * 2^timeout, up to retry_cnt times in a
// row, then the work request fails with a retry-exceeded error (and failover takes over).
const Param<int> kAckTimeout{"rdma.timeout", "SLUICE_IB_TIMEOUT", 14, int_in(1, 31),
                             "queue pair transport timer, 4.096 us * 2^N per try (14: 67 ms)"};
const Param<int> kRetryCnt{"rdma.retry_cnt", "SLUICE_IB_RETRY_CNT", 7, int_in(0, 7),
                           "retries in a row before a lost packet fails its queue pair (SoftRoCE: at most 6, "
                           "since it reads 7 as 'forever')"};
// Test-only knobs: read from the environment when an endpoint is created (ParamScope::kTest),
// so a test can give one endpoint of an engine a different shape or a fault.
const Param<uint64_t> kMaxWrBytesParam{"rdma.max_wr_bytes", "SLUICE_RDMA_MAX_WR_BYTES", rdma::kMaxWrBytes,
                                       size_in(1, rdma::kMaxWrBytes),
                                  "test only: a smaller message limit, to exercise splitting on devices with a large one",
                                  ParamScope::kTest};
const Param<int> kMaxSgeParam{"rdma.max_sge", "SLUICE_RDMA_MAX_SGE", rdma::kMaxSge, int_in(1, rdma::kMaxSge),
                              "test only: gather entries per WR (1: every piece not contiguous locally gets its own WR)",
                              ParamScope::kTest};
const Param<uint64_t> kFaultRkeyXor{"rdma.fault_rkey_xor", "SLUICE_RDMA_FAULT_RKEY_XOR", 0,
                                    [](const std::string& where, const std::string& text) -> uint64_t {
                                      // hex (0x...) or decimal, 32 bits
                                      bool hex = text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X');
                                      uint64_t v = 0;
                                      const char* b = text.data() + (hex ? 2 : 0);
                                      const char* e = text.data() + text.size();
                                      auto [p, ec] = std::from_chars(b, e, v, hex ? 16 : 10);
                                      if (ec != std::errc() || p != e || v > UINT32_MAX)
                                        param_error(where, text, "is not a 32-bit number");
                                      return v;
                                    },
                                    "test only (fault injection): XOR every rkey of new endpoints with this",
                                    ParamScope::kTest};

}  // namespace

Status wc_status(const Verbs& v, const ibv_wc& wc, const std::string& what) {
  ErrorCode code = ErrorCode::kRemoteError;
  if (wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_RNR_RETRY_EXC_ERR) code = ErrorCode::kPeerLost;
  if (wc.status == IBV_WC_WR_FLUSH_ERR) code = ErrorCode::kPeerLost;
  if (wc.status == IBV_WC_LOC_PROT_ERR || wc.status == IBV_WC_LOC_LEN_ERR || wc.status == IBV_WC_LOC_QP_OP_ERR)
    code = ErrorCode::kInternal;
  char vendor[16];
  std::snprintf(vendor, sizeof vendor, "%x", wc.vendor_err);
  return {code, "rdma " + what + " failed: " + v.wc_status_str(wc.status) + " (status " + std::to_string(wc.status) +
                    ", vendor error 0x" + vendor + ")"};
}

RdmaEndpoint::RdmaEndpoint(std::shared_ptr<Rails> rails, const Registry* reg, const EndpointSetup& s,
                           std::shared_ptr<Redialer> redialer)
    : EndpointBase(s),
      rails_(std::move(rails)),
      redialer_(std::move(redialer)),
      v_(rails_->v()),
      reg_(reg),
      setup_(s),
      nchan_(s.channels),
      remote_(s.channels) {
  configure_failover();
  spin_ = std::chrono::microseconds(kSpinUs.get(s.config));
  busy_ = std::chrono::milliseconds(kBusyMs.get(s.config));
  poll_budget_ = std::chrono::microseconds(kPollUs.get(s.config));
  min_mtu_ = kMinMtu.get(s.config);
  ack_timeout_ = kAckTimeout.get(s.config);
  retry_cnt_ = kRetryCnt.get(s.config);
  fault_rkey_xor_ = static_cast<uint32_t>(kFaultRkeyXor.read());
  max_wr_bytes_ = kMaxWrBytesParam.read();
  max_sge_ = kMaxSgeParam.read();
  sq_depth_ = 1024;
  for (int r = 0; r < rails_->size(); ++r) {
    sq_depth_ = std::min(sq_depth_, rails_->at(r).attr().max_qp_wr);
    max_sge_ = std::max(1, std::min(max_sge_, rails_->at(r).attr().max_sge));
    if (rails_->at(r).attr().max_sge_rd > 0) max_sge_rd_ = std::min(max_sge_rd_, rails_->at(r).attr().max_sge_rd);
    // A piece larger than a port's max_msg_sz goes out as several WRs.
    max_wr_bytes_ = std::min<uint64_t>(max_wr_bytes_, rails_->at(r).max_msg_sz());
  }
  max_inline_ = 256;
  for (int i = 0; i < nchan_; ++i) {
    chans_.push_back(std::make_unique<Chan>());
    all_chans_.push_back(i);
  }
  // Thin post path on QP 0: half its send queue for posts (the rest stays for control
  // messages and transfers), a completion asked for at least every kSignalEvery posts and
  // within post.depth (else a poster held by the depth limit would wait for a completion
  // nobody asked for).
  post_bound_ = std::max(1, sq_depth_ / 2);
  post_signal_every_ = std::max<uint64_t>(1, std::min<uint64_t>({kSignalEvery, post_depth(s.config), post_bound_}));
  chans_[0]->post_pins.resize(post_bound_);
  for (int r = 0; r < rails_->size(); ++r)
    if (rails_->at(r).attr().atomic_cap == IBV_ATOMIC_NONE) post_atomics_ = false;
  try {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw Error(ErrorCode::kSystem, std::string("rdma: eventfd: ") + std::strerror(errno));
    // + 1 slot: where post_signal's atomics return the old value (post_path.cpp)
    ctrl_mem_.assign(size_t(kRecvSlots + kCtrlSendSlots + 1) * kSlotBytes, 0);
    for (uint32_t i = 0; i < kCtrlSendSlots; ++i) ctrl_free_.push_back(kRecvSlots + i);
    // Failover may put a queue pair on any rail later: every rail's CQ exists before the
    // progress thread starts (it walks cqs_ without a lock).
    if (failover_)
      for (int r = 0; r < rails_->size(); ++r) cq_for(r);
  } catch (...) {
    close({ErrorCode::kCancelled, "setup failed"});
    throw;
  }
  auto it = s.peer.transports.find("rdma");
  if (it != s.peer.transports.end()) take_peer(it->second);
  take_region_keys(s.peer);
}

RdmaEndpoint::~RdmaEndpoint() {
  close({ErrorCode::kCancelled, "endpoint destroyed"});
  release();
  // The eventfd outlives release(): a caller ending its wait or submitting may still wake()
  // after the watchdog closed us, and nothing may write to a closed (or reused) descriptor.
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

RailCq& RdmaEndpoint::cq_for(int rail) {
  std::lock_guard<std::mutex> lk(cq_mu_);
  for (auto& c : cqs_)
    if (c.rail == rail) return c;
  const Device& d = rails_->at(rail);
  RailCq c;
  c.rail = rail;
  c.comp = v_.create_comp_channel(d.ctx());
  if (!c.comp) throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_comp_channel: ") + std::strerror(errno));
  ::fcntl(c.comp->fd, F_SETFL, ::fcntl(c.comp->fd, F_GETFL) | O_NONBLOCK);
  // Room for a replaced queue pair's flushed work requests beside the live ones (failover).
  int depth = std::min(d.attr().max_cqe, 2 * nchan_ * sq_depth_ + kRecvSlots + 64);
  c.cq = v_.create_cq(d.ctx(), depth, nullptr, c.comp, 0);
  if (!c.cq) {
    int err = errno;
    v_.destroy_comp_channel(c.comp);
    throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_cq: ") + std::strerror(err));
  }
  cqs_.reserve(rails_->size());  // references handed out stay valid
  cqs_.push_back(c);
  return cqs_.back();
}

void RdmaEndpoint::create_qp(int index, int rail, int peer_rail) {
  const Device& d = rails_->at(rail);
  if (index == 0) {
    // The control slots live on QP 0's rail (messages, rendezvous, post_signal's scratch).
    ctrl_mr_ = v_.reg_mr(d.pd(), ctrl_mem_.data(), ctrl_mem_.size(), kAccess);
    if (!ctrl_mr_)
      throw Error(ErrorCode::kSystem, std::string("rdma: cannot register control slots: ") + std::strerror(errno));
  }
  ibv_qp* qp = make_qp(index, rail);
  Chan& ch = *chans_[index];
  ch.qp = qp;
  ch.rail = rail;
  ch.peer_rail = peer_rail;
  ch.free = sq_depth_;
  ch.ring.assign(sq_depth_, WrCtx{});
  if (index == 0) {
    recv_posted_ = std::min<uint32_t>(std::min(kRecvSlots, d.attr().max_qp_wr), kRecvSlots);
    if (recv_posted_ <= static_cast<uint32_t>(kCtrlReserve) + 4)
      throw Error(ErrorCode::kSystem, "rdma: " + d.name() + " allows only " + std::to_string(recv_posted_) +
                                          " receive WQEs per QP (need more than " + std::to_string(kCtrlReserve + 4) + ")");
    credit_batch_ = std::max<uint32_t>(1, std::min<uint32_t>(64, (recv_posted_ - kCtrlReserve) / 4));
    for (uint32_t i = 0; i < recv_posted_; ++i) post_recv_slot(i);
  }
}

ibv_qp* RdmaEndpoint::make_qp(int index, int rail) {
  const Device& d = rails_->at(rail);
  ibv_cq* cq = cq_for(rail).cq;
  ibv_qp_init_attr ia{};
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap.max_send_wr = sq_depth_;
  ia.cap.max_recv_wr = index == 0 ? std::min(kRecvSlots, d.attr().max_qp_wr) : 1;
  ia.cap.max_send_sge = static_cast<uint32_t>(max_sge_);
  ia.cap.max_recv_sge = 1;
  ibv_qp* qp = nullptr;
  for (uint32_t inl : {256u, 64u, 0u}) {
    ia.cap.max_inline_data = inl;
    qp = v_.create_qp(d.pd(), &ia);
    if (qp) break;
  }
  if (!qp) throw Error(ErrorCode::kSystem, std::string("rdma: ibv_create_qp on ") + d.name() + ": " + std::strerror(errno));
  if (!ready_.load()) {  // fixed once the endpoint runs: a replacement must fit what it had
    max_inline_ = std::min(max_inline_, ia.cap.max_inline_data);
    max_sge_ = std::max(1, std::min<int>(max_sge_, static_cast<int>(ia.cap.max_send_sge)));
    max_sge_rd_ = std::max(1, std::min(max_sge_rd_, max_sge_));
  } else if (ia.cap.max_inline_data < max_inline_ || static_cast<int>(ia.cap.max_send_sge) < max_sge_) {
    v_.destroy_qp(qp);
    throw Error(ErrorCode::kSystem, "rdma: a replacement queue pair on " + d.name() + " takes less than the endpoint's");
  }
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_INIT;
  at.pkey_index = 0;
  at.port_num = static_cast<uint8_t>(d.port());
  at.qp_access_flags = d.access();  // remote atomics too where the device has them (post_signal)
  if (int rc = v_.modify_qp(qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    v_.destroy_qp(qp);
    throw Error(ErrorCode::kSystem, std::string("rdma: QP to INIT: ") + std::strerror(rc));
  }
  return qp;
}

QpAddress RdmaEndpoint::qp_address(const ibv_qp* qp, int rail) const {
  QpAddress a;
  a.qpn = qp->qp_num;
  a.psn = (a.qpn * 2654435761u) & 0xffffff;
  a.port = rails_->at(rail).desc();
  a.described = true;
  return a;
}

QpAddress RdmaEndpoint::local_qp_address(int index) const {
  const Chan& ch = *chans_[index];
  return qp_address(ch.qp, ch.rail);
}

Negotiated RdmaEndpoint::negotiate_with(int index, int rail, const QpAddress& r) const {
  // Refuses (naming both ports) what cannot work before a QP is pointed at the peer: otherwise
  // a mismatch shows only as an unnamed modify_qp error or a retry-exceeded first operation.
  Negotiated n = negotiate(rails_->at(rail).desc(), r, min_mtu_);
  SLUICE_LOG(kInfo, "rdma: channel " << index << " to " << setup_.peer.engine_id << ": " << n.summary);
  return n;
}

void RdmaEndpoint::bring_up(int index, const QpAddress& r, const Negotiated& n) {
  bring_up_qp(chans_[index]->qp, chans_[index]->rail, r, n);
  remote_[index] = r;
}

void RdmaEndpoint::bring_up_qp(ibv_qp* qp, int rail, const QpAddress& r, const Negotiated& n) {
  const Device& d = rails_->at(rail);
  ibv_gid dgid{};
  std::memcpy(dgid.raw, r.port.gid.data(), 16);
  const int rd_atom = std::max(1, std::min(16, d.attr().max_qp_rd_atom));
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = static_cast<ibv_mtu>(n.path_mtu);
  at.dest_qp_num = r.qpn;
  at.rq_psn = r.psn;
  at.max_dest_rd_atomic = static_cast<uint8_t>(rd_atom);
  at.min_rnr_timer = 12;
  at.ah_attr.port_num = static_cast<uint8_t>(d.port());
  if (d.ethernet()) {
    at.ah_attr.is_global = 1;
    at.ah_attr.grh.dgid = dgid;
    at.ah_attr.grh.sgid_index = static_cast<uint8_t>(d.gid_index());
    at.ah_attr.grh.hop_limit = 64;
  } else {
    at.ah_attr.dlid = r.port.lid;  // IB: route by the remote LID
  }
  int rc = v_.modify_qp(qp, &at,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                            IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) throw Error(ErrorCode::kSystem, std::string("rdma: QP to RTR: ") + std::strerror(rc));
  ibv_qp_attr rts{};
  rts.qp_state = IBV_QPS_RTS;
  rts.timeout = static_cast<uint8_t>(ack_timeout_);
  rts.retry_cnt = static_cast<uint8_t>(retry_count_for(d));
  rts.rnr_retry = 7;  // the window accounting keeps RNR away; this is only a safety net
  rts.sq_psn = qp_address(qp, rail).psn;
  rts.max_rd_atomic = static_cast<uint8_t>(rd_atom);
  rc = v_.modify_qp(qp, &rts,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) throw Error(ErrorCode::kSystem, std::string("rdma: QP to RTS: ") + std::strerror(rc));
}

// See effective_retry_cnt (negotiate.hpp); said once per process, where it applies.
int RdmaEndpoint::retry_count_for(const Device& d) const {
  const int n = effective_retry_cnt(retry_cnt_, d.attr().vendor_id);
  if (n == retry_cnt_) return n;
  static std::once_flag said;
  std::call_once(said, [&] {
    SLUICE_LOG(kInfo, "rdma: " << d.name() << " is SoftRoCE, which retries forever at rdma.retry_cnt 7: using 6");
  });
  return n;
}

json RdmaEndpoint::hello_body(int index) {
  const Chan& ch = *chans_[index];
  json j = local_qp_address(index).to_json();
  j["rail"] = ch.peer_rail;  // the receiver's rail for this channel
  j["src_rail"] = ch.rail;
  if (index == 0) {
    j["rkeys"] = rails_->rkeys();  // what region_added() registered; registers nothing
    j["scratch_addr"] = reinterpret_cast<uintptr_t>(ctrl_mem_.data());
    j["scratch_rkey"] = ctrl_mr_->rkey;
    j["recv_slots"] = recv_posted_;  // the peer's imm credit is what control messages leave
  }
  return j;
}

int RdmaEndpoint::peer_rails() const {
  auto it = setup_.peer.transports.find("rdma");
  if (it == setup_.peer.transports.end() || !it->second.contains("rails") || !it->second["rails"].is_array()) return 1;
  return std::max<int>(1, static_cast<int>(it->second["rails"].size()));
}

int RdmaEndpoint::peer_rail_up(int preferred) const {
  auto it = setup_.peer.transports.find("rdma");
  if (it == setup_.peer.transports.end() || !it->second.contains("rails") || !it->second["rails"].is_array())
    return preferred;
  const json& rails = it->second["rails"];
  const int n = static_cast<int>(rails.size());
  for (int i = 0; i < n; ++i) {
    const json& r = rails[(preferred + i) % n];
    if (!(r.is_object() && r.value("down", false))) return (preferred + i) % n;
  }
  return preferred;  // all marked down: ask anyway (the peer picks one that is up, or refuses)
}

void RdmaEndpoint::peer_updated(const EngineInfo& peer) {
  // Only the keys: the receive credits and scratch buffer are fixed at the handshake (a
  // refresh must not reset flow control mid-stream).
  take_region_keys(peer);
}

void RdmaEndpoint::take_region_keys(const EngineInfo& peer) {
  // Each region carries its rkeys (by rail) as the peer's rdma transport published them.
  json keys = json::object();
  for (const auto& r : peer.regions) {
    auto d = r.transport_data.find("rdma");
    if (d != r.transport_data.end() && d->second.is_array()) keys[std::to_string(r.info.id)] = d->second;
  }
  if (!keys.empty()) take_rkeys({{"rkeys", std::move(keys)}});
}

void RdmaEndpoint::take_peer(const json& j) {
  if (!j.is_object()) return;
  take_rkeys(j);
  if (j.contains("recv_slots") && j["recv_slots"].is_number_unsigned()) {
    int64_t slots = std::min<int64_t>(j["recv_slots"].get<uint32_t>(), kRecvSlots);
    std::lock_guard<std::mutex> lk(imm_mu_);
    imm_credits_ = imm_credits_max_ = std::max<int64_t>(1, slots - kCtrlReserve);
  }
  if (j.contains("scratch_rkey")) {
    peer_scratch_addr_ = j["scratch_addr"].get<uint64_t>();
    peer_scratch_rkey_ = j["scratch_rkey"].get<uint32_t>();
  }
}

void RdmaEndpoint::take_rkeys(const json& j) {
  if (!j.is_object()) return;
  if (j.contains("rkeys") && j["rkeys"].is_object()) {
    std::lock_guard<std::mutex> lk(rkey_mu_);
    for (auto& [k, val] : j["rkeys"].items()) {
      if (!val.is_array()) continue;
      uint64_t id = std::strtoull(k.c_str(), nullptr, 10);
      if (gone_.count(id)) continue;
      std::vector<uint32_t> keys;
      for (auto& x : val)
        if (x.is_number_unsigned()) keys.push_back(x.get<uint32_t>());
      rkeys_[id] = std::move(keys);
    }
  }
}

void RdmaEndpoint::connect(const ChannelOpener& open) {
  const int local = rails_->size(), peer = peer_rails();
  if (nchan_ < std::min(local, peer))
    SLUICE_LOG(kInfo, "rdma: " << nchan_ << " channel(s) use " << nchan_ << " of " << std::min(local, peer)
                               << " rails (raise SLUICE_CHANNELS to stripe over all)");
  opener_ = open;  // failover dials replacement queue pairs with it
  for (int i = 0; i < nchan_; ++i) {
    // QP i belongs on our rail i % L and the peer's i % R; a rail that is down now (ours, or
    // one the peer's info marks down) is skipped, and failover brings the QP home later.
    const int rail = rails_->up_rail(i % local);
    if (rail < 0) throw Error(ErrorCode::kNoDevice, "rdma: every rail of this engine is down");
    chans_[i]->home_rail = i % local;
    // Rail i talks to rail i (rail-optimised fabrics route nothing else, or badly): with as
    // many rails on both sides, the peer's rail of the same index as ours.
    create_qp(i, rail, peer_rail_up(local == peer ? rail : i % peer));
    auto [sock, reply] = open(i, {{"rdma", hello_body(i)}});
    if (!reply.contains("rdma")) throw Error(ErrorCode::kProtocol, "rdma: channel reply without queue pair address");
    const QpAddress addr = QpAddress::from_json(reply["rdma"]);
    const Negotiated n = negotiate_with(i, chans_[i]->rail, addr);
    take_peer(reply["rdma"]);
    bring_up(i, addr, n);
    // The peer may have put its end on another of its rails (the one asked for is down).
    const int src = reply["rdma"].value("src_rail", chans_[i]->peer_rail);
    if (src >= 0 && src < peer) chans_[i]->peer_rail = src;
    chans_[i]->sock = std::move(sock);
    chans_[i]->sock_live = true;
  }
  start_thread();
}

json RdmaEndpoint::attach(int index, const json& hello) {
  std::lock_guard<std::mutex> lk(attach_mu_);
  if (index < 0 || index >= nchan_) throw Error(ErrorCode::kProtocol, "rdma: channel index out of range");
  if (hello.is_object() && hello.value("replace", false)) {
    if (!hello.contains("rdma") || !hello["rdma"].is_object())
      throw Error(ErrorCode::kProtocol, "rdma: channel replace without queue pair address");
    return attach_replacement(index, hello["rdma"]);
  }
  if (chans_[index]->qp) throw Error(ErrorCode::kProtocol, "channel " + std::to_string(index) + " attached twice");
  if (!hello.contains("rdma") || !hello["rdma"].is_object())
    throw Error(ErrorCode::kProtocol, "rdma: channel hello without queue pair address");
  const json& h = hello["rdma"];
  int rail = h.value("rail", 0), peer_rail = h.value("src_rail", 0);
  if (rail < 0 || rail >= rails_->size() || peer_rail < 0)
    throw Error(ErrorCode::kProtocol, "rdma: channel hello names rail " + std::to_string(rail) + " of " +
                                          std::to_string(rails_->size()));
  // Checked before anything is allocated for the channel: a refused hello leaves no QP behind.
  const QpAddress addr = QpAddress::from_json(h);
  chans_[index]->home_rail = rail;
  if (!rails_->up(rail)) rail = rails_->up_rail(rail);  // ours is down: another (the reply says which)
  if (rail < 0) throw Error(ErrorCode::kNoDevice, "rdma: every rail of this engine is down");
  const Negotiated n = negotiate_with(index, rail, addr);
  create_qp(index, rail, peer_rail);
  take_peer(h);
  bring_up(index, addr, n);
  return {{"rdma", hello_body(index)}};
}

bool RdmaEndpoint::adopt(int index, net::Socket sock) {
  std::lock_guard<std::mutex> lk(attach_mu_);
  if (attached_ >= nchan_) {  // a replacement queue pair (failover.cpp): its reply has left
    adopt_replacement(index, std::move(sock));
    return false;
  }
  // The listener's socket stays open as a liveness probe of the peer.
  std::lock_guard<std::mutex> sk(sock_mu_);
  chans_[index]->sock = std::move(sock);
  chans_[index]->sock_live = true;
  if (++attached_ == nchan_) {
    start_thread();
    return true;
  }
  return false;
}

void RdmaEndpoint::start_thread() {
  thread_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-rdma");
    run();
  });
  ready_.store(true);
}

void RdmaEndpoint::flush_control(std::chrono::milliseconds limit) {
  if (failed() || !ready_.load() || poll_owner_.load() == std::this_thread::get_id()) return;
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    {
      std::lock_guard<std::mutex> lk(ctrl_mu_);
      if (ctrl_free_.size() == static_cast<size_t>(kCtrlSendSlots)) return;
    }
    if (!progress()) std::this_thread::yield();
  }
}

void RdmaEndpoint::close(const Status& why) {
  // Control messages already posted (a FIN answering the peer's send) leave before the queue
  // pairs are torn down.
  if (!closed_.load()) flush_control(std::chrono::milliseconds(200));
  fail(why, false);
  if (closed_.exchange(true)) return;
  stop_.store(true, std::memory_order_release);
  { std::lock_guard<std::recursive_mutex> rl(replace_mu_); }  // a replacement under way finishes
  wake();
  if (thread_.joinable()) {
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }
  {
    std::lock_guard<std::mutex> sk(sock_mu_);
    for (auto& ch : chans_) {
      ch->sock.shutdown();
      ch->sock.close();
      ch->retired_sock.close();
    }
  }
  // A completion callback run by a polling waiter closed us: that waiter is still inside
  // poll_locked(); the destructor releases the verbs objects instead.
  if (poll_owner_.load() == std::this_thread::get_id()) return;
  release();
}

void RdmaEndpoint::release() {
  std::lock_guard<std::mutex> poll(poll_mu_);  // waiters out of the CQs (stop_ keeps them out)
  if (released_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    for (auto& [id, r] : rdv_)
      if (r.stash_mr) v_.dereg_mr(r.stash_mr);
    rdv_.clear();
  }
  for (auto& ch : chans_) {
    std::lock_guard<std::mutex> lk(ch->mu);  // a monitor's fail() may be in stop_io()
    if (ch->qp) {
      v_.destroy_qp(ch->qp);
      ch->qp = nullptr;
    }
    if (ch->retired_qp) {
      v_.destroy_qp(ch->retired_qp);
      ch->retired_qp = nullptr;
    }
  }
  for (auto& c : cqs_) {
    if (c.events) v_.ack_cq_events(c.cq, c.events);
    v_.destroy_cq(c.cq);
    v_.destroy_comp_channel(c.comp);
  }
  cqs_.clear();
  if (ctrl_mr_) {
    v_.dereg_mr(ctrl_mr_);
    ctrl_mr_ = nullptr;
  }
}

}  // namespace sluice::detail::rdma
