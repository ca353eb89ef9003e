// Two-sided matching for one endpoint: the k-th incoming message goes to the k-th posted recv.
// Messages that arrive before their recv are buffered (bounded); imm values are queued the
// same way for imm_recv().
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "core/future_state.hpp"
#include "core/registry.hpp"

namespace sluice::detail {

// Takes back the credit of an eager message (one its sender completed as soon as it was
// queued, within buffer space this side granted) once a recv has taken the message.
class CreditSink {
 public:
  virtual ~CreditSink() = default;
  virtual void release_credit(uint64_t bytes) = 0;
  // A message stashed in place (StashSlot::held) was copied out: its bytes up to `end` in the
  // transport's memory may be reused. Called before release_credit() for the same message.
  virtual void release_held(uint64_t end) { (void)end; }
  // Copies n bytes of a message stashed in place (StashSlot::held) into a host recv: the
  // transport that holds that memory knows how best to copy out of it (shm streams large
  // copies out of its eager ring, bulk_copy.hpp).
  virtual void copy_held(void* dst, const void* src, uint64_t n) { std::memcpy(dst, src, n); }
};

// A message that arrived before its recv; `ready` once all its bytes have landed. A recv
// posted before then waits in `waiter`.
// Leaves new elements uninitialised: a stash buffer is written in full by the copy that
// follows, and zeroing it first was 6% of a 64 KiB eager SEND stream's profile.
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

struct StashSlot {
  // Grows as bytes land (lazy claims) or sized at claim; only bytes a copy wrote are ever read
  // (finish_recv reads at most `length`, and a failed message is never read).
  std::vector<uint8_t, UninitAllocator<uint8_t>> data;
  uint64_t length = 0;
  uint64_t reserved = 0;  // bytes of the unexpected budget it holds (its announced length)
  Status status;
  bool ready = false;
  std::shared_ptr<struct MessageOp> waiter;
  // An eager message's credit, released to `sink` when a recv takes the message.
  uint64_t credit = 0;
  std::weak_ptr<CreditSink> sink;
  // Bytes stashed in place instead of in `data` (shm's eager ring): the recv that takes the
  // message copies them straight from there, then `sink` gets release_held(held_end). A copy
  // into a stash buffer first was a third copy of every message that arrived before its recv
  // (and, for a fresh buffer, a page fault per 4 KiB).
  const uint8_t* held = nullptr;
  uint64_t held_end = 0;
  std::shared_ptr<const void> held_keep;  // keeps that memory mapped while the slot may read it
};

struct MessageOp {
  uint8_t* ptr = nullptr;
  uint64_t length = 0;
  uint64_t seq = 0;
  OpOptions options;  // validated against the transport's capabilities before submit
  std::shared_ptr<FutureState> future;
  RegionPin pin;
  // recv_timeout passed before any message matched it: the future failed and the pin is
  // released, but the recv keeps its sequence slot so that its late message is drained (and
  // its sender told) instead of landing in the next recv.
  bool expired = false;
  // Offered to its sender ahead of the message (RecvOfferer), through a word in memory both
  // sides share: `offer_open` while the offer stands. A sender that took it may be copying
  // into the buffer, so the recv expires only once expire() turned the word from
  // `offer_open` to `offer_revoked`. Set under the matcher's lock; offer_keep keeps the word
  // mapped.
  uint64_t* offer_word = nullptr;
  uint64_t offer_open = 0, offer_revoked = 0;
  std::shared_ptr<const void> offer_keep;
};

// A transport that hands a recv waiting for its message to the sender ahead of it (shm's recv
// offers), so that the sender copies straight into the recv's buffer. offer() runs under the
// matcher's lock and must not call back into the matcher.
class RecvOfferer {
 public:
  virtual ~RecvOfferer() = default;
  // `recv` will take message `seq`; `incoming` messages were claimed so far.
  virtual void offer(MessageOp& recv, uint64_t seq, uint64_t incoming) = 0;
};

class MessageMatcher {
 public:
  // max_unexpected_messages bounds the count of buffered unmatched messages (zero-length ones
  // included): every one holds a sequence slot, so past the bound the peer cannot be refused
  // one message at a time and claim() fails the endpoint (kProtocol) instead.
  explicit MessageMatcher(uint64_t max_unexpected_bytes, uint64_t max_unexpected_messages = UINT64_MAX)
      : max_unexpected_(max_unexpected_bytes), max_messages_(max_unexpected_messages) {}

  // Where the bytes of incoming message `seq` go. Messages must arrive in order.
  struct Claim {
    uint64_t seq = 0;
    uint64_t length = 0;     // the message length the sender announced
    uint8_t* dest = nullptr;  // write min(length, capacity) bytes here; drain the rest
    uint64_t capacity = 0;
    std::shared_ptr<MessageOp> recv;  // a posted recv, or
    std::shared_ptr<struct StashSlot> stash;  // a buffer for a recv not yet posted
    Status error;  // set when the message cannot be taken at all (out of order, no room)
  };

  void post_recv(std::shared_ptr<MessageOp> op);
  // Recvs posted from now on that wait for their message go to `o` (one at a time; not owned:
  // the transport clears it, with clear_offerer, before it goes away).
  void set_offerer(RecvOfferer* o);
  void clear_offerer(RecvOfferer* o);  // only if `o` is the one set
  // The sequence number the next claim() must name.
  uint64_t next_incoming() {
    std::lock_guard<std::mutex> lk(mu_);
    return incoming_;
  }
  // `lazy`: a stashed (unexpected) message gets no buffer yet (dest null, capacity = length):
  // the transport calls stash_room() as its bytes arrive, so memory follows real bytes and a
  // header announcing a huge message allocates nothing.
  // `credit`: an eager message, which its sender already completed within buffer space this
  // side granted (shm.eager_credit bounds it): it is stashed even past
  // max_unexpected_bytes, since refusing it would tell nobody, and when stashed (c.stash set)
  // the slot holds `credit` bytes until a recv takes it, then gives them to `sink`.
  Claim claim(uint64_t seq, uint64_t length, bool lazy = false, uint64_t credit = 0,
              std::weak_ptr<CreditSink> sink = {});
  // Grows a lazy claim's stash buffer to `size` bytes (<= its length); returns its start.
  static uint8_t* stash_room(Claim& c, uint64_t size);
  // Receive deadlines: every recv and imm_recv that nothing matched for `timeout` completes
  // with kTimeout. Returns how many did. An offered recv whose sender took the offer is spared
  // (its message is on its way) until twice the timeout, then fails saying that its buffer
  // may still be written.
  size_t expire(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout);
  // What deliver() will report to the sender, without delivering: a transport can acknowledge
  // the sender before it completes the receiver's future (a receiver that closes as soon as
  // its recv completes must not leave the sender without its acknowledgement).
  static Status sender_status(const Claim& c, const Status& transfer);
  // Completes the claim once its bytes landed (or failed to). Returns the status for the sender.
  Status deliver(Claim& claim, const Status& transfer);

  void push_imm(uint32_t imm);
  std::shared_ptr<FutureState> imm_recv();

  // Fail every posted recv and imm_recv with `why`; later posts fail at once.
  void fail_all(const Status& why);

 private:
  using Buffer = decltype(StashSlot::data);
  static void finish_recv(MessageOp& op, const StashSlot& msg);
  // After finish_recv: hands the slot's in-place bytes and its credit back to `sink`.
  static void give_back(StashSlot& slot, uint64_t credit, const std::weak_ptr<CreditSink>& sink);
  // A stash buffer that was read goes back to spare_ (mu_ held), for the next unexpected
  // message: a fresh one was 16 page faults and the kernel zeroing every page of a 64 KiB
  // message (glibc gives a thread arena's freed top back to the kernel), 13% of the profile.
  void recycle_locked(Buffer&& b);
  // Kept: 4 MiB (a burst of unexpected messages that came in frames: tcp's, and shm's eager
  // ones sent while the peer's ring was full; shm's ring messages wait in the ring instead), in
  // buffers of at most 256 KiB (larger ones are freed).
  static constexpr uint64_t kSpareBytes = 4 << 20;
  static constexpr uint64_t kSpareMaxBuffer = 256 << 10;

  std::mutex mu_;
  const uint64_t max_unexpected_;
  const uint64_t max_messages_;
  uint64_t unexpected_bytes_ = 0;
  uint64_t posted_ = 0;    // recvs posted so far
  uint64_t incoming_ = 0;  // messages claimed so far
  std::deque<std::shared_ptr<MessageOp>> recvs_;  // posted, not yet claimed
  std::deque<std::shared_ptr<StashSlot>> unexpected_;  // claimed, not yet matched
  std::vector<Buffer> spare_;  // emptied stash buffers, with their capacity
  uint64_t spare_bytes_ = 0;   // their capacities
  std::vector<std::shared_ptr<StashSlot>> landing_;    // matched with a recv, bytes still landing
  std::deque<uint32_t> imms_;
  std::deque<std::shared_ptr<FutureState>> imm_waiters_;
  Status failed_;
  RecvOfferer* offerer_ = nullptr;
};

}  // namespace sluice::detail
