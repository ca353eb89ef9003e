#include "directory/directory_url.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>

#include "core/engine_info.hpp"
#include "core/params.hpp"
#include "directory/etcd_directory.hpp"
#include "directory/listener_directory.hpp"
#include "directory/redis_directory.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

using namespace std::chrono_literals;

const Param<int> kTtl{"directory.ttl_ms", "SLUICE_DIRECTORY_TTL_MS", 10000, int_in(1000, 3600 * 1000),
                      "a store directory drops an engine's entry this long after its last heartbeat "
                      "(heartbeats every third of it; etcd rounds up to whole seconds)"};
const Param<int> kRequestTimeout{"directory.request_timeout_ms", "SLUICE_DIRECTORY_REQUEST_TIMEOUT_MS", 2000,
                                 int_in(10, 600 * 1000),
                                 "one request to the directory store (per etcd endpoint tried)"};

// -1 = a third of the TTL: a replaced peer's name changes hands at the earliest one TTL after
// it stopped heartbeating, so checking more often gains little. Each check is one store read
// per distinct name the engine dialed (docs/cluster.md, "Watching names").
const Param<int> kWatch{"directory.watch_ms", "SLUICE_DIRECTORY_WATCH_MS", -1, int_in(-1, 3600 * 1000),
                        "how often an engine checks that the names it connected to still lead to the same "
                        "engine, and drops endpoints whose peer was replaced (-1 = a third of directory.ttl_ms, "
                        "0 = never)"};

[[noreturn]] void bad(const std::string& url, const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument, "directory '" + url + "': " + why +
                                               " (expected etcd://host:port[,host:port...][/prefix] or "
                                               "redis://[:password@]host:port[/db][?prefix=p])");
}

std::pair<std::string, uint16_t> host_port(const std::string& url, const std::string& text, uint16_t default_port) {
  if (text.empty()) bad(url, "an empty host");
  if (text.find(':') == std::string::npos || (text.front() == '[' && text.back() == ']'))
    return {text.front() == '[' ? text.substr(1, text.size() - 2) : text, default_port};
  try {
    return split_host_port(text);
  } catch (const Error& e) {
    bad(url, e.what());
  }
}

std::string check_prefix(const std::string& url, std::string p) {
  while (!p.empty() && p.back() == '/') p.pop_back();
  while (!p.empty() && p.front() == '/') p.erase(0, 1);
  if (p.empty()) bad(url, "an empty key prefix");
  if (p.size() > 256) bad(url, "a key prefix longer than 256 bytes");
  for (char c : p)
    if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e)
      bad(url, "a key prefix with a space or control character");
  return p;
}

}  // namespace

void check_engine_name(const std::string& where, const std::string& name) {
  if (name.empty() || name.size() > 128)
    throw Error(ErrorCode::kInvalidArgument, where + ": an engine name must be 1..128 characters, got '" + name + "'");
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-'))
      throw Error(ErrorCode::kInvalidArgument,
                  where + ": engine name '" + name + "' may only hold letters, digits, '.', '_' and '-'");
}

DirectoryUrl parse_directory_url(const std::string& url) {
  DirectoryUrl d;
  if (url.empty() || url == "listener") return d;
  auto scheme_end = url.find("://");
  if (scheme_end == std::string::npos) bad(url, "no scheme");
  std::string scheme = url.substr(0, scheme_end);
  std::string rest = url.substr(scheme_end + 3);
  if (scheme == "etcd") {
    d.kind = DirectoryUrl::Kind::kEtcd;
    auto slash = rest.find('/');
    std::string hosts = rest.substr(0, slash);
    if (slash != std::string::npos) d.prefix = check_prefix(url, rest.substr(slash + 1));
    size_t start = 0;
    while (start <= hosts.size()) {
      auto comma = hosts.find(',', start);
      std::string h = hosts.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      d.endpoints.push_back(host_port(url, h, 2379));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    d.display = url;
    return d;
  }
  if (scheme == "redis") {
    d.kind = DirectoryUrl::Kind::kRedis;
    auto q = rest.find('?');
    std::string query = q == std::string::npos ? "" : rest.substr(q + 1);
    rest = rest.substr(0, q);
    auto at = rest.rfind('@');
    std::string auth;
    if (at != std::string::npos) {
      auth = rest.substr(0, at);
      rest = rest.substr(at + 1);
      // redis://:password@host or redis://user:password@host (the user is ignored: AUTH password)
      auto colon = auth.find(':');
      d.password = colon == std::string::npos ? auth : auth.substr(colon + 1);
    }
    auto slash = rest.find('/');
    d.endpoints.push_back(host_port(url, rest.substr(0, slash), 6379));
    if (slash != std::string::npos && slash + 1 < rest.size()) {
      std::string db = rest.substr(slash + 1);
      auto [p, ec] = std::from_chars(db.data(), db.data() + db.size(), d.db);
      if (ec != std::errc() || p != db.data() + db.size() || d.db < 0 || d.db > 1023)
        bad(url, "database '" + db + "' is not a number 0..1023");
    }
    if (!query.empty()) {
      if (query.rfind("prefix=", 0) != 0 || query.find('&') != std::string::npos)
        bad(url, "unknown query '" + query + "' (only prefix=... is read)");
      d.prefix = check_prefix(url, query.substr(7));
    }
    d.display = "redis://" + std::string(auth.empty() ? "" : "***@") + d.endpoints[0].first + ":" +
                std::to_string(d.endpoints[0].second) + "/" + std::to_string(d.db) + "?prefix=" + d.prefix;
    return d;
  }
  bad(url, "unknown scheme '" + scheme + "'");
}

std::unique_ptr<StoreBackend> make_store_backend(const DirectoryUrl& url, std::chrono::milliseconds ttl,
                                                 std::chrono::milliseconds request_timeout) {
  if (url.kind == DirectoryUrl::Kind::kEtcd) {
#if SLUICE_HAVE_ETCD
    return make_etcd_backend({url.endpoints, ttl, request_timeout});
#else
    throw Error(ErrorCode::kUnsupported,
                "etcd directory requested but this build has no libcurl (install libcurl4-openssl-dev and rebuild)");
#endif
  }
  if (url.kind == DirectoryUrl::Kind::kRedis) {
#if SLUICE_HAVE_REDIS
    return make_redis_backend({url.endpoints[0].first, url.endpoints[0].second, url.db, url.password, ttl});
#else
    throw Error(ErrorCode::kUnsupported,
                "redis directory requested but this build has no hiredis (install libhiredis-dev and rebuild)");
#endif
  }
  throw Error(ErrorCode::kInvalidArgument, "directory '" + url.display + "' is not a store");
}

std::shared_ptr<PeerDirectory> make_directory(const EngineConfig& config) {
  DirectoryUrl url = parse_directory_url(config.directory);
  if (url.kind == DirectoryUrl::Kind::kListener) return std::make_shared<ListenerDirectory>();
  StoreDirectoryOptions opt;
  opt.display = url.display;
  opt.prefix = url.prefix;
  opt.ttl = std::chrono::milliseconds(kTtl.get(config));
  opt.request_timeout = std::chrono::milliseconds(kRequestTimeout.get(config));
  opt.register_timeout = config.connect_timeout;
  const int watch = kWatch.get(config);
  opt.watch = watch < 0 ? opt.ttl / 3 : std::chrono::milliseconds(std::max(watch, watch > 0 ? 10 : 0));
  auto backend = make_store_backend(url, opt.ttl, opt.request_timeout);
  return std::make_shared<StoreDirectory>(std::move(backend), std::move(opt));
}

}  // namespace sluice::detail
