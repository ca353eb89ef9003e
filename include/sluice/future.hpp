// The completion of one submitted operation.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "sluice/error.hpp"
#include "sluice/export.hpp"

namespace sluice {

namespace detail {
class FutureState;
}

class SLUICE_API Future {
 public:
  using Callback = std::function<void(const Status&)>;

  Future() = default;
  explicit Future(std::shared_ptr<detail::FutureState> state) : state_(std::move(state)) {}

  // Block until the operation completes and return its status. Never waits forever: a lost
  // peer, a closed endpoint or engine, or the operation timeout completes it with an error.
  Status wait() const;
  // Like wait(), but give up after `timeout`; returns false if still pending.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  // Non-blocking: true once completed.
  bool test() const;
  // Status once completed; a status with code kOk before that is not meaningful, check test().
  Status status() const;
  // Throws Error if the completed operation failed (waits first).
  void get() const;
  // Time from submission to completion (or to now while pending).
  std::chrono::nanoseconds elapsed() const;
  // Bytes received (recv) or moved (read/write); imm value (imm_recv).
  uint64_t bytes() const;
  uint32_t imm() const;
  // Run `cb` once on completion: immediately on this thread if already complete, otherwise on
  // the thread that completes the operation (an engine thread, or a thread inside wait() that
  // is driving the transport's completions). The callback must not block: a callback that
  // waits for another operation of the same endpoint stalls that endpoint until the operation
  // timeout fails it.
  void on_complete(Callback cb) const;

  bool valid() const { return static_cast<bool>(state_); }
  const std::shared_ptr<detail::FutureState>& state() const { return state_; }

 private:
  std::shared_ptr<detail::FutureState> state_;
};

}  // namespace sluice
