#include "core/message_matcher.hpp"

#include "core/device_hooks.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

namespace sluice::detail {
namespace {

Status truncation(uint64_t length, uint64_t capacity) {
  return {ErrorCode::kTruncated, "message of " + std::to_string(length) + " bytes does not fit the " +
                                     std::to_string(capacity) + "-byte receive buffer"};
}

// The stashed bytes (host memory) into the recv's buffer, which may be device memory (a tcp
// recv into a CUDA region: a host memcpy there was a segfault). Bytes stashed in place are
// copied by the transport that holds them (CreditSink::copy_held), if it is still there.
Status copy_into_recv(MessageOp& op, const StashSlot& msg, const uint8_t* src, uint64_t n) {
  const RegionEntry* e = op.pin.get();
  if (!e || e->location.is_host()) {
    auto holder = msg.held ? msg.sink.lock() : nullptr;
    if (holder)
      holder->copy_held(op.ptr, src, n);
    else
      std::memcpy(op.ptr, src, n);
    return Status::Ok();
  }
  const DeviceMemoryHooks* hooks = device_memory_hooks();
  if (!hooks || !hooks->upload)
    return {ErrorCode::kUnsupported, "recv into " + e->location.to_string() + " memory: this build cannot copy into it"};
  try {
    hooks->upload(op.ptr, src, n);
  } catch (const Error& err) {
    return err.status();
  }
  return Status::Ok();
}

}  // namespace

void MessageMatcher::finish_recv(MessageOp& op, const StashSlot& msg) {
  // A failed message hands over no bytes: its buffer may hold only part of them (and the
  // rest was never written).
  const uint64_t have = msg.held ? msg.length : std::min<uint64_t>(msg.length, msg.data.size());
  uint64_t n = msg.status.ok() ? std::min(op.length, have) : 0;
  const Status copied = n ? copy_into_recv(op, msg, msg.held ? msg.held : msg.data.data(), n) : Status::Ok();
  op.future->set_bytes(copied.ok() ? n : 0);
  if (!msg.status.ok())
    op.future->complete(msg.status);
  else if (!copied.ok())
    op.future->complete(copied);
  else if (msg.length > op.length)
    op.future->complete(truncation(msg.length, op.length));
  else
    op.future->complete(Status::Ok());
}

void MessageMatcher::give_back(StashSlot& slot, uint64_t credit, const std::weak_ptr<CreditSink>& sink) {
  if (!slot.held && !credit) return;
  auto s = sink.lock();
  if (!s) return;
  // Where the bytes were first (the transport may reuse that memory), then the credit: a
  // credit frame then names the freed room too.
  if (slot.held) s->release_held(slot.held_end);
  slot.held = nullptr;
  slot.held_keep.reset();
  if (credit) s->release_credit(credit);
}

void MessageMatcher::post_recv(std::shared_ptr<MessageOp> op) {
  std::shared_ptr<StashSlot> slot;
  uint64_t credit = 0;
  std::weak_ptr<CreditSink> sink;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.ok()) {
      op->future->complete(failed_);
      return;
    }
    op->seq = posted_++;
    if (unexpected_.empty()) {
      if (offerer_) offerer_->offer(*op, op->seq, incoming_);
      recvs_.push_back(std::move(op));
      return;
    }
    slot = std::move(unexpected_.front());
    unexpected_.pop_front();
    if (!slot->ready) {
      // Still landing: deliver() copies it into this recv and gives back what it held.
      slot->waiter = std::move(op);
      landing_.push_back(std::move(slot));  // so that fail_all() can reach the waiter
      return;
    }
    unexpected_bytes_ -= slot->reserved;
    credit = std::exchange(slot->credit, 0);
    sink = slot->sink;
  }
  finish_recv(*op, *slot);
  // The message is the recv's now: its sender may queue as much again.
  give_back(*slot, credit, sink);
  std::lock_guard<std::mutex> lk(mu_);  // the slot is ours alone now
  recycle_locked(std::move(slot->data));
}

void MessageMatcher::set_offerer(RecvOfferer* o) {
  std::lock_guard<std::mutex> lk(mu_);
  offerer_ = o;
}

void MessageMatcher::clear_offerer(RecvOfferer* o) {
  std::lock_guard<std::mutex> lk(mu_);
  if (offerer_ == o) offerer_ = nullptr;
}

void MessageMatcher::recycle_locked(Buffer&& b) {
  if (b.capacity() == 0 || b.capacity() > kSpareMaxBuffer || spare_bytes_ + b.capacity() > kSpareBytes) return;
  b.clear();  // keeps the capacity (and, with UninitAllocator, writes nothing)
  spare_bytes_ += b.capacity();
  spare_.push_back(std::move(b));
}

MessageMatcher::Claim MessageMatcher::claim(uint64_t seq, uint64_t length, bool lazy, uint64_t credit,
                                            std::weak_ptr<CreditSink> sink) {
  Claim c;
  c.seq = seq;
  c.length = length;
  std::lock_guard<std::mutex> lk(mu_);
  if (seq != incoming_) {
    c.error = {ErrorCode::kProtocol,
               "message sequence " + std::to_string(seq) + " arrived, expected " + std::to_string(incoming_)};
    return c;
  }
  if (recvs_.empty() && unexpected_.size() >= max_messages_) {
    c.error = {ErrorCode::kProtocol, "peer sent more than max_unexpected_messages (" + std::to_string(max_messages_) +
                                         ") messages that no recv matched; refusing the peer"};
    return c;
  }
  ++incoming_;
  if (!recvs_.empty()) {
    c.recv = std::move(recvs_.front());
    recvs_.pop_front();
    if (c.recv->expired) {
      // Its recv gave up (recv_timeout): the message is drained and its sender told.
      c.recv.reset();
      c.error = {ErrorCode::kRemoteError, "the receiver's recv for message " + std::to_string(seq) +
                                              " timed out (recv_timeout) before the message arrived; it was dropped"};
      return c;
    }
    c.dest = c.recv->ptr;
    c.capacity = c.recv->length;
    return c;
  }
  auto slot = std::make_shared<StashSlot>();
  slot->length = length;
  if (!credit && unexpected_bytes_ + length > max_unexpected_) {
    // The message still takes its sequence number so that later ones match correctly; the
    // recv it would have matched fails with this error.
    slot->status = {ErrorCode::kRemoteError, "receiver had no recv posted and its unexpected-message buffer (" +
                                                 std::to_string(max_unexpected_) + " bytes) is full"};
    slot->ready = true;
    c.error = slot->status;
    unexpected_.push_back(std::move(slot));
    return c;
  }
  // A spare buffer that holds the whole message, if there is one (stash_room grows any other).
  // The last few only (the newest fits in a stream of equal messages): a bounded scan under mu_.
  for (size_t i = spare_.size(), seen = 0; length && i-- > 0 && seen++ < 8;)
    if (spare_[i].capacity() >= length) {
      spare_bytes_ -= spare_[i].capacity();
      slot->data = std::move(spare_[i]);
      spare_[i] = std::move(spare_.back());
      spare_.pop_back();
      break;
    }
  if (!lazy) slot->data.resize(length);
  slot->reserved = length;
  slot->credit = credit;
  slot->sink = std::move(sink);
  unexpected_bytes_ += length;
  c.dest = lazy ? nullptr : slot->data.data();
  c.capacity = length;
  c.stash = slot;
  unexpected_.push_back(std::move(slot));
  return c;
}

Status MessageMatcher::sender_status(const Claim& c, const Status& transfer) {
  if (c.recv) return transfer.ok() && c.length > c.capacity ? truncation(c.length, c.capacity) : transfer;
  if (c.stash) return transfer;
  return c.error.ok() ? transfer : c.error;
}

Status MessageMatcher::deliver(Claim& c, const Status& transfer) {
  if (c.recv) {
    uint64_t n = std::min(c.length, c.capacity);
    c.recv->future->set_bytes(n);
    Status st = transfer;
    if (st.ok() && c.length > c.capacity) st = truncation(c.length, c.capacity);
    c.recv->future->complete(st);
    c.recv.reset();
    return st;
  }
  if (c.stash) {
    std::shared_ptr<MessageOp> waiter;
    uint64_t credit = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      c.stash->status = transfer;
      c.stash->ready = true;
      waiter = std::move(c.stash->waiter);
      if (waiter) {
        unexpected_bytes_ -= c.stash->reserved;
        credit = std::exchange(c.stash->credit, 0);
      }
      std::erase(landing_, c.stash);
    }
    if (waiter) {
      finish_recv(*waiter, *c.stash);
      give_back(*c.stash, credit, c.stash->sink);
      std::lock_guard<std::mutex> lk(mu_);  // matched and read: nobody else reads the slot
      recycle_locked(std::move(c.stash->data));
    }
    c.stash.reset();
    return transfer;
  }
  return c.error.ok() ? transfer : c.error;
}

uint8_t* MessageMatcher::stash_room(Claim& c, uint64_t size) {
  // Only the claiming transport thread touches the buffer until deliver() marks it ready.
  auto& d = c.stash->data;
  if (d.size() < size) {
    if (d.capacity() < size) d.reserve(std::min<uint64_t>(c.capacity, std::max<uint64_t>(size, 2 * d.capacity())));
    d.resize(size);
  }
  return d.data();
}

size_t MessageMatcher::expire(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout) {
  std::vector<std::shared_ptr<MessageOp>> recvs, taken;
  std::vector<std::shared_ptr<FutureState>> imms;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failed_.ok()) return 0;
    // Posted in order, so the first one still within its deadline ends the scan.
    for (auto& r : recvs_) {
      if (r->expired) continue;
      if (now - r->future->started() < timeout) break;
      if (r->offer_word) {
        uint64_t open = r->offer_open;
        if (!std::atomic_ref<uint64_t>(*r->offer_word).compare_exchange_strong(open, r->offer_revoked)) {
          // The sender took the offer: its copy is bounded and its frame follows it. Only a
          // sender stopped in the middle gets here twice the timeout later.
          if (now - r->future->started() < 2 * timeout) continue;
          taken.push_back(r);
        }
        r->offer_word = nullptr;
        r->offer_keep.reset();
      }
      r->expired = true;
      r->pin.release();  // the user may free or reuse the buffer once the future fails
      recvs.push_back(r);
    }
    while (!imm_waiters_.empty() && now - imm_waiters_.front()->started() >= timeout) {
      imms.push_back(std::move(imm_waiters_.front()));
      imm_waiters_.pop_front();
    }
  }
  if (recvs.empty() && imms.empty()) return 0;
  const std::string limit = std::to_string(timeout.count()) + " ms (recv_timeout)";
  for (auto& r : recvs)
    r->future->complete(std::find(taken.begin(), taken.end(), r) != taken.end()
                            ? Status{ErrorCode::kTimeout, "recv: its sender took it (a recv offer) and did not say it "
                                                          "finished within twice " + limit + "; its buffer may still be written"}
                            : Status{ErrorCode::kTimeout, "recv: no message arrived for it within " + limit});
  for (auto& f : imms) f->complete({ErrorCode::kTimeout, "imm_recv: no imm arrived within " + limit});
  return recvs.size() + imms.size();
}

void MessageMatcher::push_imm(uint32_t imm) {
  std::shared_ptr<FutureState> w;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (imm_waiters_.empty()) {
      imms_.push_back(imm);
      return;
    }
    w = std::move(imm_waiters_.front());
    imm_waiters_.pop_front();
  }
  w->set_imm(imm);
  w->complete(Status::Ok());
}

std::shared_ptr<FutureState> MessageMatcher::imm_recv() {
  auto f = std::make_shared<FutureState>(OpKind::kImmRecv);
  std::unique_lock<std::mutex> lk(mu_);
  if (!imms_.empty()) {
    uint32_t v = imms_.front();
    imms_.pop_front();
    lk.unlock();
    f->set_imm(v);
    f->complete(Status::Ok());
  } else if (!failed_.ok()) {
    lk.unlock();
    f->complete(failed_);
  } else {
    imm_waiters_.push_back(f);
  }
  return f;
}

void MessageMatcher::fail_all(const Status& why) {
  std::deque<std::shared_ptr<MessageOp>> recvs;
  std::vector<std::shared_ptr<MessageOp>> taken;
  std::deque<std::shared_ptr<FutureState>> waiters;
  std::vector<std::shared_ptr<MessageOp>> stash_waiters;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_.ok()) failed_ = why;
    recvs.swap(recvs_);
    // Offers not yet taken are withdrawn, so that a sender still running copies into none of
    // these buffers once they failed. A sender that took its offer first may still be copying
    // (a local close or a protocol error does not stop a live peer): its recv's failure says
    // so, as an expired one's does, since the user may reuse the buffer once it failed.
    for (auto& r : recvs)
      if (r->offer_word) {
        uint64_t open = r->offer_open;
        if (!std::atomic_ref<uint64_t>(*r->offer_word).compare_exchange_strong(open, r->offer_revoked))
          taken.push_back(r);
        r->offer_word = nullptr;
        r->offer_keep.reset();
      }
    waiters.swap(imm_waiters_);
    for (auto& s : unexpected_)
      if (s->waiter) stash_waiters.push_back(std::move(s->waiter));
    for (auto& s : landing_)
      if (s->waiter) stash_waiters.push_back(std::move(s->waiter));
    landing_.clear();
  }
  for (auto& r : recvs)
    r->future->complete(std::find(taken.begin(), taken.end(), r) == taken.end()
                            ? why
                            : Status{why.code, why.message + " (its sender had taken this recv's offer and "
                                                             "may still write its buffer)"});
  for (auto& r : stash_waiters) r->future->complete(why);
  for (auto& w : waiters) w->complete(why);
}

}  // namespace sluice::detail
