#include "bootstrap/messages.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <cerrno>
#include <cstring>

#include "bootstrap/socket.hpp"
#include "sluice/error.hpp"
#include "sluice/version.hpp"

namespace sluice::bootstrap {
namespace {

using nlohmann::json;

constexpr uint32_t kMagic = 0x42434c53;  // "SLCB"
// The body grows by at most this much per read, so memory follows the bytes that arrived.
constexpr size_t kReadChunk = 64 << 10;

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

// `{}` -> now + the socket's own timeout (SO_RCVTIMEO or SO_SNDTIMEO), or no deadline.
Clock::time_point resolve_deadline(int fd, Clock::time_point deadline, int opt) {
  if (deadline != Clock::time_point{}) return deadline;
  timeval tv{};
  socklen_t len = sizeof(tv);
  if (::getsockopt(fd, SOL_SOCKET, opt, &tv, &len) != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0))
    return Clock::time_point::max();
  return Clock::now() + std::chrono::seconds(tv.tv_sec) + std::chrono::microseconds(tv.tv_usec);
}

// Waits for `events` on fd until the deadline; false when it passed.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int ms = -1;
    if (deadline != Clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
      if (deadline <= Clock::now()) return false;
      ms = static_cast<int>(std::min<long long>(left, 60000));
    }
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, ms);
    if (rc > 0) return true;  // readable, writable, or an error/hang-up the next call reports
    if (rc < 0 && errno != EINTR)
      throw Error(ErrorCode::kPeerLost, "bootstrap poll: " + net::errno_text(errno));
  }
}

[[noreturn]] void timed_out(const char* what, size_t got, size_t want) {
  throw Error(ErrorCode::kTimeout, std::string("bootstrap ") + what + " timed out (" + std::to_string(got) + " of " +
                                       std::to_string(want) + " bytes arrived before the deadline)");
}

// Reads exactly n bytes before the deadline. Returns how many arrived before EOF (n: all).
size_t read_until(int fd, char* buf, size_t n, Clock::time_point deadline, const char* what) {
  size_t got = 0;
  while (got < n) {
    if (!wait_for(fd, POLLIN, deadline)) timed_out(what, got, n);
    ssize_t r = ::recv(fd, buf + got, n - got, MSG_DONTWAIT);
    if (r > 0) {
      got += static_cast<size_t>(r);
    } else if (r == 0) {
      return got;
    } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
      throw Error(ErrorCode::kPeerLost, std::string("bootstrap ") + what + ": " + net::errno_text(errno));
    }
  }
  return got;
}

std::string describe(const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 64) text = text.substr(0, 61) + "...";
  return std::string(v.type_name()) + " " + text;
}

[[noreturn]] void bad_field(const char* where, const char* key, const std::string& expected, const json& v) {
  throw Error(ErrorCode::kProtocol,
              std::string(where) + ": field '" + key + "' must be " + expected + ", got " + describe(v));
}

}  // namespace

void send_msg(int fd, MsgKind kind, const json& body, Clock::time_point deadline) {
  // Replace, not throw on, invalid UTF-8 (an error text may quote a truncated peer string).
  std::string text = body.dump(-1, ' ', false, json::error_handler_t::replace);
  Header h{kMagic, static_cast<uint16_t>(kWireVersion), static_cast<uint16_t>(kind),
           static_cast<uint32_t>(text.size()), 0};
  h.check = check_of(h);
  std::string buf(reinterpret_cast<const char*>(&h), sizeof(h));
  buf += text;
  deadline = resolve_deadline(fd, deadline, SO_SNDTIMEO);
  size_t done = 0;
  while (done < buf.size()) {
    if (!wait_for(fd, POLLOUT, deadline)) timed_out("send", done, buf.size());
    ssize_t r = ::send(fd, buf.data() + done, buf.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0)
      done += static_cast<size_t>(r);
    else if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
      throw Error(ErrorCode::kPeerLost, "bootstrap send: " + net::errno_text(errno));
  }
}

std::pair<MsgKind, json> recv_msg(int fd, Clock::time_point deadline, uint64_t max_body, bool* closed_silently) {
  if (closed_silently) *closed_silently = false;
  deadline = resolve_deadline(fd, deadline, SO_RCVTIMEO);
  Header h{};
  size_t got = read_until(fd, reinterpret_cast<char*>(&h), sizeof(h), deadline, "receive");
  if (got == 0 && closed_silently) *closed_silently = true;
  if (got < sizeof(h))
    throw Error(ErrorCode::kPeerLost, "bootstrap receive: connection closed after " + std::to_string(got) +
                                          " of the 16 header bytes");
  if (h.magic != kMagic) throw Error(ErrorCode::kProtocol, "bootstrap message has a bad magic number (not a sluice peer?)");
  if (h.check != check_of(h)) throw Error(ErrorCode::kProtocol, "bootstrap message header checksum mismatch");
  if (h.version != kWireVersion)
    throw Error(ErrorCode::kProtocol, "peer speaks wire version " + std::to_string(h.version) + ", we speak " +
                                          std::to_string(kWireVersion));
  if (h.kind < 1 || h.kind > 5) throw Error(ErrorCode::kProtocol, "bootstrap message of unknown kind " + std::to_string(h.kind));
  if (h.length > max_body)
    throw Error(ErrorCode::kProtocol, "bootstrap message body of " + std::to_string(h.length) +
                                          " bytes exceeds the limit of " + std::to_string(max_body) +
                                          " (max_handshake_bytes on a listener)");
  // Grow the body as bytes arrive: a header's claim alone allocates nothing.
  std::string text;
  while (text.size() < h.length) {
    size_t old = text.size();
    size_t want = std::min<size_t>(h.length - old, kReadChunk);
    text.resize(old + want);
    size_t n = read_until(fd, text.data() + old, want, deadline, "receive");
    if (n < want)
      throw Error(ErrorCode::kPeerLost, "bootstrap receive: connection closed after " + std::to_string(old + n) +
                                            " of " + std::to_string(h.length) + " body bytes");
  }
  check_json_depth(text, "bootstrap message body");
  auto j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kProtocol, "bootstrap message body is not a JSON object");
  return {static_cast<MsgKind>(h.kind), std::move(j)};
}

json expect_reply(int fd, const char* what, Clock::time_point deadline) {
  auto [kind, body] = recv_msg(fd, deadline);
  if (kind == MsgKind::kError) {
    // A peer's refusal: its code and message are reported, never trusted for their types.
    int code = static_cast<int>(ErrorCode::kRemoteError);
    auto c = body.find("code");
    if (c != body.end() && c->is_number_integer()) {
      int64_t v = c->get<int64_t>();
      if (v > 0 && v <= static_cast<int64_t>(ErrorCode::kInternal)) code = static_cast<int>(v);
    }
    std::string message = "(no message)";
    auto m = body.find("message");
    if (m != body.end() && m->is_string()) message = m->get<std::string>();
    if (message.size() > kMaxFieldString) message = message.substr(0, kMaxFieldString) + "...";
    throw Error(static_cast<ErrorCode>(code), std::string(what) + " refused by peer: " + message);
  }
  if (kind != MsgKind::kReply)
    throw Error(ErrorCode::kProtocol, std::string(what) + ": unexpected reply kind " + std::to_string(int(kind)));
  return body;
}

void send_error(int fd, int code, const std::string& message) {
  try {
    send_msg(fd, MsgKind::kError, {{"code", code}, {"message", message}});
  } catch (const Error&) {
    // The peer is gone; nothing more to tell it.
  }
}

void check_json_depth(std::string_view text, const char* what, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        throw Error(ErrorCode::kProtocol, std::string(what) + " nests JSON deeper than the limit of " +
                                              std::to_string(max_depth) + " levels");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

const json& require_field(const json& j, const char* key, const char* where) {
  if (!j.is_object()) throw Error(ErrorCode::kProtocol, std::string(where) + " is not a JSON object, got " + describe(j));
  auto it = j.find(key);
  if (it == j.end()) throw Error(ErrorCode::kProtocol, std::string(where) + ": missing field '" + key + "'");
  return *it;
}

uint64_t require_u64(const json& j, const char* key, const char* where, uint64_t max) {
  const json& v = require_field(j, key, where);
  auto expected = [&] { return "an unsigned integer 0.." + std::to_string(max); };
  uint64_t x = 0;
  if (v.is_number_unsigned())
    x = v.get<uint64_t>();
  else if (v.is_number_integer() && v.get<int64_t>() >= 0)
    x = static_cast<uint64_t>(v.get<int64_t>());
  else
    bad_field(where, key, expected(), v);
  if (x > max) bad_field(where, key, expected(), v);
  return x;
}

int64_t require_int(const json& j, const char* key, const char* where, int64_t min, int64_t max) {
  const json& v = require_field(j, key, where);
  auto expected = [&] { return "an integer " + std::to_string(min) + ".." + std::to_string(max); };
  if (!v.is_number_integer()) bad_field(where, key, expected(), v);
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (max < 0 || u > static_cast<uint64_t>(max) || static_cast<int64_t>(u) < min) bad_field(where, key, expected(), v);
    return static_cast<int64_t>(u);
  }
  int64_t x = v.get<int64_t>();
  if (x < min || x > max) bad_field(where, key, expected(), v);
  return x;
}

std::string require_string(const json& j, const char* key, const char* where, size_t max_length) {
  const json& v = require_field(j, key, where);
  if (!v.is_string() || v.get_ref<const std::string&>().size() > max_length)
    bad_field(where, key, "a string of at most " + std::to_string(max_length) + " bytes", v);
  return v.get<std::string>();
}

const json& require_object(const json& j, const char* key, const char* where) {
  const json& v = require_field(j, key, where);
  if (!v.is_object()) bad_field(where, key, "an object", v);
  return v;
}

const json& require_array(const json& j, const char* key, const char* where) {
  const json& v = require_field(j, key, where);
  if (!v.is_array()) bad_field(where, key, "an array", v);
  return v;
}

}  // namespace sluice::bootstrap
