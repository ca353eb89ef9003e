#include "sluice/error.hpp"

namespace sluice {

std::string_view to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kUnknownHandle: return "unknown handle";
    case ErrorCode::kOutOfRange: return "out of range";
    case ErrorCode::kEmptyBatch: return "empty batch";
    case ErrorCode::kTruncated: return "truncated";
    case ErrorCode::kPeerLost: return "peer lost";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kCancelled: return "cancelled";
    case ErrorCode::kRemoteError: return "remote error";
    case ErrorCode::kProtocol: return "protocol error";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kNoDevice: return "no device";
    case ErrorCode::kSystem: return "system error";
    case ErrorCode::kClosed: return "closed";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s(sluice::to_string(code));
  if (!message.empty()) s += ": " + message;
  return s;
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code), detail_(message) {}

}  // namespace sluice
