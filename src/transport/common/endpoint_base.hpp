// The skeleton every transport endpoint shares: the pending-op table, the failure latch, the
// thin post path's bookkeeping, and the imm-after-the-last-lane sequencing of transports
// whose initiator delivers the imm itself. A transport derives from it and supplies how its
// I/O stops (stop_io) and how it delivers an imm (send_imm); what is left in the transport
// is what is really its own: how bytes move.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "transport/common/pending_ops.hpp"
#include "transport/common/post_tracker.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {

class EndpointBase : public TransportEndpoint {
 public:
  explicit EndpointBase(const EndpointSetup& s);

  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }
  Status flush(std::chrono::milliseconds timeout) override { return posts_.flush(timeout); }

 protected:
  // The failure latch. The first call: tells the core (notify: the peer was lost or hostile;
  // not when the core itself is closing us), stops the transport's I/O (stop_io: shut
  // sockets and queues down, never join: fail() may run on the transport's own thread), then
  // fails every pending op and post. Later calls do nothing. Returns whether this call was
  // the first.
  bool fail(const Status& why, bool notify);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  virtual void stop_io() = 0;

  // Lane accounting for transports whose initiator delivers a write_with_imm's imm after the
  // last lane (nvlink): call track_lanes() when the op is posted, lane_finished() as each
  // lane ends (it completes the lane's part of the op). After the last lane of a kWriteImm
  // op whose lanes all succeeded, send_imm() is called instead, and completes that last part
  // (pending_.lane_done) once the imm is out.
  void track_lanes(uint64_t token, const TransferOp& op);
  void lane_finished(uint64_t token, const Status& st);
  virtual void send_imm(uint64_t token, const std::shared_ptr<TransferOp>& op) {}

  EndpointEvents* const events_;
  PendingOps pending_;
  PostTracker posts_;
  SignalSequencer sequencer_;

 private:
  struct Lanes {
    uint32_t left = 0;
    bool imm = false;
    Status first_error;
  };
  std::atomic<bool> failed_{false};
  const std::string peer_engine_id_;
  std::mutex lanes_mu_;
  std::unordered_map<uint64_t, Lanes> lanes_;
};

}  // namespace sluice::detail
