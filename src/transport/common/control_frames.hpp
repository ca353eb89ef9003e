// Handling of the response frames every framed transport shares (tcp, shm, nvlink).
#pragma once

#include <string>

#include "transport/common/frame.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/stream_channel.hpp"

namespace sluice::detail {

// The status a response frame carries: its code, and the peer's message as payload.
inline Status frame_status(const FrameHeader& h, PayloadReader& payload) {
  if (h.status == 0) return Status::Ok();
  // A code this build does not know is reported as a remote error.
  int code = h.status <= static_cast<int>(ErrorCode::kInternal) ? h.status : static_cast<int>(ErrorCode::kRemoteError);
  return {static_cast<ErrorCode>(code), "peer: " + payload.read_text(kMaxMessageText)};
}

// SEND_ACK: completes the matching send; an ack for no pending send is a protocol error.
inline Status complete_send_ack(PendingOps& pending, const FrameHeader& h, PayloadReader& payload) {
  Status st = frame_status(h, payload);
  auto op = pending.take_send(h.op_id);
  if (!op) return {ErrorCode::kProtocol, "send ack for an unknown message"};
  op->future->complete(st);
  return Status::Ok();
}

// ERROR: the peer is closing the channel and says why.
inline Status peer_error(PayloadReader& payload) {
  return {ErrorCode::kRemoteError, "peer closed the connection: " + payload.read_text(kMaxMessageText)};
}

// Posts a response frame with `st` (its message as payload).
inline void post_status(StreamChannel& ch, FrameType type, uint64_t op_id, uint8_t flags, const Status& st) {
  OutFrame f;
  f.text = st.message.substr(0, kMaxMessageText);
  f.hdr = make_frame(type, op_id, 0, 0, f.text.size(), flags, 0, 0, static_cast<uint16_t>(st.code));
  f.response = true;
  ch.post(std::move(f));
}

}  // namespace sluice::detail
