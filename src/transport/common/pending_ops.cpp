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
  if (ops_.empty() && sends_.empty()) touch();  // idle time before this op is not silence
  uint64_t token = next_++;
  ops_[token] = std::move(op);
  count_.fetch_add(1, std::memory_order_relaxed);
  return token;
}

bool PendingOps::add_send(std::shared_ptr<MessageOp> op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!failed_.ok()) {
    Status why = failed_;
    lk.unlock();
    op->future->complete(why);
    return false;
  }
  if (ops_.empty() && sends_.empty()) touch();
  sends_[op->seq] = std::move(op);
  count_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::shared_ptr<TransferOp> PendingOps::find(uint64_t token) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = ops_.find(token);
  return it == ops_.end() ? nullptr : it->second;
}

bool PendingOps::lane_done(uint64_t token, const Status& st) {
  std::shared_ptr<TransferOp> op;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = ops_.find(token);
    if (it == ops_.end()) return false;
    op = it->second;
  }
  // Completion runs user callbacks, so no lock is held across it.
  if (op->future->part_done(st)) {
    std::lock_guard<std::mutex> lk(mu_);
    if (ops_.erase(token)) count_.fetch_sub(1, std::memory_order_relaxed);
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
  std::unordered_map<uint64_t, std::shared_ptr<TransferOp>> ops;
  std::unordered_map<uint64_t, std::shared_ptr<MessageOp>> sends;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_.ok()) failed_ = why;
    ops.swap(ops_);
    sends.swap(sends_);
    count_.store(0);
  }
  for (auto& [t, op] : ops) op->future->complete(why);
  for (auto& [s, op] : sends) op->future->complete(why);
}

}  // namespace sluice::detail
