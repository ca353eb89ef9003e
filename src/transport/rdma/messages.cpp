// rdma endpoint: control messages on QP 0 (see endpoint.hpp).
//  * SEND / RECV: sender-initiated rendezvous. The sender SENDs a 40-byte RTS {seq, addr, len,
//    rkey} on QP 0; the target claims the message in the core's MessageMatcher (the posted
//    recv buffer, or a stash for an early message), RDMA READs min(len, capacity) bytes
//    straight into it and SENDs back a FIN {seq, status}; the sender's future completes on FIN.
//    No payload ever goes through a receive buffer, so receive buffers are 64-byte control
//    slots and the window is bounded by counting: at most kMaxSends RTS in flight per
//    direction, plus the FINs that answer the peer's RTS, plus imm writes within the credit the
//    receiver gives back (CREDIT), never exceed the receive WQEs pre-posted on QP 0 (reposted
//    as soon as they are polled).
//  * GONE / GONE_ACK: a region we unregister is announced before its MRs go away.
#include <arpa/inet.h>

#include <cstring>

#include "transport/rdma/endpoint.hpp"

namespace sluice::detail::rdma {

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
  w[0].sges[0] = {reinterpret_cast<uintptr_t>(buf), sizeof(CtrlMsg), ctrl_mr_->lkey};
  w[0].nsge = 1;
  w[0].wr.opcode = IBV_WR_SEND;
  if (sizeof(CtrlMsg) <= max_inline_) w[0].wr.send_flags |= IBV_SEND_INLINE;
  w[0].signal = true;
  w[0].kind = CtxKind::kCtrl;
  w[0].aux = slot;
  Status st = post(0, w);
  if (!st.ok()) fail(st, true);
}

void RdmaEndpoint::send(std::shared_ptr<MessageOp> op) {
  std::lock_guard<std::mutex> lk(send_mu_);  // keeps RTS in submission order
  if (!pending_.add_send(op)) {
    send_wait_.clear();  // failed endpoint: pending_ completed them
    return;
  }
  wake_for_submit();
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
    const RegionKeys* keys = rails_->keys_for(*reg_, op->pin.get(), &st);
    if (!keys) {
      // The peer expects message seq: announcing it without data would desynchronise
      // matching, so fail the endpoint instead.
      auto o = pending_.take_send(op->seq);
      if (o) o->future->complete(st);
      fail(st, true);
      return;
    }
    m.rkey = keys->mrs[chans_[0]->rail]->rkey;  // the peer READs through its QP 0, joined to ours
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
  Rendezvous* r;
  {
    std::lock_guard<std::mutex> lk(rdv_mu_);
    id = next_rdv_++;
    r = &rdv_[id];
    r->claim = std::move(claim);
  }
  if (n == 0) {
    finish_rendezvous(id, Status::Ok());
    return;
  }
  const Device& d = rails_->at(chans_[0]->rail);
  uint32_t lkey = 0;
  Status st;
  if (r->claim.recv) {
    const RegionKeys* keys = rails_->keys_for(*reg_, r->claim.recv->pin.get(), &st);
    if (keys) lkey = keys->mrs[chans_[0]->rail]->lkey;
  } else {
    r->stash_mr = v_.reg_mr(d.pd(), r->claim.dest, n, IBV_ACCESS_LOCAL_WRITE);
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
    w.sges[0] = {reinterpret_cast<uintptr_t>(r->claim.dest + off), static_cast<uint32_t>(k), lkey};
    w.nsge = 1;
    w.wr.opcode = IBV_WR_RDMA_READ;
    w.wr.wr.rdma.remote_addr = m.addr + off;
    w.wr.wr.rdma.rkey = m.rkey;
    w.token = 0;
    wrs.push_back(w);
  }
  wrs.back().signal = true;
  wrs.back().kind = CtxKind::kRdvRead;
  wrs.back().token = id;
  st = post(0, wrs);
  if (!st.ok()) fail(st, true);
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
  // FIN first: the receiver's application may close the endpoint as soon as its recv
  // completes, and the sender must still learn that its message arrived.
  CtrlMsg fin{};
  fin.type = kFin;
  fin.seq = r.claim.seq;
  fin.status = static_cast<uint32_t>(MessageMatcher::sender_status(r.claim, transfer).code);
  post_ctrl(fin);
  events_->matcher().deliver(r.claim, transfer);
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
  if (slot >= static_cast<uint32_t>(kRecvSlots)) {
    fail({ErrorCode::kInternal, "rdma: receive completion for an unknown slot"}, true);
    return;
  }
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    post_recv_slot(slot);
    events_->matcher().push_imm(ntohl(wc.imm_data));
    if (++imm_to_return_ >= credit_batch_) {  // the slots are back: credit the sender
      CtrlMsg c{};
      c.type = kCredit;
      c.seq = imm_to_return_;
      imm_to_return_ = 0;
      post_ctrl(c);
    }
    return;
  }
  CtrlMsg m;
  std::memcpy(&m, ctrl_mem_.data() + size_t(slot) * kSlotBytes, sizeof m);
  post_recv_slot(slot);
  if (wc.byte_len != sizeof(CtrlMsg)) {
    fail({ErrorCode::kProtocol, "rdma: malformed control message"}, true);
    return;
  }
  if (m.type == kRts) {
    on_rts(m);
  } else if (m.type == kFin) {
    on_fin(m);
  } else if (m.type == kGone) {
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
  } else if (m.type == kCredit) {
    bool bad;
    {
      std::lock_guard<std::mutex> lk(imm_mu_);
      bad = m.seq == 0 || m.seq > static_cast<uint64_t>(imm_credits_max_ - imm_credits_);
      if (!bad) imm_credits_ += static_cast<int64_t>(m.seq);
    }
    if (bad) {
      fail({ErrorCode::kProtocol, "rdma: peer returned more imm credit than it gave"}, true);
      return;
    }
    release_imms();
  } else if (m.type == kMove) {
    on_move(m);
  } else if (m.type == kGoneAck) {
    std::lock_guard<std::mutex> lk(gone_mu_);
    gone_acked_ = std::max<uint64_t>(gone_acked_, m.addr);
    gone_cv_.notify_all();
  } else {
    fail({ErrorCode::kProtocol, "rdma: unknown control message " + std::to_string(m.type)}, true);
  }
}

// A local region is being unregistered: tell the peer and wait (bounded) for its ack, so that
// it refuses the region from now on instead of hitting the deregistered MR.
void RdmaEndpoint::region_gone(uint64_t id) {
  if (failed() || !ready_.load()) return;
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
  gone_cv_.wait_for(lk, std::chrono::milliseconds(1000), [&] { return gone_acked_ >= nonce || failed(); });
}

}  // namespace sluice::detail::rdma
