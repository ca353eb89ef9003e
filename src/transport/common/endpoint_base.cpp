#include "transport/common/endpoint_base.hpp"

namespace sluice::detail {

EndpointBase::EndpointBase(const EndpointSetup& s)
    : events_(s.events), posts_(post_depth(s.config), post_flush_spin(s.config)), peer_engine_id_(s.peer.engine_id) {}

bool EndpointBase::fail(const Status& found, bool notify) {
  if (failed_.exchange(true, std::memory_order_acq_rel)) return false;
  // A failure the transport found itself (notify) names the peer, so that a caller with many
  // endpoints knows which one was lost (issue 19); the core's own reasons (close, an op
  // timeout) name it already.
  Status why = found;
  if (notify && !peer_engine_id_.empty()) why.message = "peer " + peer_engine_id_ + ": " + why.message;
  // The post tracker and the core learn first: whoever sees a failed endpoint then gets the
  // failure from flush(), and whoever sees a failed future sees a failed endpoint.
  posts_.fail(why);
  if (notify) events_->on_failure(why);
  stop_io();
  sequencer_.clear();
  pending_.fail_all(why);
  std::lock_guard<std::mutex> lk(lanes_mu_);
  lanes_.clear();
  return true;
}

void EndpointBase::track_lanes(uint64_t token, const TransferOp& op) {
  Lanes l;
  for (const auto& lane : op.lanes) l.left += lane.pieces.empty() ? 0 : 1;
  l.imm = op.kind == OpKind::kWriteImm;
  std::lock_guard<std::mutex> lk(lanes_mu_);
  lanes_[token] = l;
}

void EndpointBase::lane_finished(uint64_t token, const Status& st) {
  bool imm_now = false;
  {
    std::lock_guard<std::mutex> lk(lanes_mu_);
    auto it = lanes_.find(token);
    if (it != lanes_.end()) {
      Lanes& l = it->second;
      if (!st.ok() && l.first_error.ok()) l.first_error = st;
      if (--l.left == 0) {
        imm_now = l.imm && l.first_error.ok();
        lanes_.erase(it);
      }
    }
  }
  // The op has one part per lane: every lane but an imm op's last completes its part here;
  // that last one is completed by send_imm() once the imm is out.
  if (imm_now) {
    if (auto op = pending_.find(token)) {
      send_imm(token, op);
      return;
    }
  }
  pending_.lane_done(token, st);
}

}  // namespace sluice::detail
