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
  std::unique_ptr<std::array<uint64_t, 2>> own_hdr;  // when every slot was taken
  MemoryHandle own_hdr_handle;
  MemoryHandle payload;
  uint64_t n = 0;
  Mailbox::Done done;
};
}  // namespace

Mailbox::Mailbox(Engine& engine, std::vector<Endpoint> peers, int rank, std::chrono::milliseconds timeout)
    : engine_(engine), rank_(rank), timeout_(timeout), peers_(peers.size()) {
  for (size_t i = 0; i < peers.size(); ++i) peers_[i].ep = std::move(peers[i]);
  send_hdrs_.resize(kHeaderSlots);
  send_hdrs_handle_ = reg(send_hdrs_.data(), send_hdrs_.size() * sizeof(Header));
  for (uint32_t i = kHeaderSlots; i-- > 0;) free_hdrs_.push_back(i);
  for (size_t i = 0; i < peers_.size(); ++i)
    if (peers_[i].ep.valid()) peers_[i].hdr_handle = reg(&peers_[i].hdr, sizeof(Header));
  thread_ = std::thread([this] { run(); });
  post([this] {
    for (size_t i = 0; i < peers_.size(); ++i)
      if (peers_[i].ep.valid()) post_header_recv(static_cast<int>(i));
  });
}

Mailbox::~Mailbox() { close(); }

void Mailbox::set_timeout(std::chrono::milliseconds t) {
  post([this, t] { timeout_ = t; });
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

void Mailbox::post(std::function<void()> task) {
  std::lock_guard<std::mutex> lk(mu_);
  if (drained_) return;
  tasks_.push_back(std::move(task));
  cv_.notify_one();
}

void Mailbox::run() {
  std::unique_lock<std::mutex> lk(mu_);
  auto next_expiry = Clock::now() + std::chrono::milliseconds(100);
  while (true) {
    cv_.wait_until(lk, next_expiry, [&] { return closing_ || !tasks_.empty(); });
    if (closing_) break;
    std::deque<std::function<void()>> batch;
    batch.swap(tasks_);
    lk.unlock();
    for (auto& t : batch) run_task(t);
    if (Clock::now() >= next_expiry) {
      expire();
      next_expiry = Clock::now() + std::chrono::milliseconds(100);
    }
    lk.lock();
  }
}

void Mailbox::run_task(std::function<void()>& task) {
  try {
    task();
  } catch (const std::exception& e) {
    // Every task reports its own failures through its callback; an escape here is a bug,
    // but it must not take the process down (std::terminate on the progress thread).
    SLUICE_LOG(kError, "sluice torch mailbox: a progress task threw: " << e.what());
  }
}

void Mailbox::drain() {
  while (true) {
    std::deque<std::function<void()>> batch;
    {
      std::lock_guard<std::mutex> lk(mu_);
      batch.swap(tasks_);
    }
    if (batch.empty()) return;
    for (auto& t : batch) run_task(t);
  }
}

void Mailbox::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closing_) return;
    closing_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  // The thread is gone: this thread runs the progress tasks from now on. Closing the
  // endpoints fails their pending operations, whose callbacks queue the tasks that report
  // them (so every Work completes); run those before releasing any buffer.
  for (auto& p : peers_)
    if (p.ep.valid()) p.ep.close();
  drain();
  Status st{ErrorCode::kCancelled, "rank " + std::to_string(rank_) + ": the process group was destroyed"};
  for (auto& r : posted_) r->done(st, r->src, 0);
  posted_.clear();
  for (auto& u : unexpected_) {
    if (u->waiter) u->waiter->done(st, u->src, 0);
    unreg(u->handle);
  }
  unexpected_.clear();
  drain();
  {
    std::lock_guard<std::mutex> lk(mu_);
    drained_ = true;
    tasks_.clear();
  }
  for (auto& p : peers_) unreg(p.hdr_handle), p.hdr_handle = {};
  unreg(send_hdrs_handle_);
  send_hdrs_handle_ = {};
}

void Mailbox::post_header_recv(int peer) {
  Peer& p = peers_[peer];
  if (!p.failed.ok()) return;
  Future f;
  try {
    f = p.ep.recv(p.hdr_handle, 0, sizeof(Header));
  } catch (const Error& e) {
    fail_peer(peer, e.status());
    return;
  }
  f.on_complete([this, peer, f](const Status& st) {
    Status s = st;
    if (s.ok() && f.bytes() != sizeof(Header))
      s = {ErrorCode::kProtocol, "a message header of " + std::to_string(f.bytes()) + " bytes"};
    post([this, peer, s] { on_header(peer, s); });
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
}

void Mailbox::on_header(int peer, const Status& st) {
  Peer& p = peers_[peer];
  if (!st.ok()) {
    fail_peer(peer, st);
    return;
  }
  const Header h = p.hdr;
  // Match the first posted recv (posting order) that accepts this source and tag.
  std::shared_ptr<PostedRecv> match;
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (((*it)->src == peer || (*it)->src == kAnySource) && (*it)->tag == h.tag) {
      match = *it;
      posted_.erase(it);
      break;
    }
  }
  if (match && match->n == h.length) {
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
    if (match) {
      Status bad{ErrorCode::kTruncated, who(peer) + " sent " + std::to_string(h.length) + " bytes with tag " +
                                            std::to_string(h.tag) + " to a recv of " + std::to_string(match->n) +
                                            " bytes (tensor sizes must match)"};
      match->done(bad, peer, 0);
    }
    if (h.length == 0) {
      u->arrived = true;
      unexpected_.push_back(u);
    } else {
      u->data.resize(h.length);
      Future f;
      try {
        u->handle = reg(u->data.data(), h.length);
        f = p.ep.recv(u->handle, 0, h.length);
      } catch (const Error& e) {
        unreg(u->handle);
        fail_peer(peer, e.status());
        return;
      }
      unexpected_.push_back(u);
      f.on_complete([this, u, peer](const Status& s) {
        post([this, u, peer, s] {
          u->arrived = true;
          u->status = s.ok() ? s : Status{s.code, who(peer) + ": " + s.message};
          unreg(u->handle);
          u->handle = {};
          if (u->waiter) {
            auto w = u->waiter;
            unexpected_.remove(u);
            deliver(*u, *w);
          }
          if (!s.ok()) fail_peer(peer, s);
        });
      });
    }
    if (match) unexpected_.remove(u);  // the mismatched message is consumed, not kept
  }
  post_header_recv(peer);
}

void Mailbox::deliver(Unexpected& u, PostedRecv& r) {
  if (!u.status.ok()) {
    r.done(u.status, u.src, 0);
  } else if (u.length != r.n) {
    r.done({ErrorCode::kTruncated, who(u.src) + " sent " + std::to_string(u.length) + " bytes to a recv of " +
                                       std::to_string(r.n) + " bytes (tensor sizes must match)"},
           u.src, 0);
  } else {
    if (u.length) std::memcpy(r.ptr, u.data.data(), u.length);
    r.done(Status::Ok(), u.src, u.length);
  }
}

void Mailbox::recv(int src, uint64_t tag, void* ptr, uint64_t n, Done done) {
  if (src != kAnySource && (src < 0 || src >= static_cast<int>(peers_.size()) || !peers_[src].ep.valid()))
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": recv from invalid rank " +
                                                 std::to_string(src));
  auto r = std::make_shared<PostedRecv>(PostedRecv{src, tag, ptr, n, std::move(done), Clock::now()});
  post([this, r] {
    r->deadline = Clock::now() + timeout_;
    for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
      auto u = *it;
      if ((r->src == u->src || r->src == kAnySource) && u->tag == r->tag && !u->waiter) {
        if (u->arrived) {
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
    posted_.push_back(r);
  });
}

void Mailbox::send(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done) {
  if (dst < 0 || dst >= static_cast<int>(peers_.size()) || !peers_[dst].ep.valid())
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": send to invalid rank " +
                                                 std::to_string(dst));
  post([this, dst, tag, ptr, n, done = std::move(done)]() mutable {
    Peer& p = peers_[dst];
    if (!p.failed.ok()) {
      done(p.failed, dst, 0);
      return;
    }
    auto s = std::make_shared<SendState>();
    s->n = n;
    s->done = std::move(done);
    MemoryHandle hh;
    uint64_t hoff = 0;
    if (!free_hdrs_.empty()) {
      s->slot = free_hdrs_.back();
      free_hdrs_.pop_back();
      send_hdrs_[s->slot] = {tag, n};
      hh = send_hdrs_handle_;
      hoff = uint64_t(s->slot) * sizeof(Header);
    } else {
      s->own_hdr = std::make_unique<std::array<uint64_t, 2>>(std::array<uint64_t, 2>{tag, n});
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
    try {
      Future fh = p.ep.send(hh, hoff, sizeof(Header));
      ++submitted;
      fh.on_complete([this, finish](const Status& st) { post([finish, st] { finish(st); }); });
      if (n) {
        s->payload = reg(ptr, n);
        Future fp = p.ep.send(s->payload, 0, n);
        ++submitted;
        fp.on_complete([this, finish](const Status& st) { post([finish, st] { finish(st); }); });
      }
    } catch (const Error& e) {
      // The callbacks of what was submitted run later on this thread (they are queued), so
      // one more finish() here accounts for everything that was not.
      s->remaining = submitted + 1;
      finish(e.status());
    }
  });
}

void Mailbox::expire() {
  auto now = Clock::now();
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->deadline <= now) {
      auto r = *it;
      it = posted_.erase(it);
      std::string from = r->src == kAnySource ? "any peer rank" : "peer rank " + std::to_string(r->src);
      // Collectives use the top half of the tag space (see SluiceBackend::enqueue): name the
      // collective's sequence number there rather than a 19-digit tag.
      std::string what = (r->tag >> 63) ? "collective #" + std::to_string((r->tag >> 16) & ((uint64_t(1) << 47) - 1))
                                        : "tag " + std::to_string(r->tag);
      r->done({ErrorCode::kTimeout, "rank " + std::to_string(rank_) + ": no message from " + from + " (" + what +
                                        ") within the group timeout of " + std::to_string(timeout_.count()) + " ms"},
              r->src, 0);
    } else {
      ++it;
    }
  }
}

}  // namespace sluice::torch_backend
