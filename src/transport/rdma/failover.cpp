// rdma endpoint: queue-pair failover (see endpoint.hpp and docs/cluster.md).
//
// A channel other than QP 0 whose queue pair breaks (a link error completion: retry or RNR
// retry exceeded, or a flush the endpoint did not ask for), or whose rail's port goes down
// (Rails' monitor), stops taking lanes at once; the lanes it had in flight are sent again on
// the other channels (reads and writes, rdma.retry_rma) or failed, and a replacement queue
// pair is dialed through the peer's listener, like tcp's replacement channels: only the
// dialing side dials (the accepting side asks it with a MOVE message on QP 0), one generation
// number per channel keeps both sides on the same queue pair. When a rail comes back, the
// channels that belong there drain and move home the same way.
//
// QP 0 is not replaced: it carries the control messages, the imm credits and ordering, and
// the thin post path, whose state a new queue pair could not take over without a protocol of
// its own. Its breaking fails the endpoint (kPeerLost); the core's reconnection then builds a
// new one on the rails that are up.
#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdint>
#include <thread>
#include <utility>

#include "core/log.hpp"
#include "core/params.hpp"
#include "transport/rdma/endpoint.hpp"

namespace sluice::detail::rdma {

using nlohmann::json;

namespace {

const Param<bool> kFailover{"rdma.failover", "SLUICE_RDMA_FAILOVER", true, boolean(),
                            "a queue pair other than QP 0 that breaks (link error, its rail's port down) is "
                            "replaced while the others carry the traffic; off: it fails the endpoint"};
const Param<bool> kRetryRma{"rdma.retry_rma", "SLUICE_RDMA_RETRY_RMA", true, boolean(),
                            "reads and writes caught on a broken queue pair are sent again on another (writes "
                            "with imm too: their imm is sent only after the data); off: they fail with kPeerLost"};
// "c:n": after the n-th lane posted on channel c, that queue pair goes to the error state (as a
// broken link leaves it), once per endpoint we dialed.
const Param<std::string> kTestBreakQp{"rdma.test_break_qp", "SLUICE_RDMA_TEST_BREAK_QP", "",
                                      [](const std::string& where, const std::string& text) {
                                        if (text.empty()) return text;
                                        int c = -1;
                                        uint64_t n = 0;
                                        auto colon = text.find(':');
                                        auto [p1, e1] = std::from_chars(text.data(), text.data() + colon, c);
                                        auto [p2, e2] = colon == std::string::npos
                                                            ? std::from_chars_result{nullptr, std::errc::invalid_argument}
                                                            : std::from_chars(text.data() + colon + 1,
                                                                              text.data() + text.size(), n);
                                        if (e1 != std::errc() || e2 != std::errc() || c < 1 || n < 1 ||
                                            p2 != text.data() + text.size())
                                          param_error(where, text, "is not CHANNEL:LANES (channel >= 1, lanes >= 1)");
                                        return text;
                                      },
                                      "test only (fault injection): CHANNEL:N breaks that queue pair after its N-th "
                                      "lane, on endpoints this engine dialed",
                                      ParamScope::kTest};

const char* kind_name(OpKind k) {
  switch (k) {
    case OpKind::kRead: return "read";
    case OpKind::kWrite: return "write";
    case OpKind::kWriteImm: return "write_with_imm";
    default: return "operation";
  }
}

}  // namespace

void RdmaEndpoint::configure_failover() {
  failover_ = kFailover.get(setup_.config);
  retry_rma_ = kRetryRma.get(setup_.config);
  const std::string tb = kTestBreakQp.read();
  if (!tb.empty() && setup_.active) {
    test_break_chan_ = std::stoi(tb.substr(0, tb.find(':')));
    test_break_after_ = std::stoull(tb.substr(tb.find(':') + 1));
    if (test_break_chan_ >= nchan_) test_break_chan_ = -1;
  }
}

bool RdmaEndpoint::link_error(int c, int rail, const ibv_wc& wc) {
  if (!failover_ || c == 0 || failed()) return false;
  // What a lost path does to a queue pair (the peer's port or the wire, or ours: our port's
  // event may come after the first error), and a flush we did not ask for (the QP was moved to
  // the error state under us: a fatal async event, or the test fault).
  if (wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_RNR_RETRY_EXC_ERR || wc.status == IBV_WC_WR_FLUSH_ERR)
    return true;
  // A local error on a port that is not active is the port's doing (SoftRoCE fails the send
  // with it when its netdev goes down). The port may still read active for a moment then (the
  // send failed before the port went down), so one such error per op_timeout is taken as the
  // path's too; a second one on an active port is ours and fails the endpoint (a replacement
  // would only meet it again).
  if (wc.status != IBV_WC_LOC_QP_OP_ERR && wc.status != IBV_WC_GENERAL_ERR) return false;
  if (!rails_->port_active_now(rail)) return true;
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  auto last = local_error_at_.load();
  const auto window = std::chrono::duration_cast<std::chrono::steady_clock::duration>(setup_.config.op_timeout).count();
  return (last == 0 || now - last >= window) && local_error_at_.compare_exchange_strong(last, now);
}

int RdmaEndpoint::chan_of_qp(int rail, uint32_t qpn) {
  for (int c = 0; c < nchan_; ++c) {
    std::lock_guard<std::mutex> lk(chans_[c]->mu);
    if (chans_[c]->qp && chans_[c]->rail == rail && chans_[c]->qp->qp_num == qpn) return c;
  }
  return -1;
}

std::vector<LaneRef> RdmaEndpoint::take_back(int c, bool* first) {
  std::vector<LaneRef> lanes;
  Chan& ch = *chans_[c];
  std::lock_guard<std::mutex> lk(ch.mu);
  if (first) *first = !ch.broken;
  if (ch.usable.exchange(false)) unusable_.fetch_add(1);
  ch.broken = true;
  // Every lane with work requests in flight or queued here: its last WR carries its token and
  // lane (kLaneEnd / kImmLaneEnd); earlier ones of the same lane are sent again with it.
  for (uint64_t s = ch.head; s != ch.tail; ++s) {
    const WrCtx& x = ch.ring[s % ch.ring.size()];
    if (x.kind == CtxKind::kLaneEnd || x.kind == CtxKind::kImmLaneEnd) lanes.push_back({x.token, x.aux});
  }
  for (const Wr& w : ch.backlog)
    if (w.kind == CtxKind::kLaneEnd || w.kind == CtxKind::kImmLaneEnd) lanes.push_back({w.token, w.aux});
  ch.backlog.clear();
  ch.head = ch.tail;
  ch.free = sq_depth_;
  ch.unsig = 0;
  if (ch.qp) {
    // Stopped before anything is sent again: nothing it still had can land after the resend.
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    v_.modify_qp(ch.qp, &at, IBV_QP_STATE);
    if (ch.retired_qp) v_.destroy_qp(ch.retired_qp);
    ch.retired_qp = ch.qp;  // its late completions find no channel (chan_of_qp) and are dropped
    ch.qp = nullptr;
  }
  return lanes;
}

void RdmaEndpoint::break_channel(int c, const Status& why, bool tell_peer) {
  if (c == 0 || !failover_) {
    fail({why.code == ErrorCode::kOk ? ErrorCode::kPeerLost : why.code,
          "rdma: channel " + std::to_string(c) + " to " + setup_.peer.engine_id + " broke: " + why.message},
         true);
    return;
  }
  bool first = false;
  std::vector<LaneRef> lanes = take_back(c, &first);
  if (!first) return;  // another thread saw it break first (and took its lanes back)
  SLUICE_LOG(kWarn, "rdma: channel " << c << " to " << setup_.peer.engine_id << " broke (" << why.message << "); "
                                     << lanes.size() << " lane(s) in flight "
                                     << (retry_rma_ ? "sent again on the other channels" : "failed")
                                     << "; replacing its queue pair");
  resend(lanes, {why.code, "when channel " + std::to_string(c) + " broke: " + why.message});
  if (setup_.active)
    schedule_replacement(c, false);
  else if (tell_peer)
    ask_peer_to_move(c, true);
}

void RdmaEndpoint::resend(const std::vector<LaneRef>& lanes, const Status& why) {
  for (const LaneRef& l : lanes) {
    auto op = pending_.find(l.token);
    if (!op || l.lane >= op->lanes.size()) continue;  // finished or failed meanwhile
    if (!retry_rma_) {
      // Parts of it may have reached the peer: reported, never silently repeated.
      fail_op(l.token, {ErrorCode::kPeerLost, "rdma: " + std::string(kind_name(op->kind)) + " to " +
                                                  setup_.peer.engine_id + " was in flight " + why.message +
                                                  " (rdma.retry_rma is off, so it was not sent again; part of it "
                                                  "may have been done)"});
      continue;
    }
    // A read or write is sent again whole (its bytes are the same the second time); a
    // write_with_imm's imm is posted only once every data lane completed, so its data may be
    // sent again too and the imm still arrives once.
    retried_.fetch_add(1, std::memory_order_relaxed);
    Status st;
    const RegionKeys* keys = rails_->keys_for(*reg_, op->pins.front().get(), &st);
    place_lane(op, l.token, static_cast<int>(l.lane), -1, keys ? keys->near : 0);
  }
}

void RdmaEndpoint::schedule_replacement(int c, bool move_home) {
  {
    std::lock_guard<std::mutex> lk(chans_[c]->mu);
    if (chans_[c]->replacing) return;
    chans_[c]->replacing = true;
  }
  if (!redialer_ || !opener_) {
    fail({ErrorCode::kPeerLost, "rdma: channel " + std::to_string(c) + " to " + setup_.peer.engine_id +
                                    " broke and this endpoint cannot dial a replacement"},
         true);
    return;
  }
  std::weak_ptr<RdmaEndpoint> weak = weak_from_this();
  redialer_->post([weak, c, move_home] {
    if (auto self = weak.lock()) self->replace(c, move_home);
  });
}

// Redialer thread (dialing side): a new queue pair for channel c, on our rail for it that is
// up (its home first), through the peer's listener; retried every 100 ms until it is in, the
// endpoint closes, or op_timeout passed (then the endpoint fails naming the channel).
void RdmaEndpoint::replace(int c, bool move_home) {
  Chan& ch = *chans_[c];
  auto done = [&] {
    std::lock_guard<std::mutex> lk(ch.mu);
    ch.replacing = false;
  };
  if (move_home) {
    // Moving back home: take no new lanes, let the ones in flight finish (up to 1 s), then
    // retire the queue pair; whatever is still in flight then is sent again as after a break.
    bool was_broken;
    {
      std::lock_guard<std::mutex> lk(ch.mu);
      was_broken = ch.broken;
      if (!was_broken && ch.usable.exchange(false)) unusable_.fetch_add(1);
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (!was_broken && std::chrono::steady_clock::now() < until && !stop_.load() && !failed()) {
      {
        std::lock_guard<std::mutex> lk(ch.mu);
        if (ch.head == ch.tail && ch.backlog.empty()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (!was_broken) resend(take_back(c), {ErrorCode::kPeerLost, "when channel " + std::to_string(c) + " moved home"});
  }
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    gen = ch.gen + 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto give_up = t0 + setup_.config.op_timeout;
  std::string last;
  int align = -1;  // the peer answered from another rail than ours: ours follows, once
  bool again_now = false;
  while (!stop_.load() && !failed()) {
    std::unique_lock<std::recursive_mutex> rl(replace_mu_);
    if (stop_.load()) break;
    // Home if its port is active (asked of the device: a MOVE from the peer may come before our
    // own port event), else another rail that is up.
    const int rail = align >= 0                                                      ? align
                     : rails_->up(ch.home_rail) || rails_->port_active_now(ch.home_rail) ? ch.home_rail
                                                                                     : rails_->up_rail(ch.home_rail);
    if (rail < 0) {
      last = "every rail of this engine is down";
    } else {
      ibv_qp* qp = nullptr;
      try {
        qp = make_qp(c, rail);
        json h = qp_address(qp, rail).to_json();
        // The peer's rail of our rail's index (rail i talks to rail i; the peer picks another if
        // that one is down there).
        h["rail"] = rails_->size() == peer_rails() ? rail : c % peer_rails();
        h["src_rail"] = rail;
        h["gen"] = gen;
        auto [sock, reply] = opener_(c, {{"replace", true}, {"rdma", h}});
        if (!reply.contains("rdma") || !reply["rdma"].is_object())
          throw Error(ErrorCode::kProtocol, "rdma: replacement reply without queue pair address");
        const json& r = reply["rdma"];
        const QpAddress addr = QpAddress::from_json(r);
        const Negotiated n = negotiate_with(c, rail, addr);
        bring_up_qp(qp, rail, addr, n);
        const int peer_rail = r.value("src_rail", -1);
        if (peer_rail < 0 || peer_rail >= peer_rails())
          throw Error(ErrorCode::kProtocol, "rdma: replacement reply names no rail of the peer");
        if (peer_rail != rail && align < 0 && rails_->size() == peer_rails() &&
            (rails_->up(peer_rail) || rails_->port_active_now(peer_rail))) {
          // Its rail of our index is down there: two rails that differ may not reach each other
          // (two fabrics), so ours moves to the peer's instead, with the next generation (the
          // peer retires the pair it just made).
          align = peer_rail;
          gen++;
          again_now = true;
          throw Error(ErrorCode::kNoDevice, "the peer answered from rail " + std::to_string(peer_rail) +
                                                ": aligning ours to it");
        }
        {
          std::lock_guard<std::mutex> sk(sock_mu_);
          ch.retired_sock = std::move(ch.sock);  // the peer closes its end when it retires it
          ch.sock = std::move(sock);
          ch.sock_live = true;
        }
        install(c, qp, rail, peer_rail, gen);
        {
          std::lock_guard<std::mutex> lk(ch.mu);
          if (ch.usable.exchange(true) == false) unusable_.fetch_sub(1);
        }
        wake();  // the progress thread watches the new socket
        done();
        SLUICE_LOG(kInfo, "rdma: channel " << c << " to " << setup_.peer.engine_id << " "
                                           << (move_home ? "moved home" : "replaced") << " in "
                                           << std::chrono::duration_cast<std::chrono::milliseconds>(
                                                  std::chrono::steady_clock::now() - t0)
                                                  .count()
                                           << " ms: our rail " << rail << ", the peer's rail " << peer_rail
                                           << ", generation " << gen);
        return;
      } catch (const std::exception& e) {
        if (qp) v_.destroy_qp(qp);
        last = e.what();
        SLUICE_LOG(kDebug, "rdma: replacing channel " << c << " to " << setup_.peer.engine_id << ": " << last);
      }
    }
    rl.unlock();
    if (std::exchange(again_now, false)) continue;
    if (std::chrono::steady_clock::now() >= give_up) break;
    for (int i = 0; i < 10 && !stop_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  done();
  if (!stop_.load() && !failed())
    fail({ErrorCode::kPeerLost, "rdma: channel " + std::to_string(c) + " to " + setup_.peer.engine_id +
                                    " broke and was not replaced within op_timeout (" +
                                    std::to_string(setup_.config.op_timeout.count()) + " ms): " + last},
         true);
}

void RdmaEndpoint::install(int c, ibv_qp* qp, int rail, int peer_rail, uint32_t gen) {
  Chan& ch = *chans_[c];
  std::lock_guard<std::mutex> lk(ch.mu);
  if (ch.qp) {  // not taken back (the accepting side heard of the break first from this)
    ibv_qp_attr at{};
    at.qp_state = IBV_QPS_ERR;
    v_.modify_qp(ch.qp, &at, IBV_QP_STATE);
    if (ch.retired_qp) v_.destroy_qp(ch.retired_qp);
    ch.retired_qp = ch.qp;
  }
  ch.qp = qp;
  ch.rail = rail;
  ch.peer_rail = peer_rail;
  ch.gen = gen;
  ch.broken = false;
  ch.free = sq_depth_;
  ch.unsig = 0;
  ch.replacing = false;  // a break from now on schedules a new replacement
  replaced_.fetch_add(1, std::memory_order_relaxed);
}

// Listener thread (accepting side): the dialer replaces channel `index` (attach_mu_ held).
json RdmaEndpoint::attach_replacement(int index, const json& h) {
  std::lock_guard<std::recursive_mutex> rl(replace_mu_);
  if (stop_.load()) throw Error(ErrorCode::kPeerLost, "rdma: channel replace: the endpoint is closing");
  if (!failover_) throw Error(ErrorCode::kUnsupported, "rdma: channel replace: rdma.failover is off here");
  if (setup_.active) throw Error(ErrorCode::kProtocol, "rdma: channel replace: this side dialed the endpoint");
  if (index == 0) throw Error(ErrorCode::kProtocol, "rdma: channel replace: channel 0 (control) is never replaced");
  if (attached_ < nchan_) throw Error(ErrorCode::kProtocol, "rdma: channel replace: not every channel is attached");
  if (failed() || closed_.load()) throw Error(ErrorCode::kPeerLost, "rdma: channel replace: the endpoint is closed");
  Chan& ch = *chans_[index];
  // Fields a peer sent: checked by type before use, a bad one refused by name.
  auto field = [&](const char* name) -> int64_t {
    if (!h.contains(name) || !h[name].is_number_integer() || h[name].get<int64_t>() < 0 ||
        h[name].get<int64_t>() > int64_t{UINT32_MAX})
      throw Error(ErrorCode::kProtocol, std::string("rdma: channel replace: field '") + name +
                                            "' must be an integer 0.." + std::to_string(UINT32_MAX));
    return h[name].get<int64_t>();
  };
  const uint64_t gen = static_cast<uint64_t>(field("gen"));
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    // A later generation; or this one again, when our reply to it never arrived (the queue
    // pair it installed has not been adopted: still unusable).
    if (gen < ch.gen || (gen == ch.gen && (ch.usable.load() || ch.gen == 0)))
      throw Error(ErrorCode::kProtocol, "rdma: channel replace: generation " + std::to_string(gen) +
                                            " is not after channel " + std::to_string(index) + "'s " +
                                            std::to_string(ch.gen));
  }
  const int64_t peer_rail = field("src_rail");
  if (peer_rail >= peer_rails())
    throw Error(ErrorCode::kProtocol, "rdma: channel replace: field 'src_rail' names no rail of the peer (it has " +
                                          std::to_string(peer_rails()) + ")");
  int rail = static_cast<int>(std::min<int64_t>(field("rail"), INT32_MAX));
  if (rail >= rails_->size()) rail = ch.home_rail;
  // The rail asked for, if its port is active now (the dialer may have heard that it is back
  // before our monitor did: two rails that differ may not reach each other); else another.
  if (!rails_->up(rail) && !rails_->port_active_now(rail)) rail = rails_->up_rail(rail);
  if (rail < 0) throw Error(ErrorCode::kNoDevice, "rdma: channel replace: every rail of this engine is down");
  const QpAddress addr = QpAddress::from_json(h);
  const Negotiated n = negotiate_with(index, rail, addr);
  // Our end of the old queue pair stops now; what it had in flight goes to the other channels.
  bool was_broken;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    was_broken = ch.broken;
  }
  if (!was_broken)
    resend(take_back(index), {ErrorCode::kPeerLost, "when the peer replaced channel " + std::to_string(index)});
  ibv_qp* qp = make_qp(index, rail);
  try {
    bring_up_qp(qp, rail, addr, n);
  } catch (...) {
    v_.destroy_qp(qp);
    throw;
  }
  install(index, qp, rail, static_cast<int>(peer_rail), static_cast<uint32_t>(gen));  // usable once adopted
  json j = qp_address(qp, rail).to_json();
  j["rail"] = peer_rail;
  j["src_rail"] = rail;
  j["gen"] = gen;
  return {{"rdma", j}};
}

void RdmaEndpoint::adopt_replacement(int index, net::Socket sock) {
  Chan& ch = *chans_[index];
  {
    std::lock_guard<std::mutex> sk(sock_mu_);
    ch.retired_sock = std::move(ch.sock);
    ch.sock = std::move(sock);
    ch.sock_live = true;
  }
  int rail, peer_rail;
  uint32_t gen;
  {
    std::lock_guard<std::mutex> lk(ch.mu);
    if (!ch.broken && ch.qp && !ch.usable.exchange(true)) unusable_.fetch_sub(1);
    rail = ch.rail;
    peer_rail = ch.peer_rail;
    gen = ch.gen;
  }
  wake();
  SLUICE_LOG(kInfo, "rdma: channel " << index << " from " << setup_.peer.engine_id << " replaced: our rail " << rail
                                     << ", the peer's rail " << peer_rail << ", generation " << gen);
}

// Accepting side: only the dialer dials replacements.
void RdmaEndpoint::ask_peer_to_move(int c, bool broken) {
  CtrlMsg m{};
  m.type = kMove;
  m.seq = static_cast<uint64_t>(c);
  m.status = broken ? 1 : 0;
  {
    std::lock_guard<std::mutex> lk(chans_[c]->mu);
    m.addr = chans_[c]->gen;
  }
  post_ctrl(m);
}

// Progress thread (dialing side): the peer asks for channel m.seq to be replaced.
void RdmaEndpoint::on_move(const CtrlMsg& m) {
  if (!setup_.active || m.seq == 0 || m.seq >= static_cast<uint64_t>(nchan_) || m.status > 1) {
    fail({ErrorCode::kProtocol, "rdma: peer " + setup_.peer.engine_id + " sent a MOVE for channel " +
                                    std::to_string(m.seq) + " that it cannot ask for"},
         true);
    return;
  }
  if (!failover_) return;
  const int c = static_cast<int>(m.seq);
  {
    std::lock_guard<std::mutex> lk(chans_[c]->mu);
    if (m.addr != chans_[c]->gen) return;  // about a queue pair already replaced
  }
  if (m.status == 1)
    break_channel(c, {ErrorCode::kPeerLost, "the peer's end of it broke"}, false);
  else
    schedule_replacement(c, true);
}

// Rails' monitor thread.
void RdmaEndpoint::rail_changed(int rail, bool up) {
  if (!ready_.load() || failed() || !failover_) return;
  const Device& d = rails_->at(rail);
  const std::string name = "rail " + std::to_string(rail) + " (" + d.name() + " port " + std::to_string(d.port()) + ")";
  if (!up) {
    int qp0_rail;
    {
      std::lock_guard<std::mutex> lk(chans_[0]->mu);
      qp0_rail = chans_[0]->rail;
    }
    if (qp0_rail == rail) {
      fail({ErrorCode::kPeerLost, "rdma: " + name + " went down under channel 0 (control) of the endpoint to " +
                                      setup_.peer.engine_id + "; it reconnects on the rails that are up"},
           true);
      return;
    }
    for (int c = 1; c < nchan_; ++c) {
      bool on_it;
      {
        std::lock_guard<std::mutex> lk(chans_[c]->mu);
        on_it = !chans_[c]->broken && chans_[c]->rail == rail;
      }
      if (on_it) break_channel(c, {ErrorCode::kPeerLost, name + " went down"}, true);
    }
    return;
  }
  // Back up: the channels that belong on it and run elsewhere go home.
  for (int c = 1; c < nchan_; ++c) {
    bool away;
    {
      std::lock_guard<std::mutex> lk(chans_[c]->mu);
      away = !chans_[c]->broken && chans_[c]->home_rail == rail && chans_[c]->rail != rail;
    }
    if (!away) continue;
    if (setup_.active)
      schedule_replacement(c, true);
    else
      ask_peer_to_move(c, false);
  }
}

}  // namespace sluice::detail::rdma
