#include "directory/store_directory.hpp"

#include <chrono>

#include "bootstrap/messages.hpp"
#include "core/log.hpp"
#include "directory/directory_url.hpp"
#include "directory/listener_directory.hpp"
#include "sluice/error.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

// Format version of the record (docs/cluster.md).
constexpr int kRecordVersion = 1;
// A record holds an engine's info: its regions make it grow, but never near this.
constexpr size_t kMaxRecordBytes = 16u << 20;

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The engine that holds `value`, for messages ("engine 1a2b... listening on h:p").
std::string holder_text(const std::string& key, const std::string& value) {
  try {
    EngineInfo other = StoreDirectory::decode(key, value);
    return "engine " + other.engine_id + " (listening on " + other.listen_address() + ")";
  } catch (const Error& e) {
    return std::string("an unreadable entry (") + e.what() + ")";
  }
}

}  // namespace

std::string StoreDirectory::encode(const EngineInfo& info) {
  return json{{"sluice_directory", kRecordVersion},
              {"name", name_of(info)},
              {"incarnation", info.engine_id},
              {"published_unix_ms", unix_ms()},
              {"info", info.to_json()}}
      .dump();
}

EngineInfo StoreDirectory::decode(const std::string& key, const std::string& value) {
  std::string where = "directory entry '" + key + "'";
  if (value.size() > kMaxRecordBytes)
    throw Error(ErrorCode::kProtocol, where + " is " + std::to_string(value.size()) + " bytes, more than the " +
                                          std::to_string(kMaxRecordBytes) + " accepted");
  bootstrap::check_json_depth(value, "directory entry");
  json j = json::parse(value, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw Error(ErrorCode::kProtocol, where + " is not a JSON object");
  int64_t version = bootstrap::require_int(j, "sluice_directory", where.c_str(), 0, INT32_MAX);
  if (version != kRecordVersion)
    throw Error(ErrorCode::kProtocol, where + " has record version " + std::to_string(version) + ", this build reads " +
                                          std::to_string(kRecordVersion));
  std::string incarnation = bootstrap::require_string(j, "incarnation", where.c_str(), 256);
  EngineInfo info = EngineInfo::from_json(bootstrap::require_object(j, "info", where.c_str()));
  // The incarnation is the engine id: a record whose two disagree was not written by us.
  if (info.engine_id != incarnation)
    throw Error(ErrorCode::kProtocol, where + ": incarnation '" + incarnation + "' is not the engine id '" +
                                          info.engine_id + "' of its info");
  return info;
}

StoreDirectory::StoreDirectory(std::unique_ptr<StoreBackend> backend, StoreDirectoryOptions options)
    : backend_(std::move(backend)), opt_(std::move(options)) {}

StoreDirectory::~StoreDirectory() { stop_heartbeat(); }

PeerDirectory::Clock::time_point StoreDirectory::request_deadline(Clock::time_point limit) const {
  return std::min(limit, Clock::now() + opt_.request_timeout);
}

uint64_t StoreDirectory::heartbeats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return heartbeats_;
}

std::string StoreDirectory::ref_for(const EngineInfo& peer) const { return name_of(peer); }

void StoreDirectory::publish(const EngineInfo& self) {
  std::lock_guard<std::mutex> pub(publish_mu_);
  const std::string key = key_for(name_of(self));
  const std::string value = encode(self);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;  // withdrawn: the engine is closing
    if (!registered_) {
      key_ = key;
      engine_id_ = self.engine_id;
    }
    value_ = value;
  }
  if (!registered_) {
    register_first(key, value, self.engine_id);
    std::lock_guard<std::mutex> lk(mu_);
    registered_ = true;
    heartbeat_ = std::thread([this] {
      ::sluice::detail::name_this_thread("sluice-dir-beat");
      heartbeat_loop();
    });
    return;
  }
  // A region was registered or unregistered: peers that refresh now should see it, so the
  // update is written at once; when the store is down the heartbeat writes it later.
  try {
    if (backend_->update(key, value, request_deadline())) return;
    SLUICE_LOG(kWarn, "directory " << opt_.display << ": our entry '" << key << "' is gone; the heartbeat publishes it again");
  } catch (const Error& e) {
    SLUICE_LOG(kWarn, "directory " << opt_.display << ": could not update '" << key << "' (" << e.what()
                                   << "); the heartbeat retries");
  }
  std::lock_guard<std::mutex> lk(mu_);
  dirty_ = true;
  cv_.notify_all();
}

void StoreDirectory::register_first(const std::string& key, const std::string& value, const std::string& engine_id) {
  const auto deadline = Clock::now() + opt_.register_timeout;
  auto backoff = 10ms;
  std::string last_error;
  for (;;) {
    try {
      // Each request may take the whole registration budget, not request_timeout: a store
      // swamped by a cluster starting at once answers late but answers, and abandoning its
      // queued requests only to send them again is what collapses it (measured: 1,000 etcd
      // clients at once on a loaded host, docs/cluster.md). A dead endpoint is still skipped
      // after request_timeout (the backends bound connecting by it).
      auto holder = backend_->create(key, value, deadline);
      if (!holder) return;
      // Our own entry (a store restored from a snapshot, a retried create that had landed).
      try {
        if (decode(key, *holder).engine_id == engine_id && backend_->update(key, value, deadline))
          return;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kProtocol) throw;
      }
      throw Error(ErrorCode::kInvalidArgument,
                  "directory " + opt_.display + ": the name '" + key.substr(opt_.prefix.size() + 1) +
                      "' is already registered by " + holder_text(key, *holder) +
                      "; choose another name, or wait for that engine's entry to expire (at most " +
                      std::to_string(opt_.ttl.count()) + " ms after it stopped)");
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kInvalidArgument) throw;
      last_error = e.what();
    }
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    // A request with no time left would only replace the store's real answer with "no time".
    if (Clock::now() >= deadline) break;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
  // A create whose reply was lost to the timeout may still have landed: take it back, so that
  // the engine retried under the same name is not refused by its own failed attempt for a
  // TTL. Bounded and best effort (an unreachable store costs nothing: no lease, no request).
  try {
    backend_->remove(key, Clock::now() + std::min<std::chrono::milliseconds>(opt_.request_timeout, 1000ms));
  } catch (const Error&) {
  }
  throw Error(ErrorCode::kTimeout, "directory " + opt_.display + ": could not register '" + key + "' within " +
                                       std::to_string(opt_.register_timeout.count()) + " ms: " + last_error);
}

bool StoreDirectory::republish() {
  std::string key, value, engine_id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    key = key_;
    value = value_;
    engine_id = engine_id_;
    dirty_ = false;
  }
  try {
    if (backend_->update(key, value, request_deadline())) return true;
    auto holder = backend_->create(key, value, request_deadline());
    if (!holder) return true;
    if (decode(key, *holder).engine_id == engine_id && backend_->update(key, value, request_deadline())) return true;
    SLUICE_LOG(kError, "directory " << opt_.display << ": our name '" << key << "' is now held by "
                                    << holder_text(key, *holder)
                                    << "; this engine cannot be found by name until that entry is gone");
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    dirty_ = true;
    throw;
  }
  std::lock_guard<std::mutex> lk(mu_);
  dirty_ = true;
  return false;
}

void StoreDirectory::heartbeat_loop() {
  // Three beats per TTL: one lost request (bounded by request_timeout) still leaves time.
  const auto period = std::max<std::chrono::milliseconds>(opt_.ttl / 3, 10ms);
  bool reported_down = false;
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, period, [&] { return stop_ || dirty_; });
    if (stop_) break;
    bool dirty = dirty_;
    std::string key = key_;
    lk.unlock();
    bool healthy = true;
    try {
      if (dirty) {
        healthy = republish();
      } else if (!backend_->keep_alive(key, request_deadline())) {
        SLUICE_LOG(kWarn, "directory " << opt_.display << ": our entry '" << key
                                       << "' expired or the store lost it; publishing it again");
        healthy = republish();
      }
      if (reported_down) SLUICE_LOG(kWarn, "directory " << opt_.display << ": reachable again");
      reported_down = false;
    } catch (const std::exception& e) {
      // Said once per outage: the store being down is one event, not one per beat.
      if (!reported_down)
        SLUICE_LOG(kWarn, "directory " << opt_.display << ": heartbeat failed (" << e.what()
                                       << "); retrying every " << period.count() << " ms");
      reported_down = true;
      healthy = false;
    }
    lk.lock();
    ++heartbeats_;
    // A failed beat retries after a period, not at once (dirty_ would wake the wait).
    if (!healthy) cv_.wait_for(lk, period, [&] { return stop_; });
  }
}

void StoreDirectory::stop_heartbeat() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (heartbeat_.joinable() && heartbeat_.get_id() != std::this_thread::get_id()) heartbeat_.join();
}

void StoreDirectory::withdraw(const std::string& engine_id) {
  std::lock_guard<std::mutex> pub(publish_mu_);
  stop_heartbeat();
  std::string key;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!registered_ || engine_id != engine_id_) return;
    registered_ = false;
    key = key_;
  }
  try {
    backend_->remove(key, request_deadline());
  } catch (const Error& e) {
    SLUICE_LOG(kWarn, "directory " << opt_.display << ": could not withdraw '" << key << "' (" << e.what()
                                   << "); it expires within " << opt_.ttl.count() << " ms");
  }
}

std::optional<std::string> StoreDirectory::owner_of(const std::string& ref, Clock::time_point deadline) {
  if (ref.empty() || ref.find(':') != std::string::npos) return std::nullopt;  // an address
  try {
    const std::string key = key_for(ref);
    auto value = backend_->get(key, request_deadline(deadline));
    if (!value) return std::nullopt;
    return decode(key, *value).engine_id;
  } catch (const Error&) {
    return std::nullopt;  // unreachable or malformed: the next watch asks again
  }
}

EngineInfo StoreDirectory::lookup(const std::string& ref, Clock::time_point deadline) {
  // A listener address still works with a store directory configured: names have no ':'.
  if (ref.find(':') != std::string::npos) return ListenerDirectory().lookup(ref, deadline);
  check_engine_name("connect", ref);
  const std::string key = key_for(ref);
  auto backoff = 5ms;
  std::string last_error;
  bool seen_absent = false;  // the store answered at least once, and the name was not there
  for (;;) {
    try {
      auto value = backend_->get(key, request_deadline(deadline));
      if (value) return decode(key, *value);
      last_error.clear();
      seen_absent = true;
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kProtocol) throw;
      last_error = e.what();
    }
    // Absent: a peer still starting, or one restarting under the same name.
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    // Sleeping up to the deadline leaves no time for a request: its "no time left" would hide
    // what the last real answer was (absent, or which error).
    if (Clock::now() >= deadline) break;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(100));
  }
  // A store that answered "absent" and then was slow on the request the deadline cut short
  // still told us the name is missing: say that first, and what the last request hit.
  if (!last_error.empty() && seen_absent)
    throw Error(ErrorCode::kTimeout, "directory " + opt_.display + ": no engine named '" + ref +
                                         "' was registered before the deadline (key '" + key +
                                         "'; the last lookup did not finish: " + last_error + ")");
  if (!last_error.empty())
    throw Error(ErrorCode::kTimeout,
                "directory " + opt_.display + ": could not look up '" + ref + "' before the deadline: " + last_error);
  throw Error(ErrorCode::kTimeout, "directory " + opt_.display + ": no engine named '" + ref +
                                       "' was registered before the deadline (key '" + key + "')");
}

}  // namespace sluice::detail
