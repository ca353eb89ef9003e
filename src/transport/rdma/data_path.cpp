// rdma endpoint: READ / WRITE / WRITE_WITH_IMM work requests, posting with back-pressure,
// send completions and imm ordering (see endpoint.hpp).
#include <arpa/inet.h>

#include "core/log.hpp"
#include "transport/rdma/endpoint.hpp"

namespace sluice::detail::rdma {

using nlohmann::json;

namespace {

// Link n work requests starting at `first` (vector or deque iterator; elements stay put) into
// one chain, assign signalling and completion contexts, and post it.
template <class It>
Status post_range(Chan& ch, int c, It first, size_t n) {
  It it = first;
  for (size_t i = 0; i < n; ++i, ++it) {
    Wr& w = *it;
    ch.free--;
    const bool sig = w.signal || ch.unsig + 1 >= kSignalEvery || ch.free == 0;
    if (sig) {
      ch.ring[ch.tail % ch.ring.size()] = {w.kind, ch.unsig + 1, w.token, w.aux, w.post_mark};
      ch.posts_signalled = std::max(ch.posts_signalled, w.post_mark);
      w.wr.wr_id = kTagCtx | (uint64_t(c) << 40) | (ch.tail & kSeqMask);
      ch.tail++;
      ch.unsig = 0;
      w.wr.send_flags |= IBV_SEND_SIGNALED;
    } else {
      ch.unsig++;
      w.wr.wr_id = kTagUnsig | w.token;
    }
    w.wr.sg_list = w.nsge ? w.sges.data() : nullptr;
    w.wr.num_sge = w.nsge;
    w.wr.next = nullptr;
    if (i + 1 < n) {
      It next = it;
      ++next;
      w.wr.next = &next->wr;
    }
  }
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(ch.qp, &first->wr, &bad))
    return {ErrorCode::kSystem, "rdma: ibv_post_send on QP " + std::to_string(ch.qp->qp_num) + ": " + std::strerror(rc)};
  return Status::Ok();
}

}  // namespace

Status RdmaEndpoint::drain(Chan& ch, int c) {
  if (failed()) {
    ch.backlog.clear();
    return Status::Ok();
  }
  while (!ch.backlog.empty() && ch.free > 0) {
    size_t n = std::min<size_t>(ch.backlog.size(), ch.free);
    Status st = post_range(ch, c, ch.backlog.begin(), n);
    ch.backlog.erase(ch.backlog.begin(), ch.backlog.begin() + static_cast<std::ptrdiff_t>(n));
    if (!st.ok()) {
      ch.backlog.clear();
      return st;
    }
  }
  return Status::Ok();
}

// Queue WRs on channel c and post what fits. A failure is returned, not acted on: callers may
// hold locks that completion callbacks (run by fail()) could need.
Status RdmaEndpoint::post(int c, Wr* wrs, size_t n) {
  Chan& ch = *chans_[c];
  std::lock_guard<std::mutex> lk(ch.mu);
  return post_locked(ch, c, wrs, n);
}

bool RdmaEndpoint::post_gen_locked(Chan& ch, int c, uint32_t gen, Wr* wrs, size_t n, Status* st) {
  if (ch.broken || ch.gen != gen) return false;
  *st = post_locked(ch, c, wrs, n);
  return true;
}

Status RdmaEndpoint::post_locked(Chan& ch, int c, Wr* wrs, size_t n) {
  if (failed()) return Status::Ok();  // fail() completed (or will complete) the op
  // Number the thin path's posts in queue order (the backlog keeps it): a WR's completion
  // retires every post queued up to it (post_path.cpp).
  for (size_t i = 0; i < n; ++i) {
    if (wrs[i].post) ++ch.posts_queued;
    wrs[i].post_mark = ch.posts_queued;
    if (wrs[i].signal) ch.posts_signalled = ch.posts_queued;
  }
  if (ch.backlog.empty() && ch.free >= static_cast<int>(n)) return post_range(ch, c, wrs, n);
  for (size_t i = 0; i < n; ++i) ch.backlog.push_back(std::move(wrs[i]));
  return drain(ch, c);
}

// Keys come from the peer's info: the hello reply, then every refresh the core delivers
// through peer_updated(). A region the peer registered since then is unknown here until the
// application refreshes; nothing on this (the submitting) thread goes to the network.
bool RdmaEndpoint::rkey_for(uint64_t remote_id, int peer_rail, uint32_t* rkey) {
  std::lock_guard<std::mutex> lk(rkey_mu_);
  auto it = rkeys_.find(remote_id);
  if (it == rkeys_.end() || peer_rail >= static_cast<int>(it->second.size())) return false;
  *rkey = it->second[peer_rail];
  return true;
}

const std::vector<int>& RdmaEndpoint::chans_near(uint32_t mask) {
  if (rails_->size() == 1) return all_chans_;
  std::lock_guard<std::mutex> lk(near_mu_);
  auto it = near_.find(mask);
  if (it != near_.end()) return it->second;
  std::vector<int> v;
  for (int c = 0; c < nchan_; ++c)
    if (mask >> chans_[c]->home_rail & 1) v.push_back(c);  // fixed at connect (failover moves rail)
  if (v.empty()) v = all_chans_;  // no channel on a near rail (fewer channels than rails)
  return near_.emplace(mask, std::move(v)).first->second;
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
  const uint64_t token = pending_.add(std::move(op));
  if (!token) return;
  wake_for_submit();
  const bool imm = keep->kind == OpKind::kWriteImm;
  InlineVec<int, 2> lanes;  // per-op containers stay off the heap for one- and two-lane batches
  for (size_t l = 0; l < keep->lanes.size(); ++l)
    if (!keep->lanes[l].pieces.empty()) lanes.push_back(static_cast<int>(l));
  // Lanes go to the channels on the rails nearest to the batch's (first) local region.
  Status st;
  const RegionKeys* first_keys = rails_->keys_for(*reg_, keep->pins.front().get(), &st);
  if (!first_keys) {
    fail_op(token, st);
    return;
  }
  const std::vector<int>& near = chans_near(first_keys->near);
  InlineVec<int, 2> chan(lanes.size());
  for (size_t li = 0; li < lanes.size(); ++li) chan[li] = near[(lanes[li]) % near.size()];
  // A single-lane imm batch chains its imm behind its data on QP 0 (RC ordering) when QP 0 is
  // near enough; otherwise the imm follows the data's completion.
  const bool chain_imm = imm && lanes.size() == 1 && std::find(near.begin(), near.end(), 0) != near.end();
  if (imm) {
    std::unique_lock<std::mutex> lk(imm_mu_);
    if (chain_imm && imm_order_.empty() && imm_credits_ > 0) {
      imm_credits_--;
      // Under imm_mu_: imms reach QP 0 in submission order. QP 0 is never replaced.
      Status op_err;
      (void)post_lane(keep, token, lanes[0], 0, /*chain_imm=*/true, &op_err);
      lk.unlock();
      if (!op_err.ok()) fail_op(token, op_err);
      return;
    }
    const auto n = static_cast<uint32_t>(lanes.size());
    imm_batches_[token] = {keep->imm, n, n};
    imm_order_.push_back(token);
  }
  for (size_t li = 0; li < lanes.size(); ++li) place_lane(keep, token, lanes[li], chan[li], first_keys->near);
}

void RdmaEndpoint::place_lane(const std::shared_ptr<TransferOp>& op, uint64_t token, int lane, int c,
                              uint32_t near_mask) {
  // A channel that broke (or is being moved home) takes no new lanes: the next usable one,
  // near ones first, QP 0 last (it is never replaced, so the loop ends there).
  auto usable = [&](int k) { return chans_[k]->usable.load(std::memory_order_acquire); };
  for (int attempt = 0; attempt <= nchan_ + 1; ++attempt) {
    if (c < 0 || attempt > 0 || (unusable_.load(std::memory_order_acquire) > 0 && !usable(c))) {
      const std::vector<int>& near = chans_near(near_mask);
      int pick = -1;
      for (size_t i = 0; i < near.size() && pick < 0; ++i)
        if (usable(near[(lane + i) % near.size()])) pick = near[(lane + i) % near.size()];
      for (int i = 0; i < nchan_ && pick < 0; ++i)
        if (usable((lane + i) % nchan_)) pick = (lane + i) % nchan_;
      c = pick < 0 || attempt == nchan_ + 1 ? 0 : pick;
    }
    Status op_err;
    if (post_lane(op, token, lane, c, false, &op_err)) {
      if (!op_err.ok()) fail_op(token, op_err);
      return;
    }
  }
}

bool RdmaEndpoint::post_lane(const std::shared_ptr<TransferOp>& op, uint64_t token, int lane, int c, bool chain_imm,
                             Status* op_err) {
  Status ignored;
  if (!op_err) op_err = &ignored;
  Chan& ch = *chans_[c];
  int rail, peer_rail;
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    if (ch.broken) return false;
    rail = ch.rail;
    peer_rail = ch.peer_rail;
    gen = ch.gen;
  }
  const bool is_read = op->kind == OpKind::kRead;
  const bool imm = op->kind == OpKind::kWriteImm;
  // Resolve every key first so that a failure transfers nothing.
  InlineVec<Wr, 1> wrs;
  Status st;
  const RegionEntry* last_region = nullptr;
  const RegionKeys* keys = nullptr;
  // A WR carries at most the devices' message size, and never more than the planner's chunk
  // (a completion per chunk keeps progress visible to the op timeout on slow links).
  const uint64_t merge_limit = std::min<uint64_t>(max_wr_bytes_, std::max<uint64_t>(setup_.config.chunk_size, 1));
  uint64_t open_bytes = 0, open_end = 0;  // the last WR's size and remote end
  for (const Piece& p : op->lanes[lane].pieces) {
    if (!last_region || p.local < last_region->base || p.local + p.length > last_region->base + last_region->length) {
      last_region = nullptr;
      for (auto& pin : op->pins) {
        const RegionEntry* e = pin.get();
        if (p.local >= e->base && p.local + p.length <= e->base + e->length) {
          last_region = e;
          break;
        }
      }
      keys = last_region ? rails_->keys_for(*reg_, last_region, &st) : nullptr;
      if (!last_region) st = {ErrorCode::kInternal, "rdma: piece outside its pinned regions"};
    }
    uint32_t rkey = 0;
    if (keys && !rkey_for(p.remote_id, peer_rail, &rkey))
      st = {ErrorCode::kUnknownHandle, "rdma: peer " + setup_.peer.engine_id + " unregistered region " +
                                           std::to_string(p.remote_id) + " (or advertised no memory key for it)"};
    if (!keys || !st.ok()) {
      *op_err = st;
      return true;
    }
    const uint32_t lkey = keys->mrs[rail]->lkey;
    if (fault_rkey_xor_ != 0) [[unlikely]]  // test-only fault injection, 0 in production
      rkey ^= fault_rkey_xor_;
    // Pieces that continue the previous one on the remote side join its WR, as one more
    // gather entry (or by growing the last entry when they continue it locally too), up to
    // the devices' max_sge and merge_limit bytes; the rest start a new WR.
    for (uint64_t off = 0; off < p.length;) {
      const uintptr_t addr = reinterpret_cast<uintptr_t>(p.local + off);
      if (!wrs.empty()) {
        Wr& w = wrs.back();
        ibv_sge& last = w.sges[w.nsge - 1];
        const uint64_t room = merge_limit - open_bytes;
        if (room > 0 && w.wr.wr.rdma.rkey == rkey && open_end == p.remote_addr + off) {
          const uint64_t n = std::min(room, p.length - off);
          const bool grows = last.lkey == lkey && last.addr + last.length == addr;
          if (grows || w.nsge < (is_read ? max_sge_rd_ : max_sge_)) {
            if (grows)
              last.length += static_cast<uint32_t>(n);
            else
              w.sges[w.nsge++] = {addr, static_cast<uint32_t>(n), lkey};
            open_bytes += n;
            open_end += n;
            off += n;
            continue;
          }
        }
      }
      const uint64_t n = std::min(merge_limit, p.length - off);
      Wr w;
      w.sges[0] = {addr, static_cast<uint32_t>(n), lkey};
      w.nsge = 1;
      w.wr.opcode = is_read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      w.wr.wr.rdma.remote_addr = p.remote_addr + off;
      w.wr.wr.rdma.rkey = rkey;
      w.token = token;
      wrs.push_back(w);
      open_bytes = n;
      open_end = p.remote_addr + off + n;
      off += n;
    }
  }
  // Inline data is copied by the CPU inside ibv_post_send: host memory only (a device
  // pointer of cuda memory is not readable there).
  bool host_src = true;
  for (auto& pin : op->pins) host_src = host_src && pin.get()->location.is_host();
  if (!is_read && host_src)
    for (Wr& w : wrs) {
      uint64_t bytes = 0;
      for (int i = 0; i < w.nsge; ++i) bytes += w.sges[i].length;
      if (bytes <= max_inline_) w.wr.send_flags |= IBV_SEND_INLINE;
    }
  Wr& last = wrs.back();
  last.signal = true;
  last.kind = imm ? CtxKind::kImmLaneEnd : CtxKind::kLaneEnd;
  last.aux = static_cast<uint32_t>(lane);  // failover: which lane to send again
  if (chain_imm) {
    last.wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last.wr.imm_data = htonl(op->imm);
    last.kind = CtxKind::kImmChainEnd;
  }
  bool posted;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    posted = post_gen_locked(ch, c, gen, wrs.data(), wrs.size(), &st);
  }
  if (!st.ok()) {
    fail(st, true);
    return true;
  }
  if (posted && c == test_break_chan_ && test_lanes_.fetch_add(1) + 1 == test_break_after_) [[unlikely]] {
    // rdma.test_break_qp: the queue pair fails as a broken link would make it (its work
    // requests complete with flush errors); the failover path must find out by itself.
    std::lock_guard<std::mutex> lk(ch.mu);
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    if (ch.qp) v_.modify_qp(ch.qp, &at, IBV_QP_STATE);
    SLUICE_LOG(kInfo, "rdma: test fault: channel " << c << "'s queue pair moved to the error state");
  }
  return posted;
}

// imm_mu_ held. Posts the zero-length WRITE_WITH_IMM that completes a two-step imm batch.
void RdmaEndpoint::post_imm(uint64_t token, uint32_t imm, uint32_t lanes) {
  imm_credits_--;
  std::vector<Wr> w(1);
  w[0].wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  w[0].wr.imm_data = htonl(imm);
  w[0].wr.wr.rdma.remote_addr = peer_scratch_addr_;
  w[0].wr.wr.rdma.rkey = peer_scratch_rkey_;
  w[0].signal = true;
  w[0].kind = CtxKind::kImmFinal;
  w[0].token = token;
  w[0].aux = lanes;
  Status st = post(0, w);
  if (!st.ok()) throw Error(st);
}

// Post the imms of the batches at the head of the submission order whose data is complete.
void RdmaEndpoint::release_imms() {
  Status failed;
  {
    std::lock_guard<std::mutex> lk(imm_mu_);
    while (!imm_order_.empty() && imm_credits_ > 0) {
      auto it = imm_batches_.find(imm_order_.front());
      if (it != imm_batches_.end() && it->second.left > 0) break;
      uint64_t token = imm_order_.front();
      imm_order_.pop_front();
      if (it == imm_batches_.end()) continue;  // failed meanwhile
      ImmBatch b = it->second;
      imm_batches_.erase(it);
      try {
        post_imm(token, b.imm, b.lanes);
      } catch (const Error& e) {
        failed = e.status();
        break;
      }
    }
  }
  if (!failed.ok()) fail(failed, true);
}

void RdmaEndpoint::handle_send_completion(const ibv_wc& wc, int rail) {
  const int c = static_cast<int>((wc.wr_id & ~kTagMask) >> 40);
  const uint64_t seq = wc.wr_id & kSeqMask;
  if (c < 0 || c >= nchan_) {
    fail({ErrorCode::kInternal, "rdma: completion for an unknown channel"}, true);
    return;
  }
  Chan& ch = *chans_[c];
  WrCtx ctx;
  Status st;
  bool broke = false;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    // A replaced (or broken) queue pair's late completion: its lanes were taken back.
    if (!ch.qp || ch.rail != rail || wc.qp_num != ch.qp->qp_num) return;
    if (wc.status != IBV_WC_SUCCESS && link_error(c, rail, wc)) {
      broke = true;
    } else if (ch.head == ch.tail || (ch.head & kSeqMask) != seq) {
      st = {ErrorCode::kInternal, "rdma: send completion out of order on QP " + std::to_string(ch.qp->qp_num)};
    } else {
      ctx = ch.ring[ch.head % ch.ring.size()];
      ch.head++;
      ch.free += ctx.slots;
      // Every WR up to this one completed, the thin path's posts among them.
      if (ctx.post_mark > ch.posts_retired)
        retire_posts(ch, ctx.post_mark, wc.status == IBV_WC_SUCCESS ? Status::Ok() : wc_status(v_, wc, "post"));
      st = drain(ch, c);
    }
  }
  if (broke) {  // the other channels carry on; this one is replaced (failover.cpp)
    break_channel(c, wc_status(v_, wc, "transfer"), true);
    return;
  }
  if (!st.ok()) {
    fail(st, true);
    return;
  }
  if (ctx.kind == CtxKind::kCtrl) {
    std::lock_guard<std::mutex> lk(ctrl_mu_);
    ctrl_free_.push_back(ctx.aux);
  }
  if (wc.status != IBV_WC_SUCCESS) {
    const char* what = ctx.kind == CtxKind::kCtrl ? "control send" : ctx.kind == CtxKind::kRdvRead ? "message read" : "transfer";
    Status err = wc_status(v_, wc, what);
    if (wc.status != IBV_WC_WR_FLUSH_ERR) {
      if (ctx.kind != CtxKind::kSlots && ctx.kind != CtxKind::kCtrl && ctx.kind != CtxKind::kRdvRead) fail_op(ctx.token, err);
      if (ctx.kind == CtxKind::kRdvRead) finish_rendezvous(ctx.token, err);
    }
    fail({err.code, "QP " + std::to_string(ch.qp ? ch.qp->qp_num : 0) + " in error state after: " + err.message}, true);
    return;
  }
  switch (ctx.kind) {
    case CtxKind::kSlots:
    case CtxKind::kCtrl: break;
    case CtxKind::kLaneEnd: pending_.lane_done(ctx.token, Status::Ok()); break;
    case CtxKind::kImmChainEnd: pending_.lane_done(ctx.token, Status::Ok()); break;
    case CtxKind::kImmLaneEnd: {
      bool head = false;
      {
        std::lock_guard<std::mutex> lk(imm_mu_);
        auto it = imm_batches_.find(ctx.token);
        if (it != imm_batches_.end() && it->second.left > 0 && --it->second.left == 0)
          head = !imm_order_.empty() && imm_order_.front() == ctx.token;
      }
      if (head) release_imms();
      break;
    }
    case CtxKind::kImmFinal:
      for (uint32_t i = 0; i < ctx.aux; ++i) pending_.lane_done(ctx.token, Status::Ok());
      break;
    case CtxKind::kRdvRead: finish_rendezvous(ctx.token, Status::Ok()); break;
  }
}

}  // namespace sluice::detail::rdma
