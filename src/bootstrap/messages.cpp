#include "bootstrap/messages.hpp"

#include <cerrno>
#include <cstring>

#include "bootstrap/socket.hpp"
#include "sluice/error.hpp"
#include "sluice/version.hpp"

namespace sluice::bootstrap {
namespace {

constexpr uint32_t kMagic = 0x42434c53;  // "SLCB"

struct Header {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;
  uint32_t length;
  uint32_t check;
};
static_assert(sizeof(Header) == 16);

uint32_t check_of(const Header& h) {
  uint64_t x = (uint64_t(h.magic) << 32) ^ (uint64_t(h.version) << 16) ^ h.kind ^ (uint64_t(h.length) << 24);
  x *= 0x9e3779b97f4a7c15ull;
  return static_cast<uint32_t>(x >> 32);
}

[[noreturn]] void io_failure(const char* what) {
  int err = errno;
  if (err == EAGAIN || err == EWOULDBLOCK)
    throw Error(ErrorCode::kTimeout, std::string("bootstrap ") + what + " timed out");
  throw Error(ErrorCode::kPeerLost, std::string("bootstrap ") + what + ": " + net::errno_text(err));
}

}  // namespace

void send_msg(int fd, MsgKind kind, const nlohmann::json& body) {
  std::string text = body.dump();
  Header h{kMagic, static_cast<uint16_t>(kWireVersion), static_cast<uint16_t>(kind),
           static_cast<uint32_t>(text.size()), 0};
  h.check = check_of(h);
  std::string buf(reinterpret_cast<const char*>(&h), sizeof(h));
  buf += text;
  if (!net::write_full(fd, buf.data(), buf.size())) io_failure("send");
}

std::pair<MsgKind, nlohmann::json> recv_msg(int fd) {
  Header h{};
  if (!net::read_full(fd, &h, sizeof(h))) io_failure("receive");
  if (h.magic != kMagic) throw Error(ErrorCode::kProtocol, "bootstrap message has a bad magic number (not a sluice peer?)");
  if (h.check != check_of(h)) throw Error(ErrorCode::kProtocol, "bootstrap message header checksum mismatch");
  if (h.version != kWireVersion)
    throw Error(ErrorCode::kProtocol, "peer speaks wire version " + std::to_string(h.version) + ", we speak " +
                                          std::to_string(kWireVersion));
  if (h.kind < 1 || h.kind > 5) throw Error(ErrorCode::kProtocol, "bootstrap message of unknown kind " + std::to_string(h.kind));
  if (h.length > kMaxBody) throw Error(ErrorCode::kProtocol, "bootstrap message body too large");
  std::string text(h.length, '\0');
  if (h.length && !net::read_full(fd, text.data(), text.size())) io_failure("receive");
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kProtocol, "bootstrap message body is not a JSON object");
  return {static_cast<MsgKind>(h.kind), std::move(j)};
}

nlohmann::json expect_reply(int fd, const char* what) {
  auto [kind, body] = recv_msg(fd);
  if (kind == MsgKind::kError) {
    int code = body.value("code", static_cast<int>(ErrorCode::kRemoteError));
    if (code <= 0 || code > static_cast<int>(ErrorCode::kInternal)) code = static_cast<int>(ErrorCode::kRemoteError);
    throw Error(static_cast<ErrorCode>(code),
                std::string(what) + " refused by peer: " + body.value("message", std::string("(no message)")));
  }
  if (kind != MsgKind::kReply) throw Error(ErrorCode::kProtocol, std::string(what) + ": unexpected reply kind");
  return body;
}

void send_error(int fd, int code, const std::string& message) {
  try {
    send_msg(fd, MsgKind::kError, {{"code", code}, {"message", message}});
  } catch (const Error&) {
    // The peer is gone; nothing more to tell it.
  }
}

}  // namespace sluice::bootstrap
