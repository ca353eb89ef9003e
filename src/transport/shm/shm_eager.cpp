// Eager SENDs (shm.eager_max, shm.eager_credit): a small SEND completes once it is queued,
// within buffer space the receiver granted (CREDIT frames), with no round trip and no
// process_vm_readv. Its bytes go one of two ways:
// - through the receiver's eager ring: a memfd of its own (eager_credit + eager_max bytes,
//   sealed against resizing) that it passes to its peer alone, on request, over the
//   authenticated describe path. The sender copies the message into the ring and sends a
//   SEND_RING frame of 56 bytes; the receiver copies it out, into the posted recv or the
//   stash, as the frame arrives. Two memcpys instead of a copy into the socket and one out
//   of it, which for 64 KiB were most of the time a message took (perf: the socket's copy
//   into fresh skb pages alone was 22% of the profile). Both copies stream from
//   shm.stream_copy_min (bulk_copy.hpp): 64 KiB SENDs 64 x 8 moved 15-20% more, lone ones
//   10-25% (2 vCPUs, docs/peers.md), the ring and the recvs being too large for the cache to
//   keep what the other side reads next;
// - with the bytes in the SEND frame itself, until the ring is mapped or while it has no room.
// The receiver enforces its own grant and takes ring messages only at the position that
// follows the last one, so a peer that ignores either is refused; it never reads outside
// its ring, whatever a frame says.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "core/log.hpp"
#include "core/memfd.hpp"
#include "transport/shm/bulk_copy.hpp"
#include "transport/shm/shm_endpoint.hpp"
#include "transport/shm/shm_ring.hpp"
#include "transport/shm/shm_test_ring.hpp"

namespace sluice::detail::shm {
namespace {

std::atomic<uint64_t> g_ring_served{0};  // test_ring_messages_served()
std::atomic<uint64_t> g_ring_held{0};    // test_ring_messages_held()

// What an eager message holds of the receiver's grant: its bytes and its frame header, so
// that empty messages are bounded too.
uint64_t eager_cost(uint64_t length) { return length + sizeof(FrameHeader); }

// Where a message of n bytes starts in a ring of `size` bytes when the previous one ended at
// `pos` (positions only grow): at pos, or at the ring's start if it would not fit before its end.
uint64_t ring_place(uint64_t pos, uint64_t n, uint64_t size) {
  const uint64_t off = pos % size;
  return off + n > size ? pos + (size - off) : pos;
}

}  // namespace

void ShmEndpoint::grant_credit() {
  if (eager_max_ == 0 || eager_credit_ == 0) return;
  OutFrame f;
  f.hdr = make_frame(FrameType::kCredit, eager_credit_, eager_max_);
  control_->post(std::move(f));  // installed just before, never replaced
}

void ShmEndpoint::release_credit(uint64_t bytes) {
  eager_held_.fetch_sub(bytes, std::memory_order_relaxed);
  // Given back an eighth of the grant at a time: a frame per message cost each side a
  // system call or a wake-up per message. The sender holds at least 7/8 of the grant
  // meanwhile, and without credit it falls back to the rendezvous, so nothing waits for it.
  if (credit_owed_.fetch_add(bytes, std::memory_order_acq_rel) + bytes < std::max<uint64_t>(eager_credit_ / 8, 1)) return;
  const uint64_t owed = credit_owed_.exchange(0, std::memory_order_acq_rel);
  if (owed == 0) return;
  OutFrame f;
  // offset: everything in our ring before it was copied out, so that the sender may write
  // over it.
  f.hdr = make_frame(FrameType::kCredit, owed, 0, rx_ring_free_.load(std::memory_order_acquire));
  control_->post(std::move(f));  // an eager message came over it: installed
}

Status ShmEndpoint::take_credit(const FrameHeader& h) {
  if (h.region) {
    peer_eager_max_.store(h.region, std::memory_order_release);
    // The grant: ask for the peer's eager ring once (ring_described() maps it).
    if (ring_eager_ && !tx_ring_asked_.exchange(true)) start_describe(kEagerRingId);
  }
  // Never more queued than our own shm.eager_credit, whatever the peer grants: a peer that
  // grants much and reads nothing would otherwise have us hold its copies without bound.
  uint64_t have = send_credit_.load(std::memory_order_relaxed);
  while (!send_credit_.compare_exchange_weak(have, std::min(eager_credit_, have + std::min(h.op_id, eager_credit_)),
                                             std::memory_order_relaxed)) {
  }
  // The ring's tail only moves forward; a stale or wild value only costs ring room (send_ring
  // checks against it), never bytes of a message not yet copied out: that would need the
  // peer to lie about its own ring, which is its own loss.
  uint64_t tail = tx_tail_.load(std::memory_order_relaxed);
  while (h.offset > tail && !tx_tail_.compare_exchange_weak(tail, h.offset, std::memory_order_release)) {
  }
  return Status::Ok();
}

bool ShmEndpoint::send_eager(const std::shared_ptr<MessageOp>& op) {
  // CUDA pieces never get here (the StagingEndpoint in front sends a host copy).
  const uint64_t max = std::min(eager_max_, peer_eager_max_.load(std::memory_order_acquire));
  if (max == 0 || op->length > max || failed()) return false;
  const uint64_t cost = eager_cost(op->length);
  uint64_t have = send_credit_.load(std::memory_order_relaxed);
  do {
    if (have < cost) return false;  // the receiver has not taken enough yet: a rendezvous SEND
  } while (!send_credit_.compare_exchange_weak(have, have - cost, std::memory_order_relaxed));
  OutFrame f;
  bool framed = true;
  switch (place_in_ring(*op, &f.hdr)) {
    case Placed::kNo:
      f.hdr = make_frame(FrameType::kSend, op->seq, 0, 0, op->length);
      f.data = op->ptr;
      f.copy_unsent = true;  // copied only if the socket does not take it now: the caller may reuse its buffer
      break;
    case Placed::kQueued: framed = false; break;  // the receiver is looking: no frame, no wake-up
    case Placed::kFrame:
    case Placed::kBell: break;
  }
  // A grant came over the channel: installed. A peer that closed its end (the write tried at
  // once failed) or a channel already down drops the frame: such a send fails rather than
  // completing on bytes that went nowhere.
  const bool taken = !framed || control_->post(std::move(f));
  if (!taken || control_->down() || failed())
    op->future->complete({ErrorCode::kPeerLost, "connection to peer lost before the eager send left"});
  else
    op->future->complete(Status::Ok());
  return true;
}

ShmEndpoint::Placed ShmEndpoint::place_in_ring(const MessageOp& op, FrameHeader* hdr) {
  // Only send() calls this, under the endpoint's send lock (messages are numbered and handed
  // over in one step), so tx_head_, tx_desc_ and the frames' order need no lock of their own.
  if (!tx_ring_ready_.load(std::memory_order_acquire) || op.length == 0) return Placed::kNo;
  const uint64_t size = tx_data_;
  const uint64_t pos = ring_place(tx_head_, op.length, size);
  if (pos + op.length - tx_tail_.load(std::memory_order_acquire) > size) return Placed::kNo;  // no room yet
  bulk_copy(tx_ring_->base + pos % size, op.ptr, op.length, stream_min_);
  tx_head_ = pos + op.length;
  if (tx_slots_) {
    auto* desc = reinterpret_cast<RingDesc*>(tx_ring_->base + size);
    auto* ctl = reinterpret_cast<RingControl*>(desc + tx_slots_);
    if (tx_desc_ - std::atomic_ref<uint64_t>(ctl->consumed).load(std::memory_order_acquire) < tx_slots_) {
      RingDesc& d = desc[tx_desc_ % tx_slots_];
      std::atomic_ref<uint64_t>(d.seq).store(op.seq, std::memory_order_relaxed);
      std::atomic_ref<uint64_t>(d.length).store(op.length, std::memory_order_relaxed);
      std::atomic_ref<uint64_t>(d.pos).store(pos, std::memory_order_relaxed);
      std::atomic_ref<uint64_t>(d.stamp).store(++tx_desc_, std::memory_order_release);
      // Against the receiver's "awake = 0, then look once more" (drain_ring): either it sees
      // this descriptor, or this side sees 0 and rings. One ring per sleep: the first sender
      // to see 0 turns it to 1.
      std::atomic_thread_fence(std::memory_order_seq_cst);
      std::atomic_ref<uint64_t> awake(ctl->awake);
      uint64_t zero = 0;
      if (awake.load(std::memory_order_relaxed) != 0 || !awake.compare_exchange_strong(zero, 1)) return Placed::kQueued;
      *hdr = make_frame(FrameType::kRingBell, 0, 0, 0);
      return Placed::kBell;
    }
  }
  *hdr = make_frame(FrameType::kSendRing, op.seq, op.length, pos);  // the queue is full (or off)
  return Placed::kFrame;
}

void ShmEndpoint::ring_described(const Status& st, const nlohmann::json& r, int fd) {
  if (tx_ring_mapped_.exchange(true)) return;  // once (a lane naming the ring's id asks again)
  if (!st.ok() || r.contains("error") || !r.contains("length") || !r["length"].is_number_unsigned()) {
    SLUICE_LOG(kDebug, "shm: no eager ring from the peer (" << (st.ok() ? r.dump() : st.message)
                                                            << "); eager SENDs go in their frames");
    return;
  }
  const uint64_t size = r["length"].get<uint64_t>();
  // The layout (shm_ring.hpp): a data area, then `slots` descriptors and the receiver's words.
  // A peer that names no layout hands out a data area alone (its messages all come with frames).
  // One that names no offers makes none.
  uint64_t data = size, slots = 0, offers = 0;
  if (r.contains("data") || r.contains("slots")) {
    if (!r.value("data", nlohmann::json()).is_number_unsigned() || !r.value("slots", nlohmann::json()).is_number_unsigned() ||
        !r.value("offers", nlohmann::json(0)).is_number_unsigned())
      return;
    data = r["data"].get<uint64_t>();
    slots = r["slots"].get<uint64_t>();
    offers = r.value("offers", uint64_t{0});
    if (slots > (1u << 20) || offers > (1u << 16) || data % kRingAlign != 0 || data > size ||
        ring_total_bytes(data, slots, offers) != size)
      return;
  }
  // A ring smaller than the largest eager message it must hold would never have room; one
  // larger than our own grant plus a message is more than we ever queue, and mapping it
  // populated would have the peer decide how much memory we fault in (it then goes unused:
  // the SENDs go in their frames).
  const uint64_t peer_max = peer_eager_max_.load(std::memory_order_acquire);
  if (fd < 0 || data < peer_max || data > ring_data_bytes(eager_credit_, std::max(eager_max_, peer_max)) ||
      !same_host::is_memfd(fd, size))
    return;
  // Populated (the receiver made its pages when it handed the ring out): otherwise each of the
  // first messages, a page apart, paid a page fault on its way in.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) return;
  auto m = std::make_shared<Mapping>();
  m->base = static_cast<uint8_t*>(p);
  m->length = size;
  tx_ring_ = std::move(m);
  tx_data_ = data;
  tx_slots_ = slots;
  tx_offers_ = offers;
  tx_ring_ready_.store(true, std::memory_order_release);
}

int ShmEndpoint::eager_ring_fd(uint64_t* size, uint64_t* data, uint64_t* slots, uint64_t* offers) const {
  std::lock_guard<std::mutex> lk(rx_ring_mu_);
  if (!rx_ring_.load(std::memory_order_relaxed)) {
    const uint64_t d = ring_data_bytes(eager_credit_, eager_max_);
    const uint64_t n = ring_total_bytes(d, ring_slots_, offers_);
    // Allocated on the peer's first request: an endpoint that never receives eager SENDs costs
    // nothing. Sealed, so that the peer cannot shrink it under our reads (SIGBUS).
    int fd = sealed_memfd("sluice-eager-ring", n);
    if (fd < 0) throw Error(ErrorCode::kInternal, std::string("shm: eager ring: memfd: ") + std::strerror(errno));
    // Populated here, on the service thread that answers the peer's ask, before its first
    // message: a fresh page per 4 KiB message cost each side a fault (and this side zeroing
    // it) on the message's path, which made the first 4 MiB of small SENDs slower than
    // sending them through the socket.
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw Error(ErrorCode::kInternal, std::string("shm: eager ring: mmap: ") + std::strerror(errno));
    }
    rx_ring_map_ = std::make_shared<Mapping>();
    rx_ring_map_->base = static_cast<uint8_t*>(p);
    rx_ring_map_->length = n;
    rx_ring_fd_ = fd;
    rx_ring_size_ = d;
    rx_ring_slots_ = ring_slots_;
    rx_ring_offers_ = offers_;
    rx_offers_.assign(offers_, OfferRecord{});  // offer() reads them only once rx_ring_ is set
    rx_ring_.store(static_cast<uint8_t*>(p), std::memory_order_release);
  }
  *size = rx_ring_map_->length;
  *data = rx_ring_size_;
  *slots = rx_ring_slots_;
  *offers = rx_ring_offers_;
  return ::fcntl(rx_ring_fd_, F_DUPFD_CLOEXEC, 0);
}

Status ShmEndpoint::serve_eager(const FrameHeader& h, PayloadReader& payload) {
  const uint64_t cost = eager_cost(h.length);
  if (eager_max_ == 0 || eager_credit_ == 0 || h.length > eager_max_)
    return {ErrorCode::kProtocol, "eager SEND of " + std::to_string(h.length) + " bytes; this side takes at most " +
                                      std::to_string(eager_credit_ ? eager_max_ : 0) + " (shm.eager_max)"};
  const uint64_t held = eager_held_.fetch_add(cost, std::memory_order_relaxed) + cost;
  if (held > eager_credit_)
    return {ErrorCode::kProtocol, "peer queued " + std::to_string(held) + " bytes of eager SENDs that no recv took, "
                                      "beyond the " + std::to_string(eager_credit_) + " granted (shm.eager_credit)"};
  auto claim = events_->matcher().claim(h.op_id, h.length, /*lazy=*/true, cost, weak_from_this());
  if (claim.error.code == ErrorCode::kProtocol) return claim.error;
  const bool stashed = claim.stash != nullptr;  // then the stash holds the credit until a recv takes it
  Status st = claim.error;
  bool got = true;
  if (claim.stash) {
    uint8_t* buf = MessageMatcher::stash_room(claim, h.length);
    got = payload.read(buf, h.length);
  } else if (claim.dest) {
    // Into a recv's buffer: a failure of the endpoint waits for the copy (begin_copy).
    if (begin_copy()) {
      got = payload.read(claim.dest, std::min(h.length, claim.capacity));
      end_copy();
    } else {
      st = {ErrorCode::kCancelled, "endpoint closed"};
    }
  }  // whatever is left (past a short recv, or of a dropped message) the channel discards
  if (!got) st = {ErrorCode::kPeerLost, "connection lost mid-message"};
  events_->matcher().deliver(claim, st);
  if (!stashed) release_credit(cost);
  return got ? Status::Ok() : st;
}

Status ShmEndpoint::serve_ring(const FrameHeader& h) {
  // region: the message's length; offset: its position in our ring.
  return serve_ring_message(h.op_id, h.region, h.offset);
}

Status ShmEndpoint::drain_ring() {
  uint8_t* ring = rx_ring_.load(std::memory_order_acquire);
  if (!ring || rx_ring_slots_ == 0) return Status::Ok();
  auto* desc = reinterpret_cast<RingDesc*>(ring + rx_ring_size_);
  std::atomic_ref<uint64_t> awake(reinterpret_cast<RingControl*>(desc + rx_ring_slots_)->awake);
  std::atomic_ref<uint64_t> consumed(reinterpret_cast<RingControl*>(desc + rx_ring_slots_)->consumed);
  bool looked_again = false;
  for (;;) {
    RingDesc& d = desc[rx_desc_next_ % rx_ring_slots_];
    if (std::atomic_ref<uint64_t>(d.stamp).load(std::memory_order_acquire) != rx_desc_next_ + 1) {
      if (looked_again) return Status::Ok();
      // Empty: the sender rings from now on. Then one more look (see place_in_ring), since
      // a descriptor written just before it read `awake` gets no ring.
      awake.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      looked_again = true;
      continue;
    }
    if (looked_again) {
      awake.store(1, std::memory_order_relaxed);  // still taking: no need to ring
      looked_again = false;
    }
    // Read once: the sender may change the slot under us; what is checked is what is used.
    const uint64_t seq = std::atomic_ref<uint64_t>(d.seq).load(std::memory_order_relaxed);
    const uint64_t n = std::atomic_ref<uint64_t>(d.length).load(std::memory_order_relaxed);
    const uint64_t pos = std::atomic_ref<uint64_t>(d.pos).load(std::memory_order_relaxed);
    // Its turn has not come: a frame with an earlier message is still on the socket, and the
    // drain after it takes this one.
    if (seq != events_->matcher().next_incoming()) return Status::Ok();
    Status st = serve_ring_message(seq, n, pos);
    if (!st.ok()) return st;
    consumed.store(++rx_desc_next_, std::memory_order_release);
  }
}

Status ShmEndpoint::serve_ring_message(uint64_t seq, uint64_t n, uint64_t pos) {
  uint8_t* ring = rx_ring_.load(std::memory_order_acquire);
  if (!ring) return {ErrorCode::kProtocol, "SEND_RING frame, but this side gave the peer no eager ring"};
  if (eager_max_ == 0 || n == 0 || n > eager_max_)
    return {ErrorCode::kProtocol, "eager ring message of " + std::to_string(n) + " bytes; this side takes 1 to " +
                                      std::to_string(eager_max_) + " (shm.eager_max)"};
  // Only this channel's reader moves rx_ring_next_; the sender must have put the message where
  // it follows the last one, so a frame can name no other bytes of the ring (and none outside).
  const uint64_t next = rx_ring_next_.load(std::memory_order_relaxed);
  const uint64_t want = ring_place(next, n, rx_ring_size_);
  if (pos != want)
    return {ErrorCode::kProtocol, "eager ring message at position " + std::to_string(pos) + "; the next message goes at " +
                                      std::to_string(want)};
  const uint64_t cost = eager_cost(n);
  const uint64_t held = eager_held_.fetch_add(cost, std::memory_order_relaxed) + cost;
  if (held > eager_credit_)
    return {ErrorCode::kProtocol, "peer queued " + std::to_string(held) + " bytes of eager SENDs that no recv took, "
                                      "beyond the " + std::to_string(eager_credit_) + " granted (shm.eager_credit)"};
  auto claim = events_->matcher().claim(seq, n, /*lazy=*/true, cost, weak_from_this());
  if (claim.error.code == ErrorCode::kProtocol) return claim.error;
  const bool stashed = claim.stash != nullptr;
  Status st = claim.error;
  const uint8_t* src = ring + want % rx_ring_size_;
  const uint64_t end = want + n;
  if (claim.stash) {
    // No recv yet: the message stays in the ring until one takes it (the matcher's slot reads
    // it from here, then release_held), the room it holds counted in the peer's grant like
    // any stashed eager message.
    ring_hold(end);
    g_ring_held.fetch_add(1, std::memory_order_relaxed);
    claim.stash->held = src;
    claim.stash->held_end = end;
    claim.stash->held_keep = rx_ring_map_;
  } else {
    if (claim.dest) {
      if (begin_copy()) {
        bulk_copy(claim.dest, src, std::min(n, claim.capacity), stream_min_);
        end_copy();
      } else {
        st = {ErrorCode::kCancelled, "endpoint closed"};
      }
    }
    ring_done(end);  // copied out (or dropped): the sender may write over it
  }
  rx_ring_next_.store(end, std::memory_order_release);
  g_ring_served.fetch_add(1, std::memory_order_relaxed);
  events_->matcher().deliver(claim, st);
  if (!stashed) release_credit(cost);
  return Status::Ok();
}

void ShmEndpoint::ring_hold(uint64_t end) {
  std::lock_guard<std::mutex> lk(rx_hold_mu_);
  rx_held_.emplace_back(end, false);
}

void ShmEndpoint::ring_done(uint64_t end) {
  std::lock_guard<std::mutex> lk(rx_hold_mu_);
  if (rx_held_.empty()) {  // the common case: nothing held, in order
    rx_ring_free_.store(end, std::memory_order_release);
    return;
  }
  // Held ones are usually taken oldest first; the scan stops at the first match.
  bool found = false;
  for (auto& h : rx_held_)
    if (h.first == end) {
      h.second = true;
      found = true;
      break;
    }
  if (!found) rx_held_.emplace_back(end, true);  // copied out at once, behind held ones
  uint64_t free = rx_ring_free_.load(std::memory_order_relaxed);
  while (!rx_held_.empty() && rx_held_.front().second) {
    free = rx_held_.front().first;
    rx_held_.pop_front();
  }
  rx_ring_free_.store(free, std::memory_order_release);
}

void ShmEndpoint::release_held(uint64_t end) { ring_done(end); }

// A ring message a recv took after it landed: out of the ring into the recv, streamed like the
// copy of one that found its recv posted (serve_ring_message).
void ShmEndpoint::copy_held(void* dst, const void* src, uint64_t n) { bulk_copy(dst, src, n, stream_min_); }

uint64_t test_ring_messages_served() { return g_ring_served.load(std::memory_order_relaxed); }
uint64_t test_ring_messages_held() { return g_ring_held.load(std::memory_order_relaxed); }

}  // namespace sluice::detail::shm
