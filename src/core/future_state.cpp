#include "core/future_state.hpp"

#include <algorithm>
#include <thread>

#include "core/endpoint_counters.hpp"
#include "sluice/future.hpp"

namespace sluice::detail {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace

FutureState::FutureState(OpKind kind, int parts) : kind_(kind), start_(Clock::now()), parts_(parts) {}

bool FutureState::part_done(const Status& status) {
  if (!status.ok()) {
    std::lock_guard<std::mutex> lk(mu_);
    if (first_error_.ok()) first_error_ = status;
  }
  if (parts_.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;
  Status final_status;
  {
    std::lock_guard<std::mutex> lk(mu_);
    final_status = first_error_;
  }
  return finish(final_status);
}

bool FutureState::complete(const Status& status) { return finish(status); }

void FutureState::set_counters(std::shared_ptr<EndpointCounters> counters) {
  counters_ = std::move(counters);
  if (counters_) counters_->started(kind_);
}

void FutureState::note_error(const Status& status) {
  std::lock_guard<std::mutex> lk(mu_);
  if (first_error_.ok()) first_error_ = status;
}

bool FutureState::finish(const Status& status) {
  std::vector<Callback> cbs;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_.load(std::memory_order_relaxed)) return false;
    status_ = status;
    end_ = Clock::now();
    // Counted before anyone can see the future done: a waiter that reads the metrics next
    // finds its op in them.
    if (counters_) counters_->ended(kind_, bytes_.load(std::memory_order_relaxed), status, end_ - start_);
    done_.store(true, std::memory_order_release);
    cbs.swap(callbacks_);
    wake = waiters_.load(std::memory_order_relaxed) > 0;
  }
  // Woken after the unlock, so the waiter does not wake into a held mutex (2-3 futex calls
  // per small op). `this` outlives the call: every completer holds the state through a
  // shared_ptr (the op's, or a copy taken for the call), and a waiter that returns drops only
  // its own reference.
  if (wake) cv_.notify_all();
  for (auto& cb : cbs) cb(status);
  return true;
}

void FutureState::drive(Clock::time_point deadline) {
  auto src = progress_.lock();
  if (!src || done()) return;
  src->begin_polling();
  const auto budget = src->poll_budget();
  auto last = Clock::now();
  unsigned idle = 0;
  while (!done()) {
    if (src->progress()) {
      idle = 0;
      continue;
    }
    // Read the clock only now and then: a completion is usually a few polls away.
    if (++idle % 32 == 1) {
      auto now = Clock::now();
      if (idle == 1) last = now;
      if (now - last > budget || now >= deadline) break;
    }
    cpu_relax();
  }
  src->end_polling(done());
}

Status FutureState::wait() {
  drive(Clock::time_point::max());
  // status_ is written before done_ is released, and never after: no lock needed to read it.
  if (done()) return status_;
  auto spin_end = Clock::now() + spin_;
  while (!done()) {
    if (Clock::now() > spin_end) break;
    for (int i = 0; i < 64 && !done(); ++i) cpu_relax();
  }
  std::unique_lock<std::mutex> lk(mu_);
  waiters_.fetch_add(1, std::memory_order_relaxed);
  cv_.wait(lk, [&] { return done_.load(std::memory_order_relaxed); });
  waiters_.fetch_sub(1, std::memory_order_relaxed);
  return status_;
}

bool FutureState::wait_for(std::chrono::nanoseconds timeout) {
  if (done()) return true;
  auto start = Clock::now();
  drive(timeout >= std::chrono::hours(24 * 365) ? Clock::time_point::max() : start + timeout);
  if (done()) return true;
  timeout -= std::min<std::chrono::nanoseconds>(timeout, Clock::now() - start);
  std::unique_lock<std::mutex> lk(mu_);
  waiters_.fetch_add(1, std::memory_order_relaxed);
  bool ok = cv_.wait_for(lk, timeout, [&] { return done_.load(std::memory_order_relaxed); });
  waiters_.fetch_sub(1, std::memory_order_relaxed);
  return ok;
}

Status FutureState::status() const {
  std::lock_guard<std::mutex> lk(mu_);
  return status_;
}

std::chrono::nanoseconds FutureState::elapsed() const {
  std::lock_guard<std::mutex> lk(mu_);
  auto end = done_.load(std::memory_order_relaxed) ? end_ : Clock::now();
  return end - start_;
}

void FutureState::on_complete(Callback cb) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!done_.load(std::memory_order_relaxed)) {
      callbacks_.push_back(std::move(cb));
      return;
    }
  }
  cb(status());
}

}  // namespace sluice::detail

namespace sluice {

namespace {
detail::FutureState& need(const std::shared_ptr<detail::FutureState>& s) {
  if (!s) throw Error(ErrorCode::kInvalidArgument, "empty Future (default-constructed)");
  return *s;
}
}  // namespace

Status Future::wait() const { return need(state_).wait(); }
bool Future::wait_for(std::chrono::nanoseconds timeout) const { return need(state_).wait_for(timeout); }
bool Future::test() const { return need(state_).done(); }
Status Future::status() const { return need(state_).status(); }
void Future::get() const {
  Status s = wait();
  if (!s.ok()) throw Error(s);
}
std::chrono::nanoseconds Future::elapsed() const { return need(state_).elapsed(); }
uint64_t Future::bytes() const { return need(state_).bytes(); }
uint32_t Future::imm() const { return need(state_).imm(); }
void Future::on_complete(Callback cb) const { need(state_).on_complete(std::move(cb)); }

}  // namespace sluice
