// Operations a transport endpoint has in flight, by token, plus sends awaiting their ack.
// Completing, failing and timing them out is the same for every transport.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
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
  bool lane_done(uint64_t token, const Status& st);
  bool note_error(uint64_t token, const Status& st);
  std::shared_ptr<MessageOp> take_send(uint64_t seq);
  // Fail everything now and everything added later.
  void fail_all(const Status& why);

  size_t size() const { return count_.load(std::memory_order_relaxed); }
  void touch() { last_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  Clock::time_point last_progress() const { return Clock::time_point(Clock::duration(last_.load())); }

 private:
  // Ops live in reusable slots (no allocation or hashing per op). A token is the slot's index
  // and its generation (bumped on every reuse, never 0), so a stale or forged token from a
  // peer's response or an old completion never finds a later op.
  struct Slot {
    std::shared_ptr<TransferOp> op;
    uint32_t gen = 0;
  };
  static uint64_t token_of(uint32_t index, uint32_t gen) { return uint64_t(gen) << 32 | index; }
  Slot* slot_locked(uint64_t token);
  std::shared_ptr<TransferOp> take_locked(uint64_t token);

  mutable std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::unordered_map<uint64_t, std::shared_ptr<MessageOp>> sends_;
  std::atomic<size_t> count_{0};
  std::atomic<Clock::rep> last_{Clock::now().time_since_epoch().count()};
  Status failed_;
};

}  // namespace sluice::detail
