#include "transport/common/pending_ops.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace sluice::detail {

uint64_t PendingOps::add(std::shared_ptr<TransferOp> op) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!failed_.ok()) {
    Status why = failed_;
    lk.unlock();
    finish(op, why);
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
  s.last = s.added = Clock::now();
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
  const uint64_t seq = op->seq;
  const auto now = Clock::now();
  sends_[seq] = SendSlot{std::move(op), now, now};
  count_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::shared_ptr<TransferOp> PendingOps::find(uint64_t token) {
  std::lock_guard<std::mutex> lk(mu_);
  Slot* s = slot_locked(token);
  return s ? s->op : nullptr;
}

void PendingOps::finish(const std::shared_ptr<TransferOp>& op, const Status& st) {
  if (op->future) {
    op->future->complete(st);
    return;
  }
  if (post_handler_) post_handler_(op, op->post_error.ok() ? st : op->post_error);
}

bool PendingOps::lane_done(uint64_t token, const Status& st, int lane) {
  std::shared_ptr<FutureState> future;  // fail_all() may drop the op meanwhile
  {
    std::unique_lock<std::mutex> lk(mu_);
    Slot* s = slot_locked(token);
    if (!s) return false;
    if (lane >= 0 && lane < 64) s->op->done_lanes |= uint64_t{1} << lane;
    s->last = Clock::now();  // a lane finished: the op's own progress
    if (!s->op->future) {
      // A post: one lane, so its first lane_done is its last.
      std::shared_ptr<TransferOp> op = take_locked(token);
      lk.unlock();
      finish(op, st);
      return true;
    }
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
  std::shared_ptr<FutureState> future;
  {
    std::lock_guard<std::mutex> lk(mu_);
    Slot* s = slot_locked(token);
    if (!s) return false;
    s->last = Clock::now();
    if (!s->op->future) {
      if (s->op->post_error.ok()) s->op->post_error = st;
      return true;
    }
    future = s->op->future;
  }
  future->note_error(st);
  return true;
}

void PendingOps::progress(uint64_t token) {
  std::lock_guard<std::mutex> lk(mu_);
  if (Slot* s = slot_locked(token)) s->last = Clock::now();
}

void PendingOps::progress_send(uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sends_.find(seq);
  if (it != sends_.end()) it->second.last = Clock::now();
}

namespace {
// What a timeout names (issue 19: the peer, the channel and the operation; the core adds the
// peer): "write on channel 1", "read on channels 0, 2", "post on channel 0". The channels are
// the op's lanes not known to be done (transports that report lanes: tcp), else all it used.
// Call under PendingOps' lock (done_lanes).
std::string op_label(const TransferOp& op) {
  std::string s = op.future ? std::string(to_string(op.kind)) : "post";
  std::string chans;
  int count = 0;
  for (size_t c = 0; c < op.lanes.size(); ++c) {
    if (op.lanes[c].pieces.empty() || (c < 64 && (op.done_lanes >> c & 1))) continue;
    chans += (count++ ? ", " : "") + std::to_string(c);
  }
  if (count) s += (count == 1 ? " on channel " : " on channels ") + chans;
  return s;
}
}  // namespace

size_t PendingOps::expire(Clock::time_point now, std::chrono::milliseconds timeout, std::string* what, bool fail,
                          const Alive& alive) {
  auto overdue = [&](const TransferOp* op, Clock::time_point last) {
    return now - last >= timeout && !(alive && alive(op));
  };
  std::vector<std::shared_ptr<TransferOp>> ops;
  std::vector<std::shared_ptr<MessageOp>> sends;
  std::vector<std::string> labels;  // op_label of each of `ops`, taken under the lock
  Clock::duration worst{};
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (count_.load(std::memory_order_relaxed) == 0) return 0;
    if (!fail) {
      size_t n = 0;
      std::string label = "send";
      for (const Slot& s : slots_)
        if (s.op && overdue(s.op.get(), s.last)) {
          if (n++ == 0 || now - s.last > worst) label = op_label(*s.op);
          worst = std::max(worst, now - s.last);
        }
      for (const auto& [seq, s] : sends_)
        if (overdue(nullptr, s.last)) {
          ++n;
          worst = std::max(worst, now - s.last);
        }
      if (n && what)
        *what = std::to_string(n) + " operation(s) timed out: " + label + " saw no progress from the peer for " +
                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(worst).count()) +
                " ms (op_timeout " + std::to_string(timeout.count()) + " ms)";
      return n;
    }
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (!s.op || !overdue(s.op.get(), s.last)) continue;
      worst = std::max(worst, now - s.last);
      labels.push_back(op_label(*s.op));
      ops.push_back(std::move(s.op));
      free_.push_back(i);
      count_.fetch_sub(1, std::memory_order_relaxed);
    }
    for (auto it = sends_.begin(); it != sends_.end();) {
      if (!overdue(nullptr, it->second.last)) {
        ++it;
        continue;
      }
      worst = std::max(worst, now - it->second.last);
      sends.push_back(std::move(it->second.op));
      it = sends_.erase(it);
      count_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  const size_t n = ops.size() + sends.size();
  if (n == 0) return 0;
  const auto idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(worst).count();
  auto describe = [&](const std::string& label) {
    return label + " saw no progress from the peer for " + std::to_string(idle_ms) + " ms (op_timeout " +
           std::to_string(timeout.count()) + " ms)";
  };
  Status why{ErrorCode::kTimeout, ops.empty() ? describe("a send") : describe(labels.front())};
  if (what) *what = std::to_string(n) + " operation(s) timed out: " + why.message;
  for (size_t i = 0; i < ops.size(); ++i) finish(ops[i], {ErrorCode::kTimeout, describe(labels[i])});
  for (auto& op : sends) op->future->complete({ErrorCode::kTimeout, describe("send")});
  return n;
}

std::vector<std::pair<uint64_t, std::shared_ptr<TransferOp>>> PendingOps::open_on(int lane) {
  std::vector<std::pair<uint64_t, std::shared_ptr<TransferOp>>> out;
  if (lane < 0 || lane >= 64) return out;
  const uint64_t bit = uint64_t{1} << lane;
  std::lock_guard<std::mutex> lk(mu_);
  for (uint32_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (open_on_lane(s, bit))
      out.emplace_back(token_of(i, s.gen), s.op);
  }
  return out;
}

PendingOps::Clock::time_point PendingOps::owed_since(int lane) const {
  auto since = Clock::time_point::max();
  if (lane < 0 || lane >= 64) return since;
  const uint64_t bit = uint64_t{1} << lane;
  std::lock_guard<std::mutex> lk(mu_);
  for (const Slot& s : slots_)
    if (open_on_lane(s, bit)) since = std::min(since, s.added);
  if (lane == 0)
    for (const auto& [seq, send] : sends_) since = std::min(since, send.added);
  return since;
}

size_t PendingOps::sends() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sends_.size();
}

std::shared_ptr<MessageOp> PendingOps::find_send(uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sends_.find(seq);
  return it == sends_.end() ? nullptr : it->second.op;
}

std::shared_ptr<MessageOp> PendingOps::take_send(uint64_t seq) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sends_.find(seq);
  if (it == sends_.end()) return nullptr;
  auto op = std::move(it->second.op);
  sends_.erase(it);
  count_.fetch_sub(1, std::memory_order_relaxed);
  return op;
}

void PendingOps::fail_all(const Status& why) {
  std::vector<std::shared_ptr<TransferOp>> ops;
  std::unordered_map<uint64_t, SendSlot> sends;
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
  for (auto& op : ops) finish(op, why);
  for (auto& [s, slot] : sends) slot.op->future->complete(why);
}

}  // namespace sluice::detail
