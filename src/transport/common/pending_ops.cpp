#include "transport/common/pending_ops.hpp"

#include <vector>

namespace sluice::detail {

uint64_t PendingOps::add(std::shared_ptr<TransferOp> op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!failed_.ok()) {
    Status why = failed_;
    lk.unlock();
    op->future->complete(why);
    return 0;
  }
  if (count_.load(std::memory_order_relaxed) == 0) touch();  // idle time before this op is not silence
  uint32_t index;
  if (free_.empty()) {
    index = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  } else {
    index = free_.back();
    free_.pop_back();
  }
  Slot& s = slots_[index];
  s.gen = (s.gen + 1) & 0x3fffffffu;  // tokens stay below the rdma transport's wr_id tag bits
  if (s.gen == 0) s.gen = 1;
  s.op = std::move(op);
  count_.fetch_add(1, std::memory_order_relaxed);
  return token_of(index, s.gen);
}

PendingOps::Slot* PendingOps::slot_locked(uint64_t token) {
  const uint64_t index = token & 0xffffffffu;
  if (index >= slots_.size()) return nullptr;
  Slot& s = slots_[index];
  return s.op && s.gen == (token >> 32) ? &s : nullptr;
}

std::shared_ptr<TransferOp> PendingOps::take_locked(uint64_t token) {
  Slot* s = slot_locked(token);
  if (!s) return nullptr;
  auto op = std::move(s->op);
  free_.push_back(static_cast<uint32_t>(token & 0xffffffffu));
  count_.fetch_sub(1, std::memory_order_relaxed);
  return op;
}

bool PendingOps::add_send(std::shared_ptr<MessageOp> op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!failed_.ok()) {
    Status why = failed_;
    lk.unlock();
    op->future->complete(why);
    return false;
  }
  if (count_.load(std::memory_order_relaxed) == 0) touch();
  sends_[op->seq] = std::move(op);
  count_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::shared_ptr<TransferOp> PendingOps::find(uint64_t token) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot* s = slot_locked(token);
  return s ? s->op : nullptr;
}

bool PendingOps::lane_done(uint64_t token, const Status& st) {
  std::shared_ptr<FutureState> future;  // fail_all() may drop the op meanwhile
  {
    std::lock_guard<std::mutex> lk(mu_);
    Slot* s = slot_locked(token);
    if (!s) return false;
    future = s->op->future;
  }
  // Completion runs user callbacks, so no lock is held across it. The call that completes the
  // future takes the op out of its slot (and destroys it outside the lock).
  if (future->part_done(st)) {
    std::shared_ptr<TransferOp> op;
    {
      std::lock_guard<std::mutex> lk(mu_);
      op = take_locked(token);
    }
  }
  return true;
}

bool PendingOps::note_error(uint64_t token, const Status& st) {
  auto op = find(token);
  if (!op) return false;
  op->future->note_error(st);
  return true;
}

std::shared_ptr<MessageOp> PendingOps::take_send(uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sends_.find(seq);
  if (it == sends_.end()) return nullptr;
  auto op = std::move(it->second);
  sends_.erase(it);
  count_.fetch_sub(1, std::memory_order_relaxed);
  return op;
}

void PendingOps::fail_all(const Status& why) {
  std::vector<std::shared_ptr<TransferOp>> ops;
  std::unordered_map<uint64_t, std::shared_ptr<MessageOp>> sends;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_.ok()) failed_ = why;
    for (uint32_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].op) {
        ops.push_back(std::move(slots_[i].op));
        free_.push_back(i);
      }
    sends.swap(sends_);
    count_.store(0);
  }
  for (auto& op : ops) op->future->complete(why);
  for (auto& [s, op] : sends) op->future->complete(why);
}

}  // namespace sluice::detail
