#include "store_directory.hpp"

#include <algorithm>

#include "sluice/error.hpp"

namespace sluice::torch_backend {

StoreDirectory::StoreDirectory(c10::intrusive_ptr<c10d::Store> store, int rank, std::string prefix)
    : store_(std::move(store)), rank_(rank), prefix_(std::move(prefix)) {
  if (!store_) throw Error(ErrorCode::kInvalidArgument, "sluice torch backend: no c10d Store given");
}

void StoreDirectory::publish(const detail::EngineInfo& self) {
  std::string blob = self.dump();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (published_) return;
    published_ = true;
    rank_by_engine_[self.engine_id] = rank_;
  }
  store_->set(key(rank_), std::vector<uint8_t>(blob.begin(), blob.end()));
}

void StoreDirectory::withdraw(const std::string&) {
  // Keys stay: a PrefixStore per group makes them unique, and a peer that still looks this
  // rank up finds a listener that refuses it rather than waiting for the deadline.
}

bool StoreDirectory::wants_updates() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !published_;
}

detail::EngineInfo StoreDirectory::lookup(const std::string& ref, Clock::time_point deadline) {
  int peer = -1;
  if (ref.rfind("rank:", 0) == 0) {
    try {
      size_t used = 0;
      peer = std::stoi(ref.substr(5), &used);
      if (used != ref.size() - 5) peer = -1;
    } catch (const std::exception&) {
      peer = -1;
    }
  }
  if (peer < 0) throw Error(ErrorCode::kInvalidArgument, "store directory: '" + ref + "' is not 'rank:<r>'");
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) left = std::chrono::milliseconds(1);
  try {
    store_->wait({key(peer)}, left);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kTimeout, "store directory: rank " + std::to_string(peer) + " published no engine info within " +
                                         std::to_string(left.count()) + " ms (" + e.what() + ")");
  }
  auto bytes = store_->get(key(peer));
  auto info = detail::EngineInfo::parse(std::string(bytes.begin(), bytes.end()));
  std::lock_guard<std::mutex> lk(mu_);
  rank_by_engine_[info.engine_id] = peer;
  return info;
}

std::string StoreDirectory::ref_for(const detail::EngineInfo& peer) const {
  int r = rank_of(peer.engine_id);
  return r >= 0 ? ref(r) : peer.engine_id;
}

int StoreDirectory::rank_of(const std::string& engine_id) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = rank_by_engine_.find(engine_id);
  return it == rank_by_engine_.end() ? -1 : it->second;
}

}  // namespace sluice::torch_backend
