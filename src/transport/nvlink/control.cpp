// nvlink control channel (the authenticated same-host socket): the frames the peer sends (imm,
// SEND rendezvous, PULL_WRITE, signals and their answers), our SEND_RTS, and serving the
// peer's SEND_RTS, PULL_WRITEs and signals (see endpoint.hpp).
#include <algorithm>

#include "transport/common/cma.hpp"
#include "transport/common/signal_target.hpp"
#include "transport/nvlink/endpoint.hpp"

namespace sluice::detail::nvlink {

void NvlinkEndpoint::send(std::shared_ptr<MessageOp> op) {
  if (!pending_.add_send(op)) return;
  OutFrame f;
  f.hdr = make_frame(FrameType::kSendRts, op->seq, reinterpret_cast<uint64_t>(op->ptr), op->pin.get()->id, 0, 0,
                     static_cast<uint32_t>(op->length), static_cast<uint32_t>(op->length >> 32));
  control_->post(std::move(f));
}

Status NvlinkEndpoint::on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
  pending_.touch();
  switch (static_cast<FrameType>(h.type)) {
    case FrameType::kImm:
      events_->matcher().push_imm(h.imm);
      return Status::Ok();
    case FrameType::kSendRts: return serve_rts(ch, h);
    case FrameType::kPullWrite: return serve_pull(ch, h, payload);
    case FrameType::kSignal: return serve_signal(ch, h);
    case FrameType::kAck:
    case FrameType::kNack:
      moved();
      return take_pull_ack(h, payload);
    case FrameType::kSendAck:
      moved();
      return complete_send_ack(pending_, h, payload);
    case FrameType::kError: return peer_error(payload);
    default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on nvlink control"};
  }
}

// The peer asks us to copy bytes of its process into our region(s): each must be a host
// region of ours, the bytes are read from the proven peer process, and its source region
// (if it named one) is held under its lease for the copy.
Status NvlinkEndpoint::serve_pull(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
  if (h.length % sizeof(same_host::PullPiece) != 0 || h.length == 0 || h.length / sizeof(same_host::PullPiece) > same_host::kMaxPullPieces)
    return {ErrorCode::kProtocol, "PULL_WRITE of " + std::to_string(h.length) + " bytes (pieces of 48 bytes, at most " +
                                      std::to_string(same_host::kMaxPullPieces) + ")"};
  std::vector<same_host::PullPiece> pieces(h.length / sizeof(same_host::PullPiece));
  if (!payload.read(pieces.data(), h.length)) return {ErrorCode::kPeerLost, "connection lost mid-frame"};
  Status st;
  std::vector<RegionPin> pins;
  std::vector<cma::Span> spans;
  LeaseHold held;
  held.leases = &leases_;
  for (const same_host::PullPiece& p : pieces) {
    RegionPin pin = events_->registry().pin(p.dst_region, p.dst_offset, p.length, &st, "target");
    if (!pin) break;
    if (!pin.get()->location.is_host()) {
      st = {ErrorCode::kUnsupported, "region " + std::to_string(p.dst_region) + " is " +
                                         pin.get()->location.to_string() + " memory, not written by PULL_WRITE"};
      break;
    }
    if (p.src_region != 0 && std::find(held.ids.begin(), held.ids.end(), p.src_region) == held.ids.end()) {
      if (p.src_slot == kNoLease || !leases_.enter(p.src_slot, p.src_region)) {
        st = {ErrorCode::kUnknownHandle, "your source region " + std::to_string(p.src_region) + " is no longer registered"};
        break;
      }
      held.slots.push_back(p.src_slot);
      held.ids.push_back(p.src_region);
    }
    spans.push_back({pin.get()->base + p.dst_offset, p.src_addr, p.length});
    pins.push_back(std::move(pin));
  }
  if (st.ok()) st = cma::read(pid_.load(), spans);
  if (st.ok()) st = held.still();
  pins.clear();
  post_status(ch, st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, 0, st);
  return Status::Ok();
}

// The peer's post_signal into a counter of ours (host memory; counters in our GPU memory it
// raises with a kernel of its own): checked and applied like any target access, answered
// like a write lane end. The channel is in order, so the peer's PULL_WRITEs before it are done.
Status NvlinkEndpoint::serve_signal(StreamChannel& ch, const FrameHeader& h) {
  const uint64_t add = uint64_t(h.aux) << 32 | h.imm;
  Status st = apply_signal(events_->registry(), h.region, h.offset, add);
  post_status(ch, st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, kLaneEnd, st);
  return Status::Ok();
}

// The peer sends us a message: copy it out of its region (h.offset: the region's id,
// h.region: the message's address in the peer), which must lie inside that region as the
// peer described it, under its lease.
Status NvlinkEndpoint::serve_rts(StreamChannel& ch, const FrameHeader& h) {
  uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
  auto claim = events_->matcher().claim(h.op_id, length);
  if (claim.error.code == ErrorCode::kProtocol) return claim.error;
  Status st = claim.error;
  if (claim.dest) {
    uint64_t n = std::min(length, claim.capacity);
    if (n) {
      try {
        int device = cu::pointer_device(claim.dest);
        const bool dest_cuda = device >= 0;
        if (device < 0) cudaGetDevice(&device);
        RemoteView rv = view(h.offset, device);
        if (h.region < rv.addr || !in_bounds(h.region - rv.addr, n, rv.length))
          throw Error(ErrorCode::kProtocol, "SEND_RTS names " + std::to_string(n) + " bytes outside the sender's region " +
                                                std::to_string(h.offset));
        const uint64_t off = h.region - rv.addr;
        LeaseHold held;
        held.leases = &leases_;
        if (rv.slot == kNoLease || !leases_.enter(rv.slot, h.offset)) {
          Status gone{ErrorCode::kUnknownHandle, "the sender's region " + std::to_string(h.offset) + " is no longer registered"};
          forget_region(h.offset, gone);
          throw Error(gone.code, gone.message);
        }
        held.slots.push_back(rv.slot);
        held.ids.push_back(h.offset);
        if (rv.ptr) {
          cu::check(cudaSetDevice(device), "cudaSetDevice");
          cu::check(cudaMemcpy(claim.dest, rv.ptr + off, n, cudaMemcpyDefault), "cudaMemcpy");
        } else if (!dest_cuda) {
          st = cma::read(pid_.load(), {{claim.dest, rv.addr + off, n}});
        } else {
          std::vector<uint8_t> tmp(n);
          st = cma::read(pid_.load(), {{tmp.data(), rv.addr + off, n}});
          if (st.ok()) st = held.still();
          if (st.ok()) cu::check(cudaMemcpy(claim.dest, tmp.data(), n, cudaMemcpyDefault), "cudaMemcpy");
        }
        if (st.ok()) st = held.still();
      } catch (const Error& e) {
        st = e.status();
      }
    }
  }
  st = events_->matcher().deliver(claim, st);
  post_status(ch, FrameType::kSendAck, h.op_id, 0, st);
  return Status::Ok();
}

}  // namespace sluice::detail::nvlink
