// Two-sided matching for one endpoint: the k-th incoming message goes to the k-th posted recv.
// Messages that arrive before their recv are buffered (bounded); imm values are queued the
// same way for imm_recv().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "core/future_state.hpp"
#include "core/registry.hpp"

namespace sluice::detail {

// A message that arrived before its recv; `ready` once all its bytes have landed. A recv
// posted before then waits in `waiter`.
struct StashSlot {
  std::vector<uint8_t> data;
  uint64_t length = 0;
  Status status;
  bool ready = false;
  std::shared_ptr<struct MessageOp> waiter;
};

struct MessageOp {
  uint8_t* ptr = nullptr;
  uint64_t length = 0;
  uint64_t seq = 0;
  std::shared_ptr<FutureState> future;
  RegionPin pin;
};

class MessageMatcher {
 public:
  explicit MessageMatcher(uint64_t max_unexpected_bytes) : max_unexpected_(max_unexpected_bytes) {}

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
  Claim claim(uint64_t seq, uint64_t length);
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
  static void finish_recv(MessageOp& op, const StashSlot& msg);

  std::mutex mu_;
  const uint64_t max_unexpected_;
  uint64_t unexpected_bytes_ = 0;
  uint64_t posted_ = 0;    // recvs posted so far
  uint64_t incoming_ = 0;  // messages claimed so far
  std::deque<std::shared_ptr<MessageOp>> recvs_;  // posted, not yet claimed
  std::deque<std::shared_ptr<StashSlot>> unexpected_;  // claimed, not yet matched
  std::vector<std::shared_ptr<StashSlot>> landing_;    // matched with a recv, bytes still landing
  std::deque<uint32_t> imms_;
  std::deque<std::shared_ptr<FutureState>> imm_waiters_;
  Status failed_;
};

}  // namespace sluice::detail
