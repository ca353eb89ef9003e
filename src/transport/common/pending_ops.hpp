// Operations a transport endpoint has in flight, by token, plus sends awaiting their ack.
// Completing, failing and timing them out is the same for every transport.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/transport.hpp"

namespace sluice::detail {

class PendingOps {
 public:
  using Clock = std::chrono::steady_clock;

  // Returns 0 (and completes the op with `failed`) if the table was already failed.
  uint64_t add(std::shared_ptr<TransferOp> op);
  bool add_send(std::shared_ptr<MessageOp> op);
  std::shared_ptr<TransferOp> find(uint64_t token);
  // One lane of `token` finished; completes and forgets the op after its last lane.
  // Returns false if the token is unknown (a forged or stale response).
  // `lane` (>= 0): which lane, noted in the op's done_lanes (channel failover, open_on).
  bool lane_done(uint64_t token, const Status& st, int lane = -1);
  bool note_error(uint64_t token, const Status& st);
  std::shared_ptr<MessageOp> take_send(uint64_t seq);
  // The send `seq` still waiting for its answer, left pending; null if there is none.
  std::shared_ptr<MessageOp> find_send(uint64_t seq);
  // Fail everything now and everything added later.
  void fail_all(const Status& why);
  // Ops of the thin post path (TransferOp::post set, no future) complete through `handler`
  // (called without the table's lock, with the op's first error), for every way an op ends:
  // its lane done, expire(), fail_all(). Set once, before the first post is added.
  using PostHandler = std::function<void(const std::shared_ptr<TransferOp>&, const Status&)>;
  void set_post_handler(PostHandler handler) { post_handler_ = std::move(handler); }

  // Channel failover: the ops (with their tokens) whose lane `lane` was posted and has not
  // finished (in slot order); and how many sends await their ack.
  std::vector<std::pair<uint64_t, std::shared_ptr<TransferOp>>> open_on(int lane);
  size_t sends() const;
  // Since when lane `lane` has owed answers: the earliest submission among the ops open on it
  // (and, for lane 0, the sends awaiting their ack); time_point::max() if it owes nothing. A
  // channel idle before that was not silent towards anyone (the tcp watchdog, stall_rule.hpp).
  Clock::time_point owed_since(int lane) const;

  size_t size() const { return count_.load(std::memory_order_relaxed); }
  // Endpoint-level stamp: the peer did something (kept for transports' own bookkeeping; it no
  // longer keeps any one operation alive, see expire()).
  void touch() { last_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  Clock::time_point last_progress() const { return Clock::time_point(Clock::duration(last_.load())); }
  // Operation `token` (or send `seq` with progress_send) made progress of its own: bytes of
  // its frames accepted by the socket, bytes of its read responses arrived. lane_done() and
  // note_error() count as progress too. Unknown tokens are ignored.
  void progress(uint64_t token);
  void progress_send(uint64_t seq);
  // Per-operation deadlines: fails (kTimeout) every op and send that has seen no progress of
  // its own for `timeout`, and returns how many it failed (0: none). A peer that keeps the
  // connection busy with other frames no longer keeps an unanswered op alive. *what (if given)
  // describes the first one failed. With fail=false nothing is failed, only counted: for a
  // transport that must stop its threads (which may still write into an op's memory) before
  // any op completes; it then fails everything through fail_all().
  // `alive` (optional, called under the table's lock for ops past their own deadline only;
  // nullptr stands for a send) may spare an op that waits behind work that is moving: a
  // transport whose answers come in order per channel passes "its channel is answering".
  using Alive = std::function<bool(const TransferOp*)>;
  size_t expire(Clock::time_point now, std::chrono::milliseconds timeout, std::string* what = nullptr,
                bool fail = true, const Alive& alive = {});

 private:
  // Ops live in reusable slots (no allocation or hashing per op). A token is the slot's index
  // and its generation (bumped on every reuse, never 0), so a stale or forged token from a
  // peer's response or an old completion never finds a later op.
  struct Slot {
    std::shared_ptr<TransferOp> op;
    uint32_t gen = 0;
    Clock::time_point last{};   // the op's own last progress (or its submission)
    Clock::time_point added{};  // its submission
  };
  struct SendSlot {
    std::shared_ptr<MessageOp> op;
    Clock::time_point last{};
    Clock::time_point added{};
  };
  static uint64_t token_of(uint32_t index, uint32_t gen) { return uint64_t(gen) << 32 | index; }
  // The slot's op has lane `bit` posted and not done (caller holds mu_): open_on, owed_since.
  static bool open_on_lane(const Slot& s, uint64_t bit) {
    return s.op && (s.op->posted_lanes.load(std::memory_order_acquire) & bit) && !(s.op->done_lanes & bit);
  }
  Slot* slot_locked(uint64_t token);
  // Completes `op` (its future, or a post through post_handler_) with `st`.
  void finish(const std::shared_ptr<TransferOp>& op, const Status& st);
  std::shared_ptr<TransferOp> take_locked(uint64_t token);

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::unordered_map<uint64_t, SendSlot> sends_;
  std::atomic<size_t> count_{0};
  std::atomic<Clock::rep> last_{Clock::now().time_since_epoch().count()};
  Status failed_;
  PostHandler post_handler_;
};

}  // namespace sluice::detail
