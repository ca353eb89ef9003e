// Bootstrap messages on the handshake listener: a checked 16-byte header and a JSON body.
// Every connection to the listener starts with one (info query, hello, or channel attach).
//
// Nothing a peer sends here is trusted: a message must arrive whole before one absolute
// deadline (a peer trickling bytes cannot stretch it), its body is read as it arrives (a
// header's length claim allocates nothing) and bounded, and its JSON nesting is bounded
// before it is parsed. Fields are read through the require_* helpers, which name the field,
// the message and what was expected when a value is missing, mistyped or out of range.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
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

using Clock = std::chrono::steady_clock;

// Largest body accepted in a reply to a request of ours (an engine info listing many
// regions can be large; the listener side is bounded by config max_handshake_bytes instead).
// The body is read as it arrives, so this caps memory a peer can make us hold, not what we
// allocate up front.
constexpr uint32_t kMaxBody = 64u << 20;
// Deepest JSON nesting accepted in any bootstrap body or info blob (ours nest 4 deep): a
// body of '[' would otherwise become a JSON tree ~250 times its size.
constexpr int kMaxJsonDepth = 64;
// Longest string accepted in a handshake field (names, ids, addresses).
constexpr size_t kMaxFieldString = 4096;

// Deadline `{}` (the default) means: now + the socket's SO_RCVTIMEO / SO_SNDTIMEO (set by
// net::set_io_timeout), applied to the whole message, not per system call; no bound if the
// socket has none. Throw Error(kPeerLost) on a closed socket, kProtocol on a malformed
// message, kTimeout when the deadline passes. `closed_silently` (if given) is set when the
// peer closed before sending a single byte (a port probe, not a failed handshake).
void send_msg(int fd, MsgKind kind, const nlohmann::json& body, Clock::time_point deadline = {});
std::pair<MsgKind, nlohmann::json> recv_msg(int fd, Clock::time_point deadline = {}, uint64_t max_body = kMaxBody,
                                            bool* closed_silently = nullptr);
// recv_msg that turns a kError reply into a thrown Error with the peer's code and message.
nlohmann::json expect_reply(int fd, const char* what, Clock::time_point deadline = {});
void send_error(int fd, int code, const std::string& message);

// Throws Error(kProtocol) naming `what` if `text` (JSON) nests arrays/objects deeper than
// max_depth. Linear, allocation free; run it before parsing.
void check_json_depth(std::string_view text, const char* what, int max_depth = kMaxJsonDepth);

// Field readers: throw Error(kProtocol) "<where>: field '<key>' ..." naming what was
// expected. Integers must be JSON integers (never floats, never converted out of range).
const nlohmann::json& require_field(const nlohmann::json& j, const char* key, const char* where);
uint64_t require_u64(const nlohmann::json& j, const char* key, const char* where, uint64_t max = UINT64_MAX);
int64_t require_int(const nlohmann::json& j, const char* key, const char* where, int64_t min, int64_t max);
std::string require_string(const nlohmann::json& j, const char* key, const char* where,
                           size_t max_length = kMaxFieldString);
const nlohmann::json& require_object(const nlohmann::json& j, const char* key, const char* where);
const nlohmann::json& require_array(const nlohmann::json& j, const char* key, const char* where);

}  // namespace sluice::bootstrap
