#include "sluice/config.hpp"

#include <charconv>
#include <cstdlib>
#include <string>

#include "sluice/error.hpp"

namespace sluice {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

uint64_t parse_u64(const char* name, const char* text) {
  // Accepts plain integers and K/M/G suffixes (powers of two).
  std::string_view s(text);
  uint64_t mult = 1;
  if (!s.empty()) {
    char c = s.back();
    if (c == 'k' || c == 'K') mult = 1ull << 10;
    if (c == 'm' || c == 'M') mult = 1ull << 20;
    if (c == 'g' || c == 'G') mult = 1ull << 30;
    if (mult != 1) s.remove_suffix(1);
  }
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size())
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + "='" + text + "' is not a number");
  if (v > UINT64_MAX / mult)
    throw Error(ErrorCode::kInvalidArgument, std::string(name) + "='" + text + "' is too large");
  return v * mult;
}

std::vector<std::string> split_list(const char* text) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = text;; ++p) {
    if (*p == ',' || *p == '\0') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
      if (*p == '\0') break;
    } else if (*p != ' ') {
      cur += *p;
    }
  }
  return out;
}

LogLevel parse_level(const char* text) {
  std::string s(text);
  if (s == "error") return LogLevel::kError;
  if (s == "warn" || s == "warning") return LogLevel::kWarn;
  if (s == "info") return LogLevel::kInfo;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "trace") return LogLevel::kTrace;
  throw Error(ErrorCode::kInvalidArgument,
              "SLUICE_LOG_LEVEL='" + s + "' is not one of error, warn, info, debug, trace");
}

}  // namespace

EngineConfig EngineConfig::from_env(EngineConfig c) {
  if (auto v = env("SLUICE_TRANSPORTS")) c.transports = split_list(v);
  if (auto v = env("SLUICE_CHANNELS")) {
    uint64_t n = parse_u64("SLUICE_CHANNELS", v);
    if (n < 1 || n > 64)
      throw Error(ErrorCode::kInvalidArgument, "SLUICE_CHANNELS must be 1..64");
    c.channels = static_cast<int>(n);
  }
  if (auto v = env("SLUICE_LISTEN")) {
    std::string s(v);
    auto colon = s.rfind(':');
    if (colon == std::string::npos)
      throw Error(ErrorCode::kInvalidArgument, "SLUICE_LISTEN='" + s + "' is not host:port");
    c.listen_host = s.substr(0, colon);
    uint64_t port = parse_u64("SLUICE_LISTEN", s.substr(colon + 1).c_str());
    if (port > 65535) throw Error(ErrorCode::kInvalidArgument, "SLUICE_LISTEN port out of range");
    c.listen_port = static_cast<uint16_t>(port);
  }
  if (auto v = env("SLUICE_HOST_ID")) c.host_id = v;
  if (auto v = env("SLUICE_IB_HCA")) c.rdma_devices = v;
  if (auto v = env("SLUICE_IB_GID_INDEX")) {
    uint64_t n = parse_u64("SLUICE_IB_GID_INDEX", v);
    if (n > 65535) throw Error(ErrorCode::kInvalidArgument, "SLUICE_IB_GID_INDEX out of range");
    c.rdma_gid_index = static_cast<int>(n);
  }
  if (auto v = env("SLUICE_CONNECT_TIMEOUT_MS"))
    c.connect_timeout = std::chrono::milliseconds(parse_u64("SLUICE_CONNECT_TIMEOUT_MS", v));
  if (auto v = env("SLUICE_OP_TIMEOUT_MS"))
    c.op_timeout = std::chrono::milliseconds(parse_u64("SLUICE_OP_TIMEOUT_MS", v));
  if (auto v = env("SLUICE_CHUNK_SIZE")) {
    c.chunk_size = parse_u64("SLUICE_CHUNK_SIZE", v);
    if (c.chunk_size < 4096)
      throw Error(ErrorCode::kInvalidArgument, "SLUICE_CHUNK_SIZE='" + std::string(v) + "': chunk_size must be >= 4096");
  }
  if (auto v = env("SLUICE_STRIPE_THRESHOLD")) c.stripe_threshold = parse_u64("SLUICE_STRIPE_THRESHOLD", v);
  if (auto v = env("SLUICE_MAX_UNEXPECTED_BYTES"))
    c.max_unexpected_bytes = parse_u64("SLUICE_MAX_UNEXPECTED_BYTES", v);
  if (auto v = env("SLUICE_MAX_UNEXPECTED_MESSAGES"))
    c.max_unexpected_messages = parse_u64("SLUICE_MAX_UNEXPECTED_MESSAGES", v);
  if (auto v = env("SLUICE_RECV_TIMEOUT_MS"))
    c.recv_timeout = std::chrono::milliseconds(parse_u64("SLUICE_RECV_TIMEOUT_MS", v));
  auto positive_int = [](const char* name, const char* v, uint64_t max) {
    uint64_t n = parse_u64(name, v);
    if (n < 1 || n > max)
      throw Error(ErrorCode::kInvalidArgument, std::string(name) + "='" + v + "' must be 1.." + std::to_string(max));
    return static_cast<int>(n);
  };
  if (auto v = env("SLUICE_MAX_HANDSHAKES")) c.max_handshakes = positive_int("SLUICE_MAX_HANDSHAKES", v, 4096);
  if (auto v = env("SLUICE_MAX_HANDSHAKE_BYTES")) {
    c.max_handshake_bytes = parse_u64("SLUICE_MAX_HANDSHAKE_BYTES", v);
    if (c.max_handshake_bytes < 4096 || c.max_handshake_bytes > (1ull << 30))
      throw Error(ErrorCode::kInvalidArgument, "SLUICE_MAX_HANDSHAKE_BYTES must be 4K..1G");
  }
  if (auto v = env("SLUICE_MAX_PENDING_ACCEPTS"))
    c.max_pending_accepts = positive_int("SLUICE_MAX_PENDING_ACCEPTS", v, 1 << 20);
  if (auto v = env("SLUICE_MAX_QUEUED_RESPONSES"))
    c.max_queued_responses = positive_int("SLUICE_MAX_QUEUED_RESPONSES", v, 1 << 20);
  if (auto v = env("SLUICE_BUSY_WAIT_US")) c.busy_wait_us = static_cast<int>(parse_u64("SLUICE_BUSY_WAIT_US", v));
  if (auto v = env("SLUICE_LOG_LEVEL")) c.log_level = parse_level(v);
  if (c.chunk_size < 4096) throw Error(ErrorCode::kInvalidArgument, "chunk_size must be >= 4096");
  return c;
}

}  // namespace sluice
