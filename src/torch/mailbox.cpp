#include "mailbox.hpp"

#include <array>
#include <cstring>

#include "core/log.hpp"
#include "sluice/error.hpp"

namespace sluice::torch_backend {

namespace {
constexpr uint32_t kHeaderSlots = 4096;

// Counts the two sends of one message (header, payload) and reports once both finished.
struct SendState {
  int remaining = 0;
  Status status;
  uint32_t slot = UINT32_MAX;
  std::unique_ptr<std::array<uint64_t, 6>> own_hdr;  // when every slot was taken (a Header)
  MemoryHandle own_hdr_handle;
  MemoryHandle payload;
  uint64_t n = 0;
  Mailbox::Done done;
};

// Collectives use the top half of the tag space (see SluiceBackend::enqueue): name the
// collective's sequence number there rather than a 19-digit tag.
std::string describe_tag(uint64_t tag) {
  return (tag >> 63) ? "collective #" + std::to_string((tag >> 16) & ((uint64_t(1) << 47) - 1))
                     : "tag " + std::to_string(tag);
}
}  // namespace

Mailbox::Mailbox(Engine& engine, std::vector<Endpoint> peers, std::vector<Endpoint> data, int rank,
                 std::chrono::milliseconds timeout, uint64_t rndv_bytes, uint64_t max_unexpected_bytes,
                 std::vector<Endpoint> dev, uint64_t inline_bytes, bool recv_ready, bool callers_run,
                 bool quiet_bookkeeping, Trace* trace, std::chrono::microseconds spin)
    : engine_(engine),
      trace_(trace),
      rank_(rank),
      timeout_(timeout),
      rndv_bytes_(rndv_bytes),
      max_unexpected_bytes_(max_unexpected_bytes),
      peers_(peers.size()),
      inline_bytes_(std::min(inline_bytes, kMaxInlineBytes)),
      recv_ready_(recv_ready),
      quiet_(quiet_bookkeeping) {
  for (size_t i = 0; i < peers.size(); ++i) {
    peers_[i].ep = std::move(peers[i]);
    if (i < data.size()) peers_[i].data = std::move(data[i]);
    if (i < dev.size()) peers_[i].dev = std::move(dev[i]);
  }
  send_hdrs_.resize(kHeaderSlots);
  send_hdrs_handle_ = reg(send_hdrs_.data(), send_hdrs_.size() * sizeof(Header));
  for (uint32_t i = kHeaderSlots; i-- > 0;) free_hdrs_.push_back(i);
  inline_slot_ = (sizeof(Header) + inline_bytes_ + 7) / 8 * 8;
  if (inline_bytes_) {
    constexpr uint32_t kInlineSlots = 256;
    inline_out_ = std::make_unique<uint64_t[]>(inline_slot_ / 8 * kInlineSlots);
    inline_out_handle_ = reg(inline_out_.get(), inline_slot_ * kInlineSlots);
    for (uint32_t i = kInlineSlots; i-- > 0;) free_inline_.push_back(i);
  }
  // Every rank takes inline payloads up to kMaxInlineBytes, whatever its own setting, so
  // ranks configured differently still understand each other.
  for (size_t i = 0; i < peers_.size(); ++i)
    if (peers_[i].ep.valid()) {
      peers_[i].in = std::make_unique<uint64_t[]>(kInbox / 8);
      peers_[i].hdr_handle = reg(peers_[i].in.get(), kInbox);
    }
  q_ = std::make_shared<ProgressQueue>([this] { expire(); }, std::chrono::milliseconds(100), "sluice-mailbox",
                                       callers_run, spin);
  post([this] {
    for (size_t i = 0; i < peers_.size(); ++i)
      if (peers_[i].ep.valid()) post_header_recv(static_cast<int>(i));
  });
}

Mailbox::~Mailbox() { close(); }

void Mailbox::set_timeout(std::chrono::milliseconds t) {
  q_->submit([this, t] { timeout_ = t; });
}

std::string Mailbox::who(int peer) const {
  return "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer);
}

MemoryHandle Mailbox::reg(const void* ptr, uint64_t n) {
  return engine_.register_memory(const_cast<void*>(ptr), n);
}

void Mailbox::unreg(MemoryHandle h) {
  if (h.id == 0) return;
  try {
    engine_.unregister_memory(h);
  } catch (const Error&) {
    // The engine closed under us: its registry is gone with it.
  }
}

void Mailbox::post(std::function<void()> task, bool wake) { q_->post(std::move(task), wake || !quiet_); }

void Mailbox::close() {
  if (closed_.exchange(true)) return;
  q_->close();
  destroying_ = true;
  // No task runs anywhere now (a driving caller only waits): this thread runs them from here on. Closing the
  // endpoints fails their pending operations, whose callbacks queue the tasks that report
  // them (so every Work completes); run those before releasing any buffer.
  for (auto& p : peers_) {
    if (p.ep.valid()) p.ep.close();
    if (p.data.valid()) p.data.close();
    if (p.dev.valid()) p.dev.close();
  }
  q_->drain();
  Status st{ErrorCode::kCancelled, "rank " + std::to_string(rank_) + ": the process group was destroyed"};
  for (auto& r : posted_) r->done(st, r->src, 0);
  posted_.clear();
  // RTR recvs whose engine recv has not reported: wait for the engine to let go of the
  // destination (unregistering blocks until then), then report.
  for (auto& p : peers_) {
    std::vector<std::shared_ptr<RtrRecv>> left;
    for (auto& [id, x] : p.rtr_recvs)
      if (!x->data_done) left.push_back(x);
    for (auto& x : left) {
      if (x->owned) unreg(x->handle);
      x->handle = {};
      x->data_done = true;
      rtr_result(*x, st, 0);
      rtr_settle(*x);
    }
    p.rtr_recvs.clear();
  }
  // Rendezvous sends still waiting for their CTS (those whose payload was sending were
  // cancelled with the data endpoint and reported by drain()).
  for (auto& [id, s] : rndv_sends_) {
    drop_payload(*s);
    s->done(st, s->dst, 0);
  }
  rndv_sends_.clear();
  for (auto& l : landing_) {
    if (l->owned) unreg(l->handle);  // blocks until the engine lets go of the destination
    l->r->done(st, l->src, 0);
  }
  landing_.clear();
  for (auto& u : unexpected_) {
    if (u->waiter) u->waiter->done(st, u->src, 0);
    unreg(u->handle);
    release(*u);
  }
  unexpected_.clear();
  q_->drain();
  q_->seal();
  for (auto& p : peers_) unreg(p.hdr_handle), p.hdr_handle = {};
  unreg(send_hdrs_handle_);
  send_hdrs_handle_ = {};
  unreg(inline_out_handle_);
  inline_out_handle_ = {};
}

void Mailbox::post_header_recv(int peer) {
  Peer& p = peers_[peer];
  if (!p.failed.ok()) return;
  Future f;
  try {
    f = p.ep.recv(p.hdr_handle, 0, kInbox);
  } catch (const Error& e) {
    fail_peer(peer, e.status());
    return;
  }
  f.on_complete([this, peer, f](const Status& st) {
    Status s = st;
    if (s.ok() && f.bytes() < sizeof(Header))
      s = {ErrorCode::kProtocol, "a message header of " + std::to_string(f.bytes()) + " bytes"};
    const uint64_t bytes = f.bytes();
    post([this, peer, s, bytes] { on_header(peer, s, bytes); });
  });
}

void Mailbox::fail_peer(int peer, const Status& why) {
  Peer& p = peers_[peer];
  if (!p.failed.ok()) return;
  p.failed = {why.code == ErrorCode::kOk ? ErrorCode::kPeerLost : why.code,
              who(peer) + " failed: " + why.message + " (" + std::string(to_string(why.code)) + ")"};
  // Recvs that only this peer could satisfy fail now; any-source recvs fail too when no
  // live peer is left to satisfy them.
  bool any_alive = false;
  for (size_t i = 0; i < peers_.size(); ++i)
    if (peers_[i].ep.valid() && peers_[i].failed.ok()) any_alive = true;
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->src == peer || ((*it)->src == kAnySource && !any_alive)) {
      auto r = *it;
      it = posted_.erase(it);
      r->done(p.failed, peer, 0);
    } else {
      ++it;
    }
  }
  // RTRs it gave us: nothing goes to it any more. Ours whose payload landed: no header is
  // awaited now (the others end when closing the data endpoint below ends their engine recv).
  p.rtr_pending.clear();
  for (auto it = p.rtr_recvs.begin(); it != p.rtr_recvs.end();)
    it = it->second->finished && it->second->data_done ? p.rtr_recvs.erase(it) : std::next(it);
  // Rendezvous sends to it that wait for a CTS will never get one.
  for (auto it = rndv_sends_.begin(); it != rndv_sends_.end();) {
    auto s = it->second;
    if (s->dst == peer && !s->sending) {
      it = rndv_sends_.erase(it);
      drop_payload(*s);
      s->done(p.failed, peer, 0);
    } else {
      ++it;
    }
  }
  // Payloads in flight either way: closing the data endpoint cancels them, and their
  // callbacks report (a posted engine recv is the only way the engine may still write into
  // a destination, so it must end before its recv reports).
  if (p.data.valid()) p.data.close();
  if (p.dev.valid()) p.dev.close();
  // Reads waiting for a descriptor: they see the failure and report it.
  auto awaiting = std::move(p.awaiting);
  p.awaiting.clear();
  for (auto& [region, fns] : awaiting)
    for (auto& fn : fns) fn();
}

Status Mailbox::landed(Landing& l, const Status& st, const std::string& what) {
  landing_.remove_if([&](const std::shared_ptr<Landing>& x) { return x.get() == &l; });
  if (l.owned) unreg(l.handle);
  if (!l.why.ok()) return l.why;
  if (st.ok()) return st;
  // fail_peer() closed the endpoint under it: say why.
  if (!peers_[l.src].failed.ok()) return peers_[l.src].failed;
  return {st.code, who(l.src) + ": " + what + st.message};
}

void Mailbox::drop_payload(RndvSend& s) {
  if (s.owned) unreg(s.payload);
  s.payload = {};
}

Status Mailbox::eager_into_device(int peer, uint64_t n) const {
  return {ErrorCode::kInvalidArgument, who(peer) + " sent a " + std::to_string(n) +
                                           "-byte message eagerly to a recv into CUDA memory, which only takes "
                                           "messages by rendezvous: SLUICE_TORCH_RNDV_BYTES must be the same on "
                                           "every rank"};
}

Status Mailbox::truncated(int peer, uint64_t tag, uint64_t length, uint64_t n) const {
  return {ErrorCode::kTruncated, who(peer) + " sent " + std::to_string(length) + " bytes with tag " +
                                     std::to_string(tag) + " to a recv of " + std::to_string(n) +
                                     " bytes (tensor sizes must match)"};
}

void Mailbox::send_ctrl(int peer, Header h, std::function<void(const Status&)> finish,
                        std::shared_ptr<std::atomic<int>> left) {
  Peer& p = peers_[peer];
  if (trace_) trace_->mark(TraceEv::kHeaderOut, peer, id_of(h), static_cast<uint8_t>(kind_of(h)));
  MemoryHandle hh;
  uint64_t hoff = 0;
  uint32_t slot = UINT32_MAX;
  std::shared_ptr<Header> own;
  if (!free_hdrs_.empty()) {
    slot = free_hdrs_.back();
    free_hdrs_.pop_back();
    send_hdrs_[slot] = h;
    hh = send_hdrs_handle_;
    hoff = uint64_t(slot) * sizeof(Header);
  } else {
    own = std::make_shared<Header>(h);
    hh = reg(own.get(), sizeof(Header));
  }
  auto release = [this, slot, own, hh] {
    if (slot != UINT32_MAX) free_hdrs_.push_back(slot);
    if (own) unreg(hh);
  };
  Future f;
  try {
    f = p.ep.send(hh, hoff, sizeof(Header));
  } catch (const Error& e) {
    // This completion never comes: the op's other one, if still to come, is its last.
    if (left) left->fetch_sub(1);
    release();
    finish({e.code(), who(peer) + ": " + e.what()});
    return;
  }
  f.on_complete([this, release, finish, left](const Status& st) {
    const bool last = left ? left->fetch_sub(1) == 1 : false;
    post(
        [release, finish, st] {
          release();
          finish(st);
        },
        !st.ok() || last);
  });
}

void Mailbox::start_rndv_recv(int src, uint64_t id, uint64_t length, std::shared_ptr<PostedRecv> r) {
  Peer& p = peers_[src];
  if (!p.failed.ok()) {
    r->done(p.failed, src, 0);
    return;
  }
  // A CUDA recv buffer takes the device endpoint, and the CTS tells the sender so (a CUDA
  // payload never comes as an RTS: it goes as an RTS_READ, see send_rts_read).
  const bool use_dev = p.dev.valid() && r->device;
  if (r->device && !use_dev) {
    Status st{ErrorCode::kProtocol, who(src) + ": a CUDA payload with no device endpoint to that rank"};
    r->done(st, src, 0);
    fail_peer(src, st);
    return;
  }
  auto l = std::make_shared<Landing>(Landing{src, r, {}, Clock::now() + timeout_, {}});
  l->owned = r->handle.id == 0;
  Future f;
  try {
    l->handle = l->owned ? reg(r->ptr, length) : r->handle;
    f = (use_dev ? p.dev : p.data).recv(l->handle, l->owned ? 0 : r->offset, length);
  } catch (const Error& e) {
    if (l->owned) unreg(l->handle);
    r->done({e.code(), who(src) + ": " + e.what()}, src, 0);
    fail_peer(src, e.status());
    return;
  }
  landing_.push_back(l);
  f.on_complete([this, l, f, length](const Status& st) {
    post([this, l, f, st, length] {
      Status out = landed(*l, st, "");
      if (out.ok() && f.bytes() != length)
        out = {ErrorCode::kCancelled, who(l->src) + " gave up on its " + std::to_string(length) +
                                          "-byte message before our recv matched it (its send timed out)"};
      l->r->done(out, l->src, out.ok() ? length : 0);
      if (!st.ok() && l->why.ok()) fail_peer(l->src, st);
    });
  });
  // Only now may the payload go: its recv is posted.
  send_ctrl(src, {0, 0, make_kind(kCts, id, use_dev)}, [this, src](const Status& st) {
    if (!st.ok()) fail_peer(src, st);
  });
}

void Mailbox::on_cts(int peer, uint64_t id, bool dev) {
  Peer& p = peers_[peer];
  if (dev && !p.dev.valid()) {
    fail_peer(peer, {ErrorCode::kProtocol, "a clear-to-send for the device endpoint, which we do not have"});
    return;
  }
  Endpoint& ep = dev ? p.dev : p.data;
  // Whatever goes on the data endpoint now must not overtake an RTR that came before.
  if (!dev) {
    void_rtrs(peer, p.rtr_pending.size());
    if (!p.failed.ok()) return;
  }
  auto it = rndv_sends_.find(id);
  if (it == rndv_sends_.end() || it->second->dst != peer || it->second->sending) {
    // The send timed out (or failed) before its CTS came. The receiver posted a recv on the
    // endpoint the CTS names for it: one byte keeps that endpoint's message order and tells
    // it so.
    try {
      ep.send(send_hdrs_handle_, 0, 1);
    } catch (const Error& e) {
      fail_peer(peer, e.status());
    }
    return;
  }
  auto s = it->second;
  if (s->device && !dev) {
    rndv_sends_.erase(it);
    drop_payload(*s);
    Status st{ErrorCode::kProtocol, who(peer) + " asked for our CUDA payload on its host data endpoint"};
    s->done(st, peer, 0);
    fail_peer(peer, st);
    return;
  }
  send_payload(peer, id, ep);
}

void Mailbox::send_payload(int peer, uint64_t id, Endpoint& ep) {
  auto s = rndv_sends_.at(id);
  s->sending = true;
  Future f;
  try {
    f = ep.send(s->payload, s->offset, s->n);
  } catch (const Error& e) {
    rndv_sends_.erase(id);
    drop_payload(*s);
    s->done({e.code(), who(peer) + ": " + e.what()}, peer, 0);
    fail_peer(peer, e.status());
    return;
  }
  f.on_complete([this, s, id, peer](const Status& st) {
    post([this, s, id, peer, st] {
      rndv_sends_.erase(id);
      drop_payload(*s);
      Status out = st.ok()                      ? st
                   : !peers_[peer].failed.ok() ? peers_[peer].failed  // the data endpoint was closed for it
                                               : Status{st.code, who(peer) + ": " + st.message};
      s->done(out, peer, st.ok() ? s->n : 0);
      if (!st.ok()) fail_peer(peer, st);
    });
  });
}

void Mailbox::on_nack(int peer, uint64_t id, uint64_t their_n) {
  auto it = rndv_sends_.find(id);
  if (it == rndv_sends_.end() || it->second->dst != peer || it->second->sending) return;
  auto s = it->second;
  rndv_sends_.erase(it);
  drop_payload(*s);
  s->done({ErrorCode::kTruncated, who(peer) + " posted a recv of " + std::to_string(their_n) + " bytes for our " +
                                      std::to_string(s->n) + "-byte message with tag " + std::to_string(s->tag) +
                                      " (tensor sizes must match)"},
          peer, 0);
}

void Mailbox::on_header(int peer, const Status& st, uint64_t bytes) {
  Peer& p = peers_[peer];
  if (!st.ok()) {
    fail_peer(peer, st);
    return;
  }
  Header h;
  std::memcpy(&h, p.in.get(), sizeof(Header));
  const Kind kind = kind_of(h);
  if (trace_) trace_->mark(TraceEv::kHeaderIn, peer, id_of(h), static_cast<uint8_t>(kind));
  // Only EAGER_INLINE carries bytes after its header, exactly its length.
  const uint64_t extra = bytes - sizeof(Header);
  if (kind == kEagerInline ? (h.length > kMaxInlineBytes || extra != h.length) : extra != 0) {
    fail_peer(peer, {ErrorCode::kProtocol, "a message header of " + std::to_string(bytes) + " bytes (kind " +
                                               std::to_string(kind) + ", length " + std::to_string(h.length) + ")"});
    return;
  }
  if (kind == kFin) {
    on_fin(peer, id_of(h), h.tag);
    post_header_recv(peer);
    return;
  }
  if (kind == kRtsRead) {
    if (!p.dev.valid() || h.aux > kMaxDescriptor) {
      fail_peer(peer, {ErrorCode::kProtocol, !p.dev.valid() ? "a read rendezvous without a device endpoint"
                                                            : "a region descriptor of " + std::to_string(h.aux) + " bytes"});
      return;
    }
    // Its descriptor follows the header: take it before the next header.
    if (h.aux) take_descriptor(peer, h.region, h.aux);
    if (!p.failed.ok()) return;
  }
  if (kind == kRtr) {
    on_rtr(peer, h);
    post_header_recv(peer);
    return;
  }
  if (kind == kRtrData) {
    ++p.headers_in;
    on_rtr_data(peer, h);
    post_header_recv(peer);
    return;
  }
  if (kind == kCts || kind == kNack) {
    if (kind == kCts)
      on_cts(peer, id_of(h), dev_of(h));
    else
      on_nack(peer, id_of(h), h.tag);
    post_header_recv(peer);
    return;
  }
  if (kind != kEager && kind != kRts && kind != kRtsRead && kind != kEagerInline) {
    fail_peer(peer, {ErrorCode::kProtocol, "a message header of unknown kind " + std::to_string(kind)});
    return;
  }
  ++p.headers_in;
  // Match the first posted recv (posting order) that accepts this source and tag.
  std::shared_ptr<PostedRecv> match;
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (((*it)->src == peer || (*it)->src == kAnySource) && (*it)->tag == h.tag) {
      match = *it;
      posted_.erase(it);
      break;
    }
  }
  if (kind == kEagerInline) {
    on_inline(peer, h, match);
    post_header_recv(peer);
    return;
  }
  if (kind == kRts || kind == kRtsRead) {
    const uint64_t id = id_of(h);
    if (match && match->n == h.length) {
      if (kind == kRtsRead)
        start_read(peer, id, h.length, h.region, h.offset, match);
      else if (match->rtr && p.rtr_recvs.count(match->rtr))
        park_rts(*p.rtr_recvs[match->rtr], id);
      else
        start_rndv_recv(peer, id, h.length, match);
    } else if (match) {
      match->done(truncated(peer, h.tag, h.length, match->n), peer, 0);
      send_ctrl(peer, {match->n, h.length, make_kind(kNack, id)}, [this, peer](const Status& st) {
        if (!st.ok()) fail_peer(peer, st);
      });
    } else {
      auto u = std::make_shared<Unexpected>();
      u->src = peer;
      u->tag = h.tag;
      u->length = h.length;
      u->rndv_id = id;
      u->rndv_read = kind == kRtsRead;
      u->region = h.region;
      u->offset = h.offset;
      u->arrived = true;
      unexpected_.push_back(u);
    }
    post_header_recv(peer);
    return;
  }
  if (match && match->n == h.length && !match->device) {
    if (h.length == 0) {
      match->done(Status::Ok(), peer, 0);
    } else {
      MemoryHandle mh;
      Future f;
      try {
        mh = reg(match->ptr, h.length);
        f = p.ep.recv(mh, 0, h.length);
      } catch (const Error& e) {
        unreg(mh);
        match->done({e.code(), who(peer) + ": " + e.what()}, peer, 0);
        fail_peer(peer, e.status());
        return;
      }
      f.on_complete([this, peer, match, mh, f](const Status& s) {
        post([this, peer, match, mh, s, f] {
          unreg(mh);
          Status out = s.ok() ? s : Status{s.code, who(peer) + ": " + s.message};
          match->done(out, peer, s.ok() ? f.bytes() : 0);
          if (!s.ok()) fail_peer(peer, s);
        });
      });
    }
  } else {
    // Unexpected (or a size mismatch): take the payload into a buffer of our own so the
    // endpoint's message order stays intact.
    auto u = std::make_shared<Unexpected>();
    u->src = peer;
    u->tag = h.tag;
    u->length = h.length;
    if (match)
      match->done(match->n == h.length ? eager_into_device(peer, h.length) : truncated(peer, h.tag, h.length, match->n),
                  peer, 0);
    if (h.length == 0) {
      u->arrived = true;
      if (!match) unexpected_.push_back(u);
    } else {
      if (!stash(peer, *u, h.length)) return;  // the peer is refused: no header recv again
      Future f;
      try {
        u->handle = reg(u->data.data(), h.length);
        f = p.ep.recv(u->handle, 0, h.length);
      } catch (const Error& e) {
        unreg(u->handle);
        release(*u);
        fail_peer(peer, e.status());
        return;
      }
      if (match)
        u->dropped = true;  // the mismatched message is consumed, not kept
      else
        unexpected_.push_back(u);
      f.on_complete([this, u, peer](const Status& s) {
        post([this, u, peer, s] {
          u->arrived = true;
          u->status = s.ok() ? s : Status{s.code, who(peer) + ": " + s.message};
          unreg(u->handle);
          u->handle = {};
          if (u->dropped || !s.ok()) release(*u);  // nobody will read these bytes
          if (u->waiter) {
            auto w = u->waiter;
            unexpected_.remove(u);
            deliver(*u, *w);
          }
          if (!s.ok()) fail_peer(peer, s);
        });
      });
    }
  }
  post_header_recv(peer);
}

void Mailbox::on_inline(int peer, const Header& h, std::shared_ptr<PostedRecv> match) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(peers_[peer].in.get()) + sizeof(Header);
  if (match) {
    if (match->device)
      match->done(eager_into_device(peer, h.length), peer, 0);
    else if (match->n != h.length)
      match->done(truncated(peer, h.tag, h.length, match->n), peer, 0);
    else {
      if (h.length) std::memcpy(match->ptr, bytes, h.length);
      match->done(Status::Ok(), peer, h.length);
    }
    return;
  }
  auto u = std::make_shared<Unexpected>();
  u->src = peer;
  u->tag = h.tag;
  u->length = h.length;
  if (h.length && !stash(peer, *u, h.length)) return;  // the peer is refused
  if (h.length) std::memcpy(u->data.data(), bytes, h.length);
  u->arrived = true;
  unexpected_.push_back(u);
}

bool Mailbox::send_inline(int dst, uint64_t tag, const void* ptr, uint64_t n, Done& done) {
  if (n > inline_bytes_ || free_inline_.empty()) return false;
  Peer& p = peers_[dst];
  const uint32_t slot = free_inline_.back();
  free_inline_.pop_back();
  auto* out = reinterpret_cast<uint8_t*>(inline_out_.get()) + uint64_t(slot) * inline_slot_;
  const Header h{tag, n, make_kind(kEagerInline, 0), 0, 0, 0};
  std::memcpy(out, &h, sizeof(h));
  if (n) std::memcpy(out + sizeof(h), ptr, n);
  if (trace_) trace_->mark(TraceEv::kHeaderOut, dst, 0, static_cast<uint8_t>(kEagerInline));
  Future f;
  try {
    f = p.ep.send(inline_out_handle_, uint64_t(slot) * inline_slot_, sizeof(h) + n);
  } catch (const Error& e) {
    free_inline_.push_back(slot);
    Status st{e.code(), who(dst) + ": " + e.what()};
    done(st, dst, 0);
    fail_peer(dst, st);
    return true;
  }
  f.on_complete([this, slot, dst, n, done = std::move(done)](const Status& st) mutable {
    post([this, slot, dst, n, st, done = std::move(done)] {
      free_inline_.push_back(slot);
      Status out = st.ok() ? st : Status{st.code, who(dst) + ": " + st.message};
      done(out, dst, st.ok() ? n : 0);
      if (!st.ok()) fail_peer(dst, out);
    });
  });
  return true;
}

bool Mailbox::stash(int peer, Unexpected& u, uint64_t length) {
  const uint64_t held = unexpected_bytes_;  // <= max_unexpected_bytes_
  const std::string what = "its " + std::to_string(length) + "-byte eager message (" + describe_tag(u.tag) +
                           ") found no recv posted";
  const std::string bound = "SLUICE_TORCH_MAX_UNEXPECTED_BYTES = " + std::to_string(max_unexpected_bytes_) +
                            " bytes, " + std::to_string(held) + " bytes held now";
  if (length > max_unexpected_bytes_ - held) {
    refuse_peer(peer, {ErrorCode::kProtocol,
                       what + ", and holding it would take the unexpected messages held from all peers to " +
                           std::to_string(held) + " + " + std::to_string(length) + " bytes, above " + bound +
                           " (post the recvs earlier, or raise the limit)"});
    return false;
  }
  try {
    u.data.resize(length);
  } catch (const std::exception& e) {  // bad_alloc; length_error past max_size()
    refuse_peer(peer, {ErrorCode::kSystem, what + ", and a buffer for it could not be allocated (" + e.what() +
                                               "; " + bound + ")"});
    return false;
  }
  u.charged = length;
  unexpected_bytes_ += length;
  return true;
}

void Mailbox::release(Unexpected& u) {
  unexpected_bytes_ -= u.charged;
  u.charged = 0;
  std::vector<uint8_t>().swap(u.data);
}

void Mailbox::refuse_peer(int peer, const Status& why) {
  fail_peer(peer, why);
  Peer& p = peers_[peer];
  // What it sent before is dropped too: the pair lost a message, and a recv that then took
  // an older one would hide that.
  for (auto it = unexpected_.begin(); it != unexpected_.end();) {
    auto u = *it;
    if (u->src != peer) {
      ++it;
      continue;
    }
    it = unexpected_.erase(it);
    if (u->waiter) {
      u->waiter->done(p.failed, peer, 0);
      u->waiter.reset();
    }
    if (u->arrived)
      release(*u);
    else
      u->dropped = true;  // the engine still writes into it: released when its recv ends
  }
  // Closing the control endpoint ends the payload recvs in flight, and tells the peer: its
  // own ops with us fail at once instead of queueing more messages we would not take.
  if (p.ep.valid()) p.ep.close();
}

void Mailbox::deliver(Unexpected& u, PostedRecv& r) {
  if (!u.status.ok()) {
    r.done(u.status, u.src, 0);
  } else if (r.device) {
    r.done(eager_into_device(u.src, u.length), u.src, 0);
  } else if (u.length != r.n) {
    r.done({ErrorCode::kTruncated, who(u.src) + " sent " + std::to_string(u.length) + " bytes to a recv of " +
                                       std::to_string(r.n) + " bytes (tensor sizes must match)"},
           u.src, 0);
  } else {
    if (u.length) std::memcpy(r.ptr, u.data.data(), u.length);
    r.done(Status::Ok(), u.src, u.length);
  }
  release(u);
}

Mailbox::Done Mailbox::traced(Done done) {
  return [t = trace_, done = std::move(done)](const Status& st, int peer, uint64_t bytes) {
    t->mark(TraceEv::kDone, peer, bytes);
    done(st, peer, bytes);
  };
}

void Mailbox::recv(int src, uint64_t tag, void* ptr, uint64_t n, Done done) {
  recv(src, tag, Buffer{ptr, n}, std::move(done));
}

void Mailbox::recv(int src, uint64_t tag, const Buffer& b, Done done) {
  if (src != kAnySource && (src < 0 || src >= static_cast<int>(peers_.size()) || !peers_[src].ep.valid()))
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": recv from invalid rank " +
                                                 std::to_string(src));
  if (b.device && (src == kAnySource || !has_device(src) || b.n < rndv_bytes_ || !b.handle.id))
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) +
                                                 ": a recv into CUDA memory needs a registered buffer of at least "
                                                 "rndv_bytes from a rank with a device endpoint");
  if (trace_) done = traced(std::move(done));
  auto r = std::make_shared<PostedRecv>(
      PostedRecv{src, tag, b.ptr, b.n, std::move(done), Clock::now(), b.handle, b.offset, b.device});
  q_->submit([this, r] {
    r->deadline = Clock::now() + timeout_;
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      auto u = *it;
      if ((r->src == u->src || r->src == kAnySource) && u->tag == r->tag && !u->waiter) {
        if (u->rndv_id) {
          unexpected_.erase(it);
          if (u->length == r->n) {
            if (u->rndv_read)
              start_read(u->src, u->rndv_id, u->length, u->region, u->offset, r);
            else
              start_rndv_recv(u->src, u->rndv_id, u->length, r);
          } else {
            r->done(truncated(u->src, u->tag, u->length, r->n), u->src, 0);
            int src = u->src;
            send_ctrl(src, {r->n, u->length, make_kind(kNack, u->rndv_id)}, [this, src](const Status& st) {
              if (!st.ok()) fail_peer(src, st);
            });
          }
        } else if (u->arrived) {
          unexpected_.erase(it);
          deliver(*u, *r);
        } else {
          u->waiter = r;  // delivered when the payload lands
        }
        return;
      }
    }
    if (r->src != kAnySource && !peers_[r->src].failed.ok()) {
      r->done(peers_[r->src].failed, r->src, 0);
      return;
    }
    offer_rtr(r);  // before it joins posted_: the check looks for earlier recvs there
    posted_.push_back(r);
  });
}

void Mailbox::send(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done) {
  send(dst, tag, Buffer{const_cast<void*>(ptr), n}, std::move(done));
}

void Mailbox::send(int dst, uint64_t tag, const Buffer& b, Done done) {
  if (dst < 0 || dst >= static_cast<int>(peers_.size()) || !peers_[dst].ep.valid())
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": send to invalid rank " +
                                                 std::to_string(dst));
  if (b.device && (!has_device(dst) || b.n < rndv_bytes_ || !b.handle.id))
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) +
                                                 ": a send from CUDA memory needs a registered buffer of at least "
                                                 "rndv_bytes to a rank with a device endpoint");
  if (trace_) done = traced(std::move(done));
  q_->submit([this, dst, tag, b, done = std::move(done)]() mutable {
    const uint64_t n = b.n;
    Peer& p = peers_[dst];
    if (!p.failed.ok()) {
      done(p.failed, dst, 0);
      return;
    }
    if (uint64_t rtr = claim_rtr(dst, tag, n, !b.device && n != 0 && n >= rndv_bytes_ && p.data.valid())) {
      send_rtr_data(dst, tag, b, rtr, std::move(done));
      return;
    }
    if (!p.failed.ok()) {  // voiding an RTR failed the pair
      done(p.failed, dst, 0);
      return;
    }
    count_out(dst, tag);  // every path below sends this message's header now
    if (!b.device && (n == 0 || n < rndv_bytes_ || !p.data.valid())) {
      send_eager(dst, tag, b.ptr, n, std::move(done));
      return;
    }
    // Rendezvous: register now, so that the registration overlaps the RTS / CTS round trip.
    auto s = std::make_shared<RndvSend>(RndvSend{dst, tag, n, {}, std::move(done), Clock::now() + timeout_});
    s->owned = b.handle.id == 0;
    s->offset = s->owned ? 0 : b.offset;
    s->device = b.device;
    try {
      s->payload = s->owned ? reg(b.ptr, n) : b.handle;
    } catch (const Error& e) {
      s->done({e.code(), who(dst) + ": " + e.what()}, dst, 0);
      return;
    }
    const uint64_t id = next_id_++;
    rndv_sends_[id] = s;
    if (!b.device) p.history.back().rts = id;  // counted above
    if (b.device) {
      s->read = true;
      send_rts_read(dst, s, id);
      return;
    }
    send_ctrl(dst, {tag, n, make_kind(kRts, id)}, [this, dst](const Status& st) {
      if (!st.ok()) fail_peer(dst, st);  // fails this send too (it waits for a CTS)
    });
  });
}

void Mailbox::send_eager(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done) {
  if (send_inline(dst, tag, ptr, n, done)) return;
  {
    Peer& p = peers_[dst];
    auto s = std::make_shared<SendState>();
    s->n = n;
    s->done = std::move(done);
    MemoryHandle hh;
    uint64_t hoff = 0;
    if (!free_hdrs_.empty()) {
      s->slot = free_hdrs_.back();
      free_hdrs_.pop_back();
      send_hdrs_[s->slot] = {tag, n, make_kind(kEager, 0)};
      hh = send_hdrs_handle_;
      hoff = uint64_t(s->slot) * sizeof(Header);
    } else {
      s->own_hdr = std::make_unique<std::array<uint64_t, 6>>(std::array<uint64_t, 6>{tag, n, make_kind(kEager, 0), 0, 0, 0});
      static_assert(sizeof(std::array<uint64_t, 6>) == sizeof(Header));
      s->own_hdr_handle = hh = reg(s->own_hdr->data(), sizeof(Header));
    }
    auto finish = [this, s, dst](const Status& st) {
      if (!st.ok() && s->status.ok()) s->status = {st.code, who(dst) + ": " + st.message};
      if (--s->remaining > 0) return;
      if (s->slot != UINT32_MAX) free_hdrs_.push_back(s->slot);
      unreg(s->own_hdr_handle);
      unreg(s->payload);
      s->done(s->status, dst, s->status.ok() ? s->n : 0);
      if (!s->status.ok()) fail_peer(dst, s->status);
    };
    int submitted = 0;
    s->remaining = n ? 2 : 1;
    // Only the op's last engine completion (or a failure) wakes a runner.
    auto left = std::make_shared<std::atomic<int>>(s->remaining);
    auto on_done = [this, finish, left](const Status& st) {
      const bool last = left->fetch_sub(1) == 1;
      post([finish, st] { finish(st); }, !st.ok() || last);
    };
    try {
      if (trace_) trace_->mark(TraceEv::kHeaderOut, dst, 0, static_cast<uint8_t>(kEager));
      Future fh = p.ep.send(hh, hoff, sizeof(Header));
      ++submitted;
      fh.on_complete(on_done);
      if (n) {
        s->payload = reg(ptr, n);
        Future fp = p.ep.send(s->payload, 0, n);
        ++submitted;
        fp.on_complete(on_done);
      }
    } catch (const Error& e) {
      // The callbacks of what was submitted run later on this thread (they are queued), so
      // one more finish() here accounts for everything that was not.
      left->fetch_sub(s->remaining - submitted);
      s->remaining = submitted + 1;
      finish(e.status());
    }
  }
}

void Mailbox::send_rts_read(int dst, const std::shared_ptr<RndvSend>& s, uint64_t id) {
  Peer& p = peers_[dst];
  Header h{s->tag, s->n, make_kind(kRtsRead, id), s->payload.id, s->offset, 0};
  std::shared_ptr<std::string> desc;
  if (!p.announced.count(s->payload.id)) {
    try {
      desc = std::make_shared<std::string>(engine_.region_descriptor(s->payload));
    } catch (const Error& e) {
      rndv_sends_.erase(id);
      drop_payload(*s);
      s->done({e.code(), who(dst) + ": " + e.what()}, dst, 0);
      return;
    }
    h.aux = desc->size();
    p.announced.insert(s->payload.id);
  }
  send_ctrl(dst, h, [this, dst](const Status& st) {
    if (!st.ok()) fail_peer(dst, st);  // fails this send too (it waits for a FIN)
  });
  if (!desc) return;
  // The descriptor follows its header on the same endpoint (in order).
  MemoryHandle dh;
  Future f;
  try {
    dh = reg(desc->data(), desc->size());
    f = p.ep.send(dh, 0, desc->size());
  } catch (const Error& e) {
    unreg(dh);
    fail_peer(dst, e.status());
    return;
  }
  f.on_complete([this, dst, desc, dh](const Status& st) {
    post([this, dst, desc, dh, st] {
      unreg(dh);
      if (!st.ok()) fail_peer(dst, st);
    });
  });
}

void Mailbox::take_descriptor(int peer, uint64_t region, uint64_t bytes) {
  Peer& p = peers_[peer];
  p.awaiting[region];  // reads of this region wait for it from now on
  auto buf = std::make_shared<std::string>(bytes, '\0');
  MemoryHandle mh;
  Future f;
  try {
    mh = reg(buf->data(), bytes);
    f = p.ep.recv(mh, 0, bytes);
  } catch (const Error& e) {
    unreg(mh);
    fail_peer(peer, e.status());
    return;
  }
  f.on_complete([this, peer, region, buf, mh, f](const Status& st) {
    post([this, peer, region, buf, mh, st, f] {
      unreg(mh);
      Peer& p = peers_[peer];
      if (!p.failed.ok()) return;
      Status s = st;
      if (s.ok() && f.bytes() != buf->size())
        s = {ErrorCode::kProtocol, "a region descriptor of " + std::to_string(f.bytes()) + " bytes, announced " +
                                       std::to_string(buf->size())};
      if (s.ok()) {
        try {
          if (p.dev.import_region(*buf).id != region)
            s = {ErrorCode::kProtocol, "the descriptor of region " + std::to_string(region) + " names another region"};
        } catch (const Error& e) {
          s = e.status();
        }
      }
      if (!s.ok()) {
        fail_peer(peer, s);
        return;
      }
      p.imported.insert(region);
      auto it = p.awaiting.find(region);
      if (it == p.awaiting.end()) return;
      auto fns = std::move(it->second);
      p.awaiting.erase(it);
      for (auto& fn : fns) fn();
    });
  });
}

void Mailbox::start_read(int src, uint64_t id, uint64_t length, uint64_t region, uint64_t offset,
                         std::shared_ptr<PostedRecv> r) {
  Peer& p = peers_[src];
  if (!p.failed.ok()) {
    r->done(p.failed, src, 0);
    return;
  }
  if (!p.imported.count(region)) {
    auto it = p.awaiting.find(region);
    if (it == p.awaiting.end()) {
      Status st{ErrorCode::kProtocol, "a read rendezvous names region " + std::to_string(region) +
                                          ", whose descriptor never came"};
      r->done({st.code, who(src) + ": " + st.message}, src, 0);
      fail_peer(src, st);
      return;
    }
    it->second.push_back([this, src, id, length, region, offset, r] { start_read(src, id, length, region, offset, r); });
    return;
  }
  auto l = std::make_shared<Landing>(Landing{src, r, {}, Clock::now() + timeout_, {}});
  l->owned = r->handle.id == 0;
  auto fin = [this, src, id](const Status& st) {
    const uint64_t code = st.ok() ? 0 : static_cast<uint64_t>(st.code);
    send_ctrl(src, {code, 0, make_kind(kFin, id)}, [this, src](const Status& s) {
      if (!s.ok()) fail_peer(src, s);
    });
  };
  Future f;
  try {
    l->handle = l->owned ? reg(r->ptr, length) : r->handle;
    if (trace_) trace_->mark(TraceEv::kReadCall, src, id);
    f = p.dev.read({{l->handle, l->owned ? 0 : r->offset, RemoteHandle{region}, offset, length}});
    if (trace_) trace_->mark(TraceEv::kReadPosted, src, id);
  } catch (const Error& e) {
    if (l->owned) unreg(l->handle);
    r->done({e.code(), who(src) + ": " + e.what()}, src, 0);
    fin(e.status());
    return;
  }
  landing_.push_back(l);
  f.on_complete([this, l, length, fin, id](const Status& st) {
    if (trace_) trace_->mark(TraceEv::kReadDone, l->src, id);
    post([this, l, length, fin, st] {
      Status out = landed(*l, st, "reading its message: ");
      l->r->done(out, l->src, out.ok() ? length : 0);
      if (peers_[l->src].failed.ok()) fin(st);
    });
  });
}

void Mailbox::on_fin(int peer, uint64_t id, uint64_t code) {
  auto it = rndv_sends_.find(id);
  if (it == rndv_sends_.end() || it->second->dst != peer || !it->second->read) return;  // gave up on it
  auto s = it->second;
  rndv_sends_.erase(it);
  drop_payload(*s);
  Status out = Status::Ok();
  if (code != 0) {
    const auto c = code <= static_cast<uint64_t>(ErrorCode::kInternal) ? static_cast<ErrorCode>(code) : ErrorCode::kRemoteError;
    out = {c, who(peer) + " could not read our " + std::to_string(s->n) + "-byte message with tag " +
                  std::to_string(s->tag) + " (" + std::string(to_string(c)) + ")"};
  }
  s->done(out, peer, out.ok() ? s->n : 0);
}

void Mailbox::expire() {
  auto now = Clock::now();
  std::vector<std::pair<int, Status>> shifted;
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->deadline <= now) {
      auto r = *it;
      it = posted_.erase(it);
      std::string from = r->src == kAnySource ? "any peer rank" : "peer rank " + std::to_string(r->src);
      std::string what = describe_tag(r->tag);
      Status st{ErrorCode::kTimeout, "rank " + std::to_string(rank_) + ": no message from " + from + " (" + what +
                                         ") within the group timeout of " + std::to_string(timeout_.count()) + " ms"};
      // With RTRs out to that rank, the pair fails (mailbox.hpp, ready-to-receive).
      if (r->src != kAnySource && !peers_[r->src].rtr_recvs.empty()) shifted.emplace_back(r->src, st);
      r->done(st, r->src, 0);
    } else {
      ++it;
    }
  }
  auto unarrived = [this](int src) {
    return Status{ErrorCode::kTimeout, "rank " + std::to_string(rank_) + ": the payload from peer rank " +
                                           std::to_string(src) + " did not arrive within the group timeout of " +
                                           std::to_string(timeout_.count()) + " ms"};
  };
  // An RTR payload announced (RTR_DATA, or the crossed RTS) but not landed within the timeout.
  for (size_t i = 0; i < peers_.size(); ++i)
    for (auto& [id, s] : peers_[i].rtr_recvs)
      if ((s->header_seen || s->rts) && !s->data_done && s->deadline <= now) {
        shifted.emplace_back(static_cast<int>(i), unarrived(static_cast<int>(i)));
        break;
      }
  for (auto& [peer, why] : shifted) fail_peer(peer, why);
  std::vector<std::pair<int, Status>> unread;
  for (auto it = rndv_sends_.begin(); it != rndv_sends_.end();) {
    auto s = it->second;
    if (!s->sending && s->deadline <= now) {
      if (s->read)
        unread.emplace_back(s->dst, Status{ErrorCode::kTimeout, "it did not read our " + std::to_string(s->n) +
                                                                    "-byte message within the group timeout"});
      // A CTS that still comes gets a 1-byte payload (on_cts), so the data endpoint keeps
      // its order and the peer learns the send was abandoned.
      it = rndv_sends_.erase(it);
      drop_payload(*s);
      s->done({ErrorCode::kTimeout, "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(s->dst) +
                                        " did not take our " + std::to_string(s->n) + "-byte message (tag " +
                                        std::to_string(s->tag) + ") within the group timeout of " +
                                        std::to_string(timeout_.count()) + " ms"},
              s->dst, 0);
    } else {
      ++it;
    }
  }
  std::vector<std::pair<int, Status>> hung;
  for (auto& l : landing_) {
    if (l->why.ok() && l->deadline <= now) {
      l->why = unarrived(l->src);
      hung.emplace_back(l->src, l->why);
    }
  }
  // Only closing the data endpoint takes a posted engine recv back (and the recv reports
  // `why` once it has): the peer is failed.
  for (auto& [peer, why] : hung) fail_peer(peer, why);
  // The peer may still read a payload we gave up on, from memory the caller may reuse now:
  // the pair is failed (its endpoints close) instead.
  for (auto& [peer, why] : unread) fail_peer(peer, why);
}

// Ready-to-receive (mailbox.hpp). Receiver side.

bool Mailbox::offer_rtr(const std::shared_ptr<PostedRecv>& r) {
  if (!recv_ready_ || r->src == kAnySource || r->device || r->n == 0 || r->n < rndv_bytes_) return false;
  Peer& p = peers_[r->src];
  if (!p.data.valid() || !p.failed.ok() || p.rtr_recvs.size() >= kMaxPendingRtr) return false;
  // An earlier recv that could take this rank's next message with this tag would take the
  // message the RTR is numbered for.
  for (const auto& q : posted_)
    if (q->tag == r->tag && (q->src == r->src || q->src == kAnySource)) return false;
  auto s = std::make_shared<RtrRecv>();
  s->src = r->src;
  s->id = next_id_++;
  s->r = r;
  s->owned = r->handle.id == 0;
  Future f;
  try {
    s->handle = s->owned ? reg(r->ptr, r->n) : r->handle;
    f = p.data.recv(s->handle, s->owned ? 0 : r->offset, r->n);
  } catch (const Error&) {
    if (s->owned) unreg(s->handle);
    return false;  // the usual rendezvous then reports what is wrong
  }
  s->user = std::move(r->done);
  r->rtr = s->id;
  std::weak_ptr<RtrRecv> w = s;
  r->done = [this, w](const Status& st, int, uint64_t bytes) {
    if (auto x = w.lock()) rtr_result(*x, st, bytes);
  };
  p.rtr_recvs[s->id] = s;
  f.on_complete([this, s, f](const Status& st) {
    post([this, s, f, st] { on_rtr_landed(s, st, f.bytes()); });
  });
  rtr_offered_.fetch_add(1, std::memory_order_relaxed);
  const int src = r->src;
  send_ctrl(src, {r->tag, r->n, make_kind(kRtr, s->id), p.headers_in, 0, 0}, [this, src](const Status& st) {
    if (!st.ok()) fail_peer(src, st);
  });
  return true;
}

void Mailbox::rtr_result(RtrRecv& s, const Status& st, uint64_t bytes) {
  if (s.have_result) return;
  s.have_result = true;
  s.result = st;
  s.result_bytes = bytes;
  rtr_settle(s);
}

void Mailbox::rtr_settle(RtrRecv& s) {
  Peer& p = peers_[s.src];
  auto it = p.rtr_recvs.find(s.id);
  const std::shared_ptr<RtrRecv> keep = it != p.rtr_recvs.end() ? it->second : nullptr;  // `s` outlives the erase
  if (!s.finished && s.data_done && s.have_result) {
    s.finished = true;
    Done user = std::move(s.user);
    user(s.result, s.src, s.result.ok() ? s.result_bytes : 0);
  }
  // After a payload its header still comes (and is checked against the record), unless the
  // pair failed.
  if (s.finished && s.data_done && (s.header_seen || !s.payload || !p.failed.ok())) p.rtr_recvs.erase(s.id);
}

void Mailbox::on_rtr_landed(const std::shared_ptr<RtrRecv>& s, const Status& st, uint64_t bytes) {
  if (s->data_done) return;  // close() already waited for the engine to let go
  s->data_done = true;
  if (s->owned) unreg(s->handle);
  s->handle = {};
  Peer& p = peers_[s->src];
  auto take = [&] { posted_.remove(s->r); };  // no header may match it any more
  if (!st.ok()) {
    if (!s->have_result) {
      take();
      rtr_result(*s, destroying_ ? Status{ErrorCode::kCancelled, "rank " + std::to_string(rank_) +
                                                                     ": the process group was destroyed"}
                     : !p.failed.ok() ? p.failed
                                      : Status{st.code, who(s->src) + ": " + st.message},
                 0);
    } else {
      rtr_settle(*s);
    }
    if (!destroying_) fail_peer(s->src, st);
    return;
  }
  if (bytes == 0) {  // voided: the recv goes on as if there had been no RTR
    if (s->rts && !s->have_result)
      start_rndv_recv(s->src, s->rts, s->r->n, s->r);  // the crossed RTS gets its CTS now
    else
      rtr_settle(*s);
    return;
  }
  if (bytes == s->r->n && !s->have_result) {
    s->payload = true;
    // Complete once its header came too (RTR_DATA, or the crossed RTS): until then the recv
    // stays where that header will look for it.
    if (s->header_seen || s->rts) rtr_result(*s, Status::Ok(), bytes);
    return;
  }
  Status bad{ErrorCode::kProtocol, "a " + std::to_string(bytes) + "-byte payload for our ready-to-receive of " +
                                       std::to_string(s->r->n) + " bytes" +
                                       (s->have_result ? " after its recv had its message" : "")};
  take();
  rtr_result(*s, {bad.code, who(s->src) + ": " + bad.message}, 0);
  rtr_settle(*s);
  fail_peer(s->src, bad);
}

void Mailbox::on_rtr_data(int peer, const Header& h) {
  Peer& p = peers_[peer];
  auto it = p.rtr_recvs.find(id_of(h));
  if (it == p.rtr_recvs.end() || it->second->header_seen || it->second->rts ||
      (it->second->have_result && !it->second->payload) ||
      it->second->r->tag != h.tag || it->second->r->n != h.length) {
    fail_peer(peer, {ErrorCode::kProtocol, "a payload announced for ready-to-receive " + std::to_string(id_of(h)) +
                                               " (tag " + std::to_string(h.tag) + ", " + std::to_string(h.length) +
                                               " bytes), which names no recv of ours waiting for it"});
    return;
  }
  auto s = it->second;
  s->header_seen = true;
  s->deadline = Clock::now() + timeout_;
  posted_.remove(s->r);  // its message came: later headers go to later recvs
  if (s->payload) rtr_result(*s, Status::Ok(), s->r->n);
  rtr_settle(*s);
}

void Mailbox::park_rts(RtrRecv& s, uint64_t id) {
  s.rts = id;
  s.deadline = Clock::now() + timeout_;
  if (s.payload)
    rtr_result(s, Status::Ok(), s.r->n);
  else if (s.data_done && !s.have_result)  // voided before the RTS came
    start_rndv_recv(s.src, id, s.r->n, s.r);
}

// Sender side.

void Mailbox::count_out(int dst, uint64_t tag) {
  Peer& p = peers_[dst];
  ++p.headers_out;
  p.history.push_back({tag});
  if (p.history.size() > kRtrHistory) p.history.pop_front();
}

void Mailbox::on_rtr(int peer, const Header& h) {
  Peer& p = peers_[peer];
  const uint64_t seen = h.region;  // our message headers it had when it posted the recv
  if (!p.data.valid()) {
    fail_peer(peer, {ErrorCode::kProtocol, "a ready-to-receive, but we have no data endpoint to that rank"});
    return;
  }
  if (seen > p.headers_out) {
    fail_peer(peer, {ErrorCode::kProtocol, "a ready-to-receive counting " + std::to_string(seen) +
                                               " of our messages; we sent " + std::to_string(p.headers_out)});
    return;
  }
  p.rtr_pending.push_back({id_of(h), h.tag, h.length});
  // Its recv takes our first message with its tag from message `seen` on. Already sent (the
  // RTR crossed it): a host RTS of that length still waiting for its CTS rides on the RTR;
  // anything else voids it. Not sent yet: the RTR waits for it (claim_rtr).
  const uint64_t unseen = p.headers_out - seen;
  bool stale = unseen > p.history.size() || p.rtr_pending.size() > kMaxPendingRtr;
  for (size_t i = 0; !stale && i + 1 < p.rtr_pending.size(); ++i) stale = p.rtr_pending[i].tag == h.tag;
  const Peer::Sent* sent = nullptr;
  for (size_t i = p.history.size() - std::min<uint64_t>(unseen, p.history.size()); !stale && i < p.history.size(); ++i)
    if (p.history[i].tag == h.tag) {
      sent = &p.history[i];
      break;
    }
  if (stale || !sent) {
    if (stale) void_rtrs(peer, p.rtr_pending.size());
    return;
  }
  auto it = sent->rts ? rndv_sends_.find(sent->rts) : rndv_sends_.end();
  if (it == rndv_sends_.end() || it->second->dst != peer || it->second->sending || it->second->read ||
      it->second->device || it->second->n != h.length) {
    void_rtrs(peer, p.rtr_pending.size());
    return;
  }
  void_rtrs(peer, p.rtr_pending.size() - 1);  // those before it go first (the data endpoint's order)
  if (!p.failed.ok()) return;
  p.rtr_pending.pop_front();
  rtr_used_.fetch_add(1, std::memory_order_relaxed);
  send_payload(peer, it->first, p.data);
}

uint64_t Mailbox::claim_rtr(int dst, uint64_t tag, uint64_t n, bool usable) {
  Peer& p = peers_[dst];
  for (size_t i = 0; i < p.rtr_pending.size(); ++i) {
    if (p.rtr_pending[i].tag != tag) continue;
    if (!usable || p.rtr_pending[i].n != n) {
      void_rtrs(dst, i + 1);
      return 0;
    }
    const uint64_t id = p.rtr_pending[i].id;
    void_rtrs(dst, i);
    if (!p.failed.ok()) return 0;
    p.rtr_pending.pop_front();
    return id;
  }
  return 0;
}

void Mailbox::void_rtrs(int peer, size_t count) {
  Peer& p = peers_[peer];
  for (; count > 0 && !p.rtr_pending.empty() && p.failed.ok(); --count) {
    p.rtr_pending.pop_front();
    rtr_voided_.fetch_add(1, std::memory_order_relaxed);
    try {
      p.data.send(send_hdrs_handle_, 0, 0);  // 0 bytes: the recv stays posted for its own message
    } catch (const Error& e) {
      fail_peer(peer, e.status());
    }
  }
}

void Mailbox::send_rtr_data(int dst, uint64_t tag, const Buffer& b, uint64_t id, Done done) {
  Peer& p = peers_[dst];
  auto st = std::make_shared<SendState>();
  st->n = b.n;
  st->done = std::move(done);
  const bool owned = b.handle.id == 0;
  auto finish = [this, st, dst, owned](const Status& s) {
    if (!s.ok() && st->status.ok())
      st->status = !peers_[dst].failed.ok() ? peers_[dst].failed : Status{s.code, who(dst) + ": " + s.message};
    if (--st->remaining > 0) return;
    if (owned) unreg(st->payload);
    st->done(st->status, dst, st->status.ok() ? st->n : 0);
    if (!st->status.ok()) fail_peer(dst, st->status);
  };
  st->remaining = 2;
  // The payload's and the header's engine completions: only the last (or a failure) wakes.
  auto left = std::make_shared<std::atomic<int>>(2);
  try {
    st->payload = owned ? reg(b.ptr, b.n) : b.handle;
    Future f = p.data.send(st->payload, owned ? 0 : b.offset, b.n);
    f.on_complete([this, finish, left](const Status& s) {
      const bool last = left->fetch_sub(1) == 1;
      post([finish, s] { finish(s); }, !s.ok() || last);
    });
  } catch (const Error& e) {
    // The RTR's recv stays posted with nothing coming for it: the pair cannot go on.
    st->remaining = 1;
    finish(e.status());
    return;
  }
  rtr_used_.fetch_add(1, std::memory_order_relaxed);
  count_out(dst, tag);
  send_ctrl(dst, {tag, b.n, make_kind(kRtrData, id)}, finish, left);
}

}  // namespace sluice::torch_backend
