// One error type for the whole library: every failure carries an ErrorCode and a message
// that names what was wrong.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "sluice/export.hpp"

namespace sluice {

enum class ErrorCode : int {
  kOk = 0,
  kInvalidArgument,  // malformed input that is not one of the more specific cases below
  kUnknownHandle,    // a region handle that was never registered or is already unregistered
  kOutOfRange,       // offset + length outside a local or remote region
  kEmptyBatch,       // an operation submitted with no assignments
  kTruncated,        // a message larger than the receive buffer it was matched with
  kPeerLost,         // the peer closed, crashed or stopped answering
  kTimeout,          // an operation or connect ran past its deadline
  kCancelled,        // the endpoint or engine was closed while the operation was pending
  kRemoteError,      // the peer refused the request (the message says why)
  kProtocol,         // a malformed or forged frame or handshake
  kUnsupported,      // the transport or memory kind cannot do what was asked
  kNoDevice,         // no device for the requested transport (e.g. no RDMA NIC, no GPU)
  kSystem,           // a system call failed (errno text in the message)
  kClosed,           // the engine or endpoint is already closed
  kInternal,
};

SLUICE_API std::string_view to_string(ErrorCode code);

// A value type describing the outcome of an operation.
struct SLUICE_API Status {
  ErrorCode code = ErrorCode::kOk;
  std::string message;

  bool ok() const { return code == ErrorCode::kOk; }
  static Status Ok() { return {}; }
  std::string to_string() const;
};

class SLUICE_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  explicit Error(const Status& status) : Error(status.code, status.message) {}
  ErrorCode code() const { return code_; }
  Status status() const { return {code_, detail_}; }

 private:
  ErrorCode code_;
  std::string detail_;
};

}  // namespace sluice
