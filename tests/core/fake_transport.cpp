#include "fake_transport.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "transport/common/pending_ops.hpp"

namespace sluice::detail::fake {

class FakeEndpoint final : public TransportEndpoint {
 public:
  explicit FakeEndpoint(const EndpointSetup& s)
      : active_(s.active), token_(s.token), nchan_(s.channels), events_(s.events) {}
  ~FakeEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  // The handshake is real (the engine's listener answers); the channels carry nothing, so
  // their sockets are dropped once the engine has answered on them.
  void connect(const ChannelOpener& open) override {
    for (int i = 0; i < nchan_; ++i) open(i, nlohmann::json::object());
  }
  nlohmann::json attach(int index, const nlohmann::json&) override {
    std::lock_guard<std::mutex> lk(attach_mu_);
    if (claimed_.count(index)) throw Error(ErrorCode::kProtocol, "channel " + std::to_string(index) + " attached twice");
    claimed_[index] = true;
    return nlohmann::json::object();
  }
  bool adopt(int, net::Socket) override {
    std::lock_guard<std::mutex> lk(attach_mu_);
    return ++attached_ == nchan_;
  }

  void submit(std::shared_ptr<TransferOp> op) override {
    auto keep = op;
    uint64_t token = pending_.add(std::move(op));
    if (!token) return;  // already failed: add() completed it
    uint32_t nlanes = 0;
    for (auto& l : keep->lanes) nlanes += l.pieces.empty() ? 0 : 1;
    for (size_t c = 0; c < keep->lanes.size(); ++c)
      if (!keep->lanes[c].pieces.empty()) FakeNet::get().push({self_, false, token, c, nlanes});
  }

  void send(std::shared_ptr<MessageOp> op) override {
    uint64_t seq = op->seq;
    if (!pending_.add_send(std::move(op))) return;
    FakeNet::get().push({self_, true, seq, 0, 1});
  }

  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }
  // Per-operation deadlines, as the socket transports keep them (PendingOps::expire): an op
  // the test holds sees no progress. Counted, not failed, as tcp does: the core then fails
  // the endpoint and closes us, and close() fails the ops with kTimeout, so by the time a
  // test sees the op's future complete the endpoint is already marked lost.
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override {
    return pending_.expire(now, timeout, what, /*fail=*/false);
  }

  void close(const Status& why) override { stop(why, /*notify=*/false); }

  // The transport lost its peer (notify): tell the core, then fail everything. The core is
  // told first (tcp does it the other way round) so that a test that sees an op fail also
  // sees the endpoint marked lost, without polling.
  void stop(const Status& why, bool notify) {
    {
      std::lock_guard<std::mutex> lk(FakeNet::get().serve_mu());
      if (closed_) return;
      closed_ = true;
    }
    FakeNet::get().drop_from(this);
    FakeNet::get().unlink(token_, this);
    if (notify) events_->on_failure(why);
    pending_.fail_all(why);
  }

  void set_self(std::weak_ptr<FakeEndpoint> self) { self_ = std::move(self); }
  bool active() const { return active_; }
  uint64_t token() const { return token_; }
  PendingOps& ops() { return pending_; }
  bool closed() const { return closed_; }  // under serve_mu

  // Target side of one lane of `op` from the peer; caller holds serve_mu and checked that
  // this endpoint is open (so events_ is alive). Every piece is pinned in our engine's
  // registry with its bounds, exactly as tcp's serve_write / serve_read: a piece outside a
  // registered region is refused and nothing of it is copied. *imm_ready: deliver op.imm now.
  Status serve(const TransferOp& op, size_t lane, uint32_t nlanes, uint64_t op_token, bool* imm_ready) {
    Status st;
    for (const Piece& p : op.lanes[lane].pieces) {
      RegionPin pin = events_->registry().pin(p.remote_id, p.remote_offset, p.length, &st, "target");
      if (!st.ok()) break;
      uint8_t* remote = pin.get()->base + p.remote_offset;
      if (op.kind == OpKind::kRead)
        std::memcpy(p.local, remote, p.length);
      else
        std::memcpy(remote, p.local, p.length);
    }
    if (op.kind == OpKind::kWriteImm) {
      // The imm goes up once every lane of the batch landed, and only if none failed.
      auto& s = imm_[op_token];
      s.first++;
      s.second |= !st.ok();
      if (s.first >= nlanes) {
        *imm_ready = !s.second;
        imm_.erase(op_token);
      }
    }
    return st;
  }
  Status serve_send(MessageOp& op) {
    auto claim = events_->matcher().claim(op.seq, op.length);
    Status st = claim.error;
    if (st.ok() && claim.dest) std::memcpy(claim.dest, op.ptr, std::min(op.length, claim.capacity));
    return events_->matcher().deliver(claim, st);
  }
  void push_imm(uint32_t imm) { events_->matcher().push_imm(imm); }

 private:
  const bool active_;
  const uint64_t token_;
  const int nchan_;
  EndpointEvents* events_;
  std::weak_ptr<FakeEndpoint> self_;
  PendingOps pending_;
  std::mutex attach_mu_;
  std::map<int, bool> claimed_;
  int attached_ = 0;
  bool closed_ = false;  // under serve_mu
  std::map<uint64_t, std::pair<uint32_t, bool>> imm_;  // under serve_mu: lanes seen, failed
};

FakeNet& FakeNet::get() {
  static FakeNet net;
  return net;
}

size_t FakeNet::queued() const {
  std::lock_guard<std::mutex> lk(mu_);
  return items_.size();
}

bool FakeNet::wait_queued(size_t n, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, timeout, [&] { return items_.size() >= n; });
}

void FakeNet::push(Item it) {
  std::lock_guard<std::mutex> lk(mu_);
  items_.push_back(std::move(it));
  cv_.notify_all();
}

Item FakeNet::take(size_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  if (i >= items_.size()) throw std::out_of_range("fake: no queued item " + std::to_string(i));
  Item it = items_[i];
  items_.erase(items_.begin() + static_cast<long>(i));
  return it;
}

void FakeNet::drop_from(const FakeEndpoint* ep) {
  std::lock_guard<std::mutex> lk(mu_);
  std::erase_if(items_, [&](const Item& it) {
    auto p = it.from.lock();
    return !p || p.get() == ep;
  });
}

void FakeNet::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  items_.clear();
}

void FakeNet::link(uint64_t token, bool active, std::weak_ptr<FakeEndpoint> ep) {
  std::lock_guard<std::mutex> lk(mu_);
  (active ? pairs_[token].active : pairs_[token].passive) = std::move(ep);
}

void FakeNet::unlink(uint64_t token, const FakeEndpoint* ep) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pairs_.find(token);
  if (it == pairs_.end()) return;
  for (auto* w : {&it->second.active, &it->second.passive}) {
    auto p = w->lock();
    if (!p || p.get() == ep) w->reset();
  }
  if (it->second.active.expired() && it->second.passive.expired()) pairs_.erase(it);
}

std::shared_ptr<FakeEndpoint> FakeNet::peer_of(uint64_t token, bool active) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = pairs_.find(token);
  if (it == pairs_.end()) return nullptr;
  return (active ? it->second.passive : it->second.active).lock();
}

Status FakeNet::deliver(size_t i) {
  Item it = take(i);
  auto from = it.from.lock();
  if (!from) return {ErrorCode::kCancelled, "fake: the submitting endpoint is gone"};
  Status st;
  bool imm_ready = false;
  uint32_t imm = 0;
  std::shared_ptr<FakeEndpoint> to;
  if (it.is_send) {
    std::shared_ptr<MessageOp> op;
    {
      std::lock_guard<std::mutex> lk(serve_mu_);
      if (from->closed()) return {ErrorCode::kCancelled, "fake: endpoint closed"};
      op = from->ops().take_send(it.token);
      if (!op) return {ErrorCode::kCancelled, "fake: message already completed"};
      to = peer_of(from->token(), from->active());
      st = to && !to->closed() ? to->serve_send(*op) : Status{ErrorCode::kPeerLost, "fake: no peer endpoint"};
    }
    op->future->complete(st);
    return st;
  }
  {
    std::lock_guard<std::mutex> lk(serve_mu_);
    if (from->closed()) return {ErrorCode::kCancelled, "fake: endpoint closed"};
    auto op = from->ops().find(it.token);
    if (!op) return {ErrorCode::kCancelled, "fake: operation already completed"};
    to = peer_of(from->token(), from->active());
    if (to && !to->closed())
      st = to->serve(*op, it.lane, it.nlanes, it.token, &imm_ready);
    else
      st = {ErrorCode::kPeerLost, "fake: no peer endpoint"};
    imm = op->imm;
    // The imm reaches the target before the initiator's future completes, as with tcp
    // (the ack follows the landed data).
    if (imm_ready) to->push_imm(imm);
  }
  // Completion outside serve_mu: a callback may close the endpoint.
  from->ops().lane_done(it.token, st);
  return st;
}

void FakeNet::fail(size_t i, const Status& st) {
  Item it = take(i);
  auto from = it.from.lock();
  if (!from) return;
  if (it.is_send) {
    if (auto op = from->ops().take_send(it.token)) op->future->complete(st);
    return;
  }
  from->ops().lane_done(it.token, st);
}

void FakeNet::progress(size_t i) {
  std::weak_ptr<FakeEndpoint> w;
  Item it;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= items_.size()) throw std::out_of_range("fake: no queued item " + std::to_string(i));
    it = items_[i];
  }
  if (auto from = it.from.lock()) it.is_send ? from->ops().progress_send(it.token) : from->ops().progress(it.token);
}

void FakeNet::tamper(size_t i, const std::function<void(Piece&)>& edit) {
  Item it;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= items_.size()) throw std::out_of_range("fake: no queued item " + std::to_string(i));
    it = items_[i];
  }
  auto from = it.from.lock();
  if (!from || it.is_send) return;
  std::lock_guard<std::mutex> lk(serve_mu_);
  if (auto op = from->ops().find(it.token))
    for (Piece& p : op->lanes[it.lane].pieces) edit(p);
}

void FakeNet::lose(size_t i, const Status& why) {
  Item it;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (i >= items_.size()) throw std::out_of_range("fake: no queued item " + std::to_string(i));
    it = items_[i];
  }
  if (auto from = it.from.lock()) from->stop(why, /*notify=*/true);
}

namespace {

class FakeTransport final : public Transport {
 public:
  std::string name() const override { return "fake"; }
  int priority() const override { return 0; }
  bool supports(const Location& loc) const override { return loc.is_host(); }
  // In-process memcpy: host memory and imm, no stream order, no signals.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.imm = true;
    return c;
  }
  nlohmann::json local_address() const override { return nlohmann::json::object(); }
  bool can_reach(const EngineInfo&, std::string*) override { return true; }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto ep = std::make_shared<FakeEndpoint>(setup);
    ep->set_self(ep);
    FakeNet::get().link(setup.token, setup.active, ep);
    return ep;
  }
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(fake, "fake", [](const EngineContext&, std::string*) -> std::unique_ptr<Transport> {
  return std::make_unique<FakeTransport>();
});

}  // namespace sluice::detail::fake
