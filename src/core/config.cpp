// EngineConfig's fields as rows of the parameter table (core/params.hpp), and the resolution
// of a config: options and fields checked, SLUICE_* variables applied on top.
#include "sluice/config.hpp"

#include <chrono>
#include <set>
#include <string>

#include "core/params.hpp"
#include "directory/directory_url.hpp"
#include "sluice/error.hpp"

namespace sluice {
namespace {

using detail::ParamScope;
using detail::ParamSpec;
using detail::param_error;

// A field of EngineConfig: `show` formats it, `parse_into` parses text into it. The default is
// the struct's own initialiser, so it is written once, in the public header.
template <class Show, class Parse>
bool field(const char* name, const char* env, const char* doc, Show show, Parse parse_into) {
  ParamSpec s;
  s.name = name;
  s.env = env;
  s.doc = doc;
  s.default_text = show(EngineConfig{});
  s.scope = ParamScope::kEngine;
  s.apply = [parse_into](EngineConfig& c, const std::string& where, const std::string& text) {
    parse_into(c, where, text);
  };
  s.show = show;
  detail::register_param(std::move(s));
  return true;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : text + ",") {
    if (ch == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else if (ch != ' ') {
      cur += ch;
    }
  }
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

const char* level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
    case LogLevel::kTrace: return "trace";
  }
  return "warn";
}

LogLevel parse_level(const std::string& where, const std::string& s) {
  if (s == "error") return LogLevel::kError;
  if (s == "warn" || s == "warning") return LogLevel::kWarn;
  if (s == "info") return LogLevel::kInfo;
  if (s == "debug") return LogLevel::kDebug;
  if (s == "trace") return LogLevel::kTrace;
  param_error(where, s, "is not one of error, warn, info, debug, trace");
}

// Durations in milliseconds are plain integers; a week bounds them so that deadline arithmetic
// cannot overflow.
constexpr int kMaxMs = 7 * 24 * 3600 * 1000;

template <class Member>
auto ms_show(Member m) {
  return [m](const EngineConfig& c) { return std::to_string((c.*m).count()); };
}
template <class Member>
auto ms_parse(Member m, int lo) {
  return [m, lo](EngineConfig& c, const std::string& w, const std::string& t) {
    c.*m = std::chrono::milliseconds(detail::int_in(lo, kMaxMs)(w, t));
  };
}
template <class Member>
auto u64_show(Member m) {
  return [m](const EngineConfig& c) { return std::to_string(c.*m); };
}
template <class Member>
auto u64_parse(Member m, uint64_t lo, uint64_t hi) {
  return [m, lo, hi](EngineConfig& c, const std::string& w, const std::string& t) { c.*m = detail::size_in(lo, hi)(w, t); };
}
template <class Member>
auto int_parse(Member m, int lo, int hi) {
  return [m, lo, hi](EngineConfig& c, const std::string& w, const std::string& t) { c.*m = detail::int_in(lo, hi)(w, t); };
}

// Counts and sizes take K/M/G suffixes; `int` counts are plain integers.
const bool kFieldsDeclared[] = {
    field("transports", "SLUICE_TRANSPORTS", "transports this engine may use, comma-separated; empty = every one that runs here",
          [](const EngineConfig& c) { return join(c.transports); },
          [](EngineConfig& c, const std::string&, const std::string& t) { c.transports = split_list(t); }),
    field("channels", "SLUICE_CHANNELS", "channels per peer (tcp connections, rdma queue pairs), 1..64",
          u64_show(&EngineConfig::channels), int_parse(&EngineConfig::channels, 1, 64)),
    field("listen", "SLUICE_LISTEN", "handshake listener host:port; port 0 picks a free one",
          [](const EngineConfig& c) { return c.listen_host + ":" + std::to_string(c.listen_port); },
          [](EngineConfig& c, const std::string& w, const std::string& t) {
            auto colon = t.rfind(':');
            if (colon == std::string::npos) param_error(w, t, "is not host:port");
            c.listen_port = static_cast<uint16_t>(detail::int_in(0, 65535)(w, t.substr(colon + 1)));
            c.listen_host = t.substr(0, colon);
          }),
    field("host_id", "SLUICE_HOST_ID", "host identity for same-host detection; empty = hostname and boot id",
          [](const EngineConfig& c) { return c.host_id; },
          [](EngineConfig& c, const std::string&, const std::string& t) { c.host_id = t; }),
    field("connect_timeout_ms", "SLUICE_CONNECT_TIMEOUT_MS", "deadline for connecting and for the handshake",
          ms_show(&EngineConfig::connect_timeout), ms_parse(&EngineConfig::connect_timeout, 1)),
    field("op_timeout_ms", "SLUICE_OP_TIMEOUT_MS", "an operation without progress from its peer this long fails with kTimeout",
          ms_show(&EngineConfig::op_timeout), ms_parse(&EngineConfig::op_timeout, 1)),
    field("recv_timeout_ms", "SLUICE_RECV_TIMEOUT_MS", "recv()/imm_recv() unmatched this long complete with kTimeout; 0 = never",
          ms_show(&EngineConfig::recv_timeout), ms_parse(&EngineConfig::recv_timeout, 0)),
    field("chunk_size", "SLUICE_CHUNK_SIZE", "pieces larger than this are split (bytes, >= 4K)",
          u64_show(&EngineConfig::chunk_size), u64_parse(&EngineConfig::chunk_size, 4096, 1ull << 40)),
    field("stripe_threshold", "SLUICE_STRIPE_THRESHOLD", "batches larger than this are striped over the channels (bytes)",
          u64_show(&EngineConfig::stripe_threshold), u64_parse(&EngineConfig::stripe_threshold, 0, UINT64_MAX)),
    field("max_unexpected_bytes", "SLUICE_MAX_UNEXPECTED_BYTES", "bytes of unmatched incoming sends buffered before the peer is refused",
          u64_show(&EngineConfig::max_unexpected_bytes), u64_parse(&EngineConfig::max_unexpected_bytes, 0, UINT64_MAX)),
    field("max_unexpected_messages", "SLUICE_MAX_UNEXPECTED_MESSAGES", "unmatched incoming sends buffered per endpoint before the peer is refused",
          u64_show(&EngineConfig::max_unexpected_messages), u64_parse(&EngineConfig::max_unexpected_messages, 0, UINT64_MAX)),
    field("max_handshakes", "SLUICE_MAX_HANDSHAKES", "connections being handshaken at once; more are closed at accept, 1..4096",
          u64_show(&EngineConfig::max_handshakes), int_parse(&EngineConfig::max_handshakes, 1, 4096)),
    field("max_handshake_bytes", "SLUICE_MAX_HANDSHAKE_BYTES", "largest handshake message body accepted (bytes, 4K..1G)",
          u64_show(&EngineConfig::max_handshake_bytes), u64_parse(&EngineConfig::max_handshake_bytes, 4096, 1ull << 30)),
    field("max_pending_accepts", "SLUICE_MAX_PENDING_ACCEPTS", "endpoints opened by peers waiting for accept(); more are refused",
          u64_show(&EngineConfig::max_pending_accepts), int_parse(&EngineConfig::max_pending_accepts, 1, 1 << 20)),
    field("max_queued_responses", "SLUICE_MAX_QUEUED_RESPONSES", "read responses a peer may leave unread per channel before it fails",
          u64_show(&EngineConfig::max_queued_responses), int_parse(&EngineConfig::max_queued_responses, 1, 1 << 20)),
    field("busy_wait_us", "SLUICE_BUSY_WAIT_US", "Future::wait() polls this long before sleeping (tcp and shm waiters poll their sockets); -1 = 0 on <= 2 hardware threads, else 20",
          u64_show(&EngineConfig::busy_wait_us), int_parse(&EngineConfig::busy_wait_us, -1, 1000000)),
    field("log_level", "SLUICE_LOG_LEVEL", "error, warn, info, debug or trace",
          [](const EngineConfig& c) { return std::string(level_name(c.log_level)); },
          [](EngineConfig& c, const std::string& w, const std::string& t) { c.log_level = parse_level(w, t); }),
    field("directory", "SLUICE_DIRECTORY", "where engines publish themselves and find peers by name: '' (by listener host:port), etcd://h:2379[,h2:2379][/prefix], redis://h:6379[/db][?prefix=p]",
          [](const EngineConfig& c) { return c.directory; },
          [](EngineConfig& c, const std::string& w, const std::string& t) {
            try {
              detail::parse_directory_url(t);
            } catch (const Error& e) {
              param_error(w, t, e.what());
            }
            c.directory = t;
          }),
    field("name", "SLUICE_NAME", "this engine's name in the directory (connect(name)); empty = its engine id",
          [](const EngineConfig& c) { return c.name; },
          [](EngineConfig& c, const std::string& w, const std::string& t) {
            if (!t.empty()) detail::check_engine_name(w, t);
            c.name = t;
          }),
};

bool is_field(const ParamSpec& p) { return p.name.find('.') == std::string::npos; }

// The row for `key`, or kInvalidArgument saying what is wrong with it.
const ParamSpec& spec_for(const std::string& key) {
  if (const ParamSpec* p = detail::find_param(key)) {
    if (p->scope != ParamScope::kEngine)
      throw Error(ErrorCode::kInvalidArgument, "'" + key + "' is read from " + p->env + " where it is used, not from a config");
    return *p;
  }
  auto dot = key.find('.');
  std::set<std::string> namespaces;
  std::string keys;
  for (const ParamSpec* p : detail::param_table()) {
    auto d = p->name.find('.');
    if (d == std::string::npos) continue;
    namespaces.insert(p->name.substr(0, d));
    if (dot != std::string::npos && p->name.compare(0, dot + 1, key, 0, dot + 1) == 0 && p->scope == ParamScope::kEngine)
      keys += (keys.empty() ? "" : ", ") + p->name;
  }
  if (dot == std::string::npos)
    throw Error(ErrorCode::kInvalidArgument, "unknown parameter '" + key + "' (sluice-bench --list-params lists them)");
  std::string ns = key.substr(0, dot);
  if (!namespaces.count(ns)) {
    std::string known;
    for (const auto& n : namespaces) known += (known.empty() ? "" : ", ") + n;
    throw Error(ErrorCode::kInvalidArgument,
                "option '" + key + "': no transport in this build owns the namespace '" + ns + "' (owned: " + known + ")");
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown option '" + key + "' (" + ns + " has: " + keys + ")");
}

}  // namespace

EngineConfig& EngineConfig::set(const std::string& key, const std::string& value) {
  spec_for(key).apply(*this, key, value);
  return *this;
}

std::string EngineConfig::get(const std::string& key) const { return spec_for(key).show(*this); }

EngineConfig EngineConfig::from_env(EngineConfig c) {
  // Options from code first, so that an error names the key the caller wrote.
  for (const auto& [key, value] : c.options) {
    if (key.find('.') == std::string::npos)
      throw Error(ErrorCode::kInvalidArgument,
                  "option '" + key + "' is not '<transport>.<key>' (fields are set on EngineConfig or with set())");
    EngineConfig scratch;
    spec_for(key).apply(scratch, key, value);
  }
  for (const ParamSpec* p : detail::param_table())
    if (p->scope == ParamScope::kEngine)
      if (const char* v = detail::env_text(p->env)) p->apply(c, p->env, v);
  // Fields set from code pass the same parsers and bounds as the variables (the error names
  // the field).
  for (const ParamSpec* p : detail::param_table()) {
    if (p->scope != ParamScope::kEngine || !is_field(*p)) continue;
    EngineConfig scratch;
    p->apply(scratch, p->name, p->show(c));
  }
  return c;
}

}  // namespace sluice
