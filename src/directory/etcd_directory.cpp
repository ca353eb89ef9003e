#include "directory/etcd_directory.hpp"

#if SLUICE_HAVE_ETCD

#include <curl/curl.h>

#include <atomic>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/log.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {
namespace {

using nlohmann::json;
using Clock = StoreBackend::Clock;

// A gateway reply larger than this is not an answer to our requests.
constexpr size_t kMaxReplyBytes = 32u << 20;

std::string base64(const std::string& in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += k[(v >> s) & 63];
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint8_t(in[i]) << 16;
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += k[(v >> 18) & 63];
    out += k[(v >> 12) & 63];
    out += k[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string unbase64(const std::string& in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v;
    if (c >= 'A' && c <= 'Z') v = c - 'A';
    else if (c >= 'a' && c <= 'z') v = c - 'a' + 26;
    else if (c >= '0' && c <= '9') v = c - '0' + 52;
    else if (c == '+') v = 62;
    else if (c == '/') v = 63;
    else if (c == '=') break;
    else throw Error(ErrorCode::kProtocol, "etcd: a value is not valid base64");
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

// etcd's gateway writes 64-bit integers as JSON strings.
int64_t as_int(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (const std::exception&) {
    }
  }
  throw Error(ErrorCode::kProtocol, std::string("etcd: field '") + key + "' is not an integer");
}

size_t collect(char* data, size_t size, size_t n, void* user) {
  auto* out = static_cast<std::string*>(user);
  if (out->size() + size * n > kMaxReplyBytes) return 0;  // makes curl fail the transfer
  out->append(data, size * n);
  return size * n;
}

class EtcdBackend final : public StoreBackend {
 public:
  explicit EtcdBackend(EtcdEndpoints ep) : ep_(std::move(ep)) {
    static std::once_flag once;
    std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    ttl_s_ = std::max<int64_t>(1, (ep_.ttl.count() + 999) / 1000);
  }
  ~EtcdBackend() override {
    for (CURL* h : idle_) curl_easy_cleanup(h);
  }

  std::optional<std::string> create(const std::string& key, const std::string& value, Clock::time_point deadline) override {
    auto txn = [&](int64_t lease) {
      return json{{"compare", json::array({{{"target", "CREATE"}, {"key", base64(key)}, {"createRevision", "0"}}})},
                  {"success", json::array({{{"requestPut", put_body(key, value, lease)}}})},
                  {"failure", json::array({{{"requestRange", {{"key", base64(key)}}}}})}};
    };
    int64_t lease = lease_or_grant(deadline);
    json r;
    try {
      r = post("/v3/kv/txn", txn(lease), deadline);
    } catch (const Error& e) {
      // Our lease expired before the heartbeat noticed: take a new one.
      if (!lease_not_found(e)) throw;
      forget_lease(lease);
      r = post("/v3/kv/txn", txn(lease_or_grant(deadline)), deadline);
    }
    if (r.value("succeeded", false)) return std::nullopt;
    for (const auto& resp : r.value("responses", json::array())) {
      auto range = resp.find("response_range");
      if (range == resp.end()) continue;
      if (auto v = first_value(*range)) return v;
    }
    // Deleted between the compare and the range: report it as held by nobody we can name.
    return std::string("{}");
  }

  bool update(const std::string& key, const std::string& value, Clock::time_point deadline) override {
    int64_t lease = current_lease();
    if (lease == 0) return false;
    // Only while the key is still attached to our lease: never over another engine's entry.
    json txn = {{"compare", json::array({{{"target", "LEASE"}, {"key", base64(key)}, {"lease", std::to_string(lease)}}})},
                {"success", json::array({{{"requestPut", put_body(key, value, lease)}}})}};
    try {
      return post("/v3/kv/txn", txn, deadline).value("succeeded", false);
    } catch (const Error& e) {
      if (!lease_not_found(e)) throw;
      forget_lease(lease);
      return false;
    }
  }

  bool keep_alive(const std::string& key, Clock::time_point deadline) override {
    int64_t lease = current_lease();
    if (lease == 0) return false;
    // The gateway streams keepalive replies; one request gets one {"result": ...} and the
    // stream ends with the request body.
    json r = post("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, deadline);
    const json& res = r.contains("result") ? r["result"] : r;
    if (as_int(res, "TTL") > 0) return true;
    forget_lease(lease);  // expired (or unknown to a store that restarted empty)
    return false;
  }

  std::optional<std::string> get(const std::string& key, Clock::time_point deadline) override {
    return first_value(post("/v3/kv/range", {{"key", base64(key)}}, deadline));
  }

  void remove(const std::string& key, Clock::time_point deadline) override {
    int64_t lease = current_lease();
    if (lease == 0) return;
    // Revoking the lease deletes exactly the keys attached to it: ours, never another's.
    post("/v3/lease/revoke", {{"ID", std::to_string(lease)}}, deadline);
    forget_lease(lease);
  }

 private:
  static json put_body(const std::string& key, const std::string& value, int64_t lease) {
    return {{"key", base64(key)}, {"value", base64(value)}, {"lease", std::to_string(lease)}};
  }

  static bool lease_not_found(const Error& e) {
    return e.code() == ErrorCode::kProtocol && std::string(e.what()).find("lease not found") != std::string::npos;
  }

  static std::optional<std::string> first_value(const json& range) {
    auto kvs = range.find("kvs");
    if (kvs == range.end() || !kvs->is_array() || kvs->empty()) return std::nullopt;
    const json& kv = (*kvs)[0];
    if (!kv.is_object()) throw Error(ErrorCode::kProtocol, "etcd: a range reply entry is not an object");
    auto v = kv.find("value");
    if (v == kv.end()) return std::string();
    if (!v->is_string()) throw Error(ErrorCode::kProtocol, "etcd: a range reply value is not a string");
    return unbase64(v->get<std::string>());
  }

  int64_t current_lease() {
    std::lock_guard<std::mutex> lk(lease_mu_);
    return lease_;
  }
  void forget_lease(int64_t lease) {
    std::lock_guard<std::mutex> lk(lease_mu_);
    if (lease_ == lease) lease_ = 0;
  }
  int64_t lease_or_grant(Clock::time_point deadline) {
    std::lock_guard<std::mutex> lk(lease_mu_);
    if (lease_ != 0) return lease_;
    json r = post("/v3/lease/grant", {{"TTL", std::to_string(ttl_s_)}}, deadline);
    int64_t id = as_int(r, "ID");
    if (id == 0) throw Error(ErrorCode::kProtocol, "etcd: lease grant returned no lease id: " + r.dump().substr(0, 200));
    lease_ = id;
    return lease_;
  }

  CURL* take_handle() {
    {
      std::lock_guard<std::mutex> lk(pool_mu_);
      if (!idle_.empty()) {
        CURL* h = idle_.back();
        idle_.pop_back();
        return h;
      }
    }
    CURL* h = curl_easy_init();
    if (!h) throw Error(ErrorCode::kSystem, "etcd: curl_easy_init failed");
    return h;
  }
  void give_handle(CURL* h) {
    std::lock_guard<std::mutex> lk(pool_mu_);
    idle_.push_back(h);
  }

  // POSTs `body` to `path` on the first endpoint that answers, starting with the last good one.
  json post(const std::string& path, const json& body, Clock::time_point deadline) {
    const std::string text = body.dump();
    std::string errors;
    const size_t n = ep_.hosts.size();
    const size_t first = good_.load();
    for (size_t k = 0; k < n; ++k) {
      size_t i = (first + k) % n;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const auto& [host, port] = ep_.hosts[i];
      const std::string where = host + ":" + std::to_string(port);
      if (left.count() <= 0) {
        errors += (errors.empty() ? "" : "; ") + where + ": no time left";
        break;
      }
      std::string reply;
      long status = 0;
      CURLcode rc = perform(host, port, path, text, left, &reply, &status);
      if (rc == CURLE_OK && status == 200) {
        good_.store(i);
        json j = json::parse(reply, nullptr, /*allow_exceptions=*/false);
        if (j.is_discarded() || !j.is_object())
          throw Error(ErrorCode::kProtocol, "etcd " + where + path + ": the reply is not a JSON object");
        return j;
      }
      std::string why = rc != CURLE_OK ? curl_easy_strerror(rc) : "HTTP " + std::to_string(status) + " " + reply.substr(0, 200);
      // 4xx: the request itself is wrong; another member would refuse it too.
      if (rc == CURLE_OK && status >= 400 && status < 500)
        throw Error(ErrorCode::kProtocol, "etcd " + where + path + " refused the request: " + why);
      errors += (errors.empty() ? "" : "; ") + where + ": " + why;
    }
    throw Error(ErrorCode::kSystem, "no etcd endpoint answered " + path + " (" + errors + ")");
  }

  CURLcode perform(const std::string& host, uint16_t port, const std::string& path, const std::string& body,
                   std::chrono::milliseconds timeout, std::string* reply, long* status) {
    CURL* h = take_handle();
    std::string host_part = host.find(':') != std::string::npos ? "[" + host + "]" : host;
    std::string url = "http://" + host_part + ":" + std::to_string(port) + path;
    curl_easy_reset(h);
    curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(h, CURLOPT_POST, 1L);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, reply);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<int64_t>(1, timeout.count())));
    // A dead endpoint fails at connect, soon; one that accepted may be slow but is working.
    auto connect = std::min(timeout, ep_.connect_timeout);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::max<int64_t>(1, connect.count())));
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM from curl's resolver in a threaded program
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http");
    curl_easy_setopt(h, CURLOPT_PROXY, "");  // a loopback etcd must not go through an http_proxy
    struct curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
    CURLcode rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, status);
    curl_slist_free_all(headers);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, nullptr);
    give_handle(h);  // keeps its connection open for the next request
    return rc;
  }

  EtcdEndpoints ep_;
  int64_t ttl_s_ = 10;
  std::atomic<size_t> good_{0};
  std::mutex lease_mu_;  // held across a grant, so that concurrent creates share one lease
  int64_t lease_ = 0;
  std::mutex pool_mu_;
  std::vector<CURL*> idle_;
};

}  // namespace

std::unique_ptr<StoreBackend> make_etcd_backend(EtcdEndpoints endpoints) {
  return std::make_unique<EtcdBackend>(std::move(endpoints));
}

}  // namespace sluice::detail

#endif  // SLUICE_HAVE_ETCD
