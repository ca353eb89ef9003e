// Recv offers (shm.recv_offers; docs/wire-protocol.md, "Recv offers"): a posted recv that
// waits for its message is written into an offer slot of the receiver's eager ring, which its
// peer has mapped. A sender whose rendezvous SEND finds the offer for its message turns the
// slot's word from offered to taken, copies into its own mapping of the recv's buffer (an
// engine-allocated region of the receiver, described and mapped like a write's destination),
// sends one SEND_PUT frame and completes: no wake-up of either side before the sender's
// completion, where a SEND_RTS woke the receiver and its SEND_ACK woke the sender back.
//
// What each side can do to the other is no more than before:
// - the receiver's slots name a region of its own and an offset and capacity in it; the
//   sender copies only inside its mapping of that region as the receiver described it over
//   the authenticated socket, inside the region's lease, so a wrong slot costs the receiver
//   its own bytes (or the sender its speed: it falls back to SEND_RTS);
// - the sender writes only into a region the receiver registered and mapped for it (which it
//   could WRITE into anyway); a SEND_PUT the receiver did not offer, or that is longer than
//   the buffer it offered, fails the endpoint;
// - a recv that gives up (recv_timeout, or its endpoint failing or closing) first turns its
//   slot's word from offered to revoked; if the sender took it first, the recv waits for its
//   SEND_PUT (up to twice recv_timeout), or fails saying that its buffer may still be written
//   (MessageMatcher::expire, fail_all).
// Only SENDs up to shm.recv_offer_max: the sending thread copies alone, where SEND_RTS splits
// a large message over the receiver's copy pool. (Cut into parts over the copy pool as well,
// a lone 1 MiB SEND ran 16 % faster with memcpy, but once copies stream (bulk_copy.hpp) two
// parts of 1 MiB ran no faster than one copy of 2 MiB on 2 vCPUs, and two of 512 KiB slower:
// docs/peers.md, "Streaming stores".)
#include <cstring>
#include <thread>

#include "core/log.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/shm/bulk_copy.hpp"
#include "transport/shm/held_leases.hpp"
#include "transport/shm/shm_endpoint.hpp"
#include "transport/shm/shm_ring.hpp"
#include "transport/shm/shm_test_ring.hpp"

namespace sluice::detail::shm {
namespace {

std::atomic<uint64_t> g_puts{0};  // test_offered_sends()
std::atomic<OfferTamper> g_tamper{nullptr};  // set_test_offer_tamper()

// Region descriptions that offers may start (the receiver names the ids): past it such a SEND
// goes as SEND_RTS, as it would until the description arrives anyway.
constexpr size_t kOfferDescribes = 16;

}  // namespace

void ShmEndpoint::offer(MessageOp& recv, uint64_t seq, uint64_t incoming) {
  uint8_t* ring = rx_ring_.load(std::memory_order_acquire);
  if (!ring || rx_ring_offers_ == 0 || recv.length == 0) return;
  // Only engine-allocated host memory with a lease: the peer can map nothing else, and copies
  // into nothing it cannot lease.
  const RegionEntry* e = recv.pin.get();
  if (!e || e->memfd < 0 || !e->location.is_host() || e->lease_slot == kNoLease) return;
  std::lock_guard<std::mutex> lk(offers_mu_);
  OfferRecord& rec = rx_offers_[seq % rx_ring_offers_];
  if (rec.used && rec.seq >= incoming) return;  // the slot's earlier message has not come yet
  RecvOfferSlot& s = ring_offers(ring, rx_ring_size_, rx_ring_slots_)[seq % rx_ring_offers_];
  std::atomic_ref<uint64_t>(s.region).store(e->id, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.offset).store(static_cast<uint64_t>(recv.ptr - e->base), std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.capacity).store(recv.length, std::memory_order_relaxed);
  std::atomic_ref<uint64_t>(s.word).store(offer_word(seq, kOffered), std::memory_order_release);
  if (OfferTamper t = g_tamper.load(std::memory_order_relaxed)) t(s, seq);
  rec = {seq, &recv, recv.length, true};
  recv.offer_word = &s.word;
  recv.offer_open = offer_word(seq, kOffered);
  recv.offer_revoked = offer_word(seq, kRevoked);
  recv.offer_keep = rx_ring_map_;
}

bool ShmEndpoint::send_offered(const std::shared_ptr<MessageOp>& op) {
  if (offers_ == 0 || op->length == 0 || op->length > offer_max_ || !tx_ring_ready_.load(std::memory_order_acquire) ||
      tx_offers_ == 0 || failed())
    return false;
  const RegionEntry* mine = op->pin.get();
  if (mine && !mine->location.is_host()) return false;  // send() reports it
  RecvOfferSlot& s = ring_offers(tx_ring_->base, tx_data_, tx_slots_)[op->seq % tx_offers_];
  std::atomic_ref<uint64_t> word(s.word);
  uint64_t open = offer_word(op->seq, kOffered);
  if (word.load(std::memory_order_acquire) != open) return false;
  // Read once: the receiver may change the slot under us; what is checked is what is used.
  const uint64_t region = std::atomic_ref<uint64_t>(s.region).load(std::memory_order_relaxed);
  const uint64_t offset = std::atomic_ref<uint64_t>(s.offset).load(std::memory_order_relaxed);
  const uint64_t capacity = std::atomic_ref<uint64_t>(s.capacity).load(std::memory_order_relaxed);
  // A message longer than the recv goes as SEND_RTS, which reports the truncation to both.
  // The ring's own id names no region (and asking for it again would only be refused).
  if (op->length > capacity || region == kEagerRingId) return false;
  // Our SENDs still waiting for their SEND_ACK come first: this copy runs on the sending
  // thread, under the endpoint's send lock, and a batch's copies belong on the receiver's
  // copy pool (serve_rts), where they run in parallel.
  if (pending_.sends() != 0) return false;
  RemoteRegion rr;
  bool describe = false;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto it = regions_.find(region);
    if (it != regions_.end()) {
      rr = it->second;
    } else {
      describe = describing_.size() < kOfferDescribes && describing_.insert(region).second;
    }
  }
  if (describe) start_describe(region);  // learned once; this message goes as SEND_RTS
  if (!rr.map || !in_bounds(offset, op->length, rr.length)) return false;
  Held held(leases_);
  if (!held.enter(rr.slot, region, "the receiver's").ok()) return false;
  if (!word.compare_exchange_strong(open, offer_word(op->seq, kTaken), std::memory_order_acq_rel)) return false;
  // The message is this offer's now: the SEND_PUT below says how its copy went.
  if (put_delay_ms_) std::this_thread::sleep_for(std::chrono::milliseconds(put_delay_ms_));
  bulk_copy(rr.map->base + offset, op->ptr, op->length, stream_min_);
  const Status st = held.still("the receiver's");
  OutFrame f;
  f.text = st.message.substr(0, kMaxMessageText);
  f.hdr = make_frame(FrameType::kSendPut, op->seq, 0, 0, f.text.size(), 0, static_cast<uint32_t>(op->length),
                     static_cast<uint32_t>(op->length >> 32), static_cast<uint16_t>(st.code));
  const bool posted = control_->post(std::move(f));
  g_puts.fetch_add(1, std::memory_order_relaxed);
  if (!posted || control_->down() || failed())
    op->future->complete({ErrorCode::kPeerLost, "connection to peer lost before the SEND's frame left"});
  else
    op->future->complete(st);
  return true;
}

Status ShmEndpoint::serve_put(const FrameHeader& h, PayloadReader& payload) {
  const Status sent = frame_status(h, payload);
  const uint64_t seq = h.op_id, n = (uint64_t(h.aux) << 32) | h.imm;
  uint8_t* ring = rx_ring_.load(std::memory_order_acquire);
  if (!ring || rx_ring_offers_ == 0) return {ErrorCode::kProtocol, "SEND_PUT frame, but this side offered no recv"};
  OfferRecord rec;
  {
    std::lock_guard<std::mutex> lk(offers_mu_);
    rec = rx_offers_[seq % rx_ring_offers_];
  }
  RecvOfferSlot& s = ring_offers(ring, rx_ring_size_, rx_ring_slots_)[seq % rx_ring_offers_];
  const uint64_t word = std::atomic_ref<uint64_t>(s.word).load(std::memory_order_acquire);
  if (!rec.used || rec.seq != seq || word != offer_word(seq, kTaken))
    return {ErrorCode::kProtocol, "SEND_PUT for message " + std::to_string(seq) + ", whose recv this side did not "
                                      "offer (or withdrew)"};
  if (n > rec.capacity)
    return {ErrorCode::kProtocol, "SEND_PUT of " + std::to_string(n) + " bytes into a recv of " +
                                      std::to_string(rec.capacity) + " bytes"};
  auto claim = events_->matcher().claim(seq, n);
  if (claim.error.code == ErrorCode::kProtocol) return claim.error;
  if (claim.error.ok() && claim.recv.get() != rec.recv)
    return {ErrorCode::kProtocol, "SEND_PUT for message " + std::to_string(seq) + " that no offered recv waits for"};
  // The bytes are in the recv's buffer already (or, if the sender failed, whatever it wrote
  // there counts for nothing: the recv fails).
  events_->matcher().deliver(claim, sent);
  return Status::Ok();
}

uint64_t test_offered_sends() { return g_puts.load(std::memory_order_relaxed); }
void set_test_offer_tamper(OfferTamper f) { g_tamper.store(f, std::memory_order_relaxed); }

}  // namespace sluice::detail::shm
