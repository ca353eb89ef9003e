// Bootstrap messages on the handshake listener: a checked 16-byte header and a JSON body.
// Every connection to the listener starts with one (info query, hello, or channel attach).
#pragma once

#include <cstdint>
#include <utility>

#include <nlohmann/json.hpp>

namespace sluice::bootstrap {

enum class MsgKind : uint16_t {
  kInfo = 1,     // "send me your engine info"          -> kReply {info}
  kHello = 2,    // open an endpoint                     -> kReply {info, transport} | kError
  kChannel = 3,  // attach a transport channel           -> transport-specific kReply | kError
  kReply = 4,
  kError = 5,    // {"code": int, "message": str}
};

constexpr uint32_t kMaxBody = 16u << 20;

// Throw Error(kPeerLost) on a closed socket, kProtocol on a malformed message, kTimeout when
// the socket's I/O timeout expires.
void send_msg(int fd, MsgKind kind, const nlohmann::json& body);
std::pair<MsgKind, nlohmann::json> recv_msg(int fd);
// recv_msg that turns a kError reply into a thrown Error with the peer's code and message.
nlohmann::json expect_reply(int fd, const char* what);
void send_error(int fd, int code, const std::string& message);

}  // namespace sluice::bootstrap
