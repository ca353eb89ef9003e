#include "transport/rdma/rails.hpp"

#include "core/log.hpp"

namespace sluice::detail::rdma {

std::shared_ptr<Rails> Rails::open(const Verbs* v, const std::string& hca, const std::string& gid_env, std::string* why) {
  auto devs = Device::open_all(v, hca, gid_env, why);
  if (devs.empty()) return nullptr;
  auto r = std::shared_ptr<Rails>(new Rails());
  r->v_ = v;
  r->devs_ = std::move(devs);
  for (auto& d : r->devs_) r->nics_.push_back(d->locality());
  return r;
}

void Rails::stop_sweeper() {
  std::lock_guard<std::mutex> lk(sweeper_mu_);
  stop_.store(true);
  if (reg_) reg_->wake_waiters();
  if (sweeper_.joinable()) sweeper_.join();
  reg_ = nullptr;
}

Rails::~Rails() {
  stop_sweeper();
  for (auto& [k, r] : ranges_) deregister(r.keys);
  regions_.clear();  // releases the pins
}

nlohmann::json Rails::address() const {
  nlohmann::json rails = nlohmann::json::array();
  for (auto& d : devs_) rails.push_back(d->address());
  return {{"link", ethernet() ? "eth" : "ib"}, {"rails", rails}};
}

void Rails::deregister(RegionKeys& k) {
  for (ibv_mr* mr : k.mrs)
    if (mr) v_->dereg_mr(mr);
  k.mrs.clear();
}

uint32_t Rails::near_rails(const RegionEntry& e) const {
  if (devs_.size() <= 1) return 1;
  Locality mem;
  if (e.location.is_host()) {
    mem.numa = numa_node_of(e.base);
  } else {
    std::string id = cuda_pci_bus_id(e.location.device);
    if (!id.empty()) mem = pci_locality("/sys", id);
  }
  return nearest_rails("/sys", mem, nics_);
}

const RegionKeys* Rails::keys_for(const Registry& reg, const RegionEntry* e, Status* st) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = regions_.find(e->id);
  if (it != regions_.end()) return it->second.keys;
  RegionPin region = reg.pin_whole(e->id);  // pinned before the lookup can be outrun by remove()
  if (!region) {
    *st = {ErrorCode::kUnknownHandle, "rdma: region " + std::to_string(e->id) + " is no longer registered"};
    return nullptr;
  }
  auto key = std::make_pair(reinterpret_cast<uintptr_t>(e->base), e->length);
  Range& r = ranges_[key];
  if (r.keys.mrs.empty()) {
    for (auto& d : devs_) {
      ibv_mr* mr = d->register_range(e->base, e->length, e->location, st);
      if (!mr) {
        deregister(r.keys);
        ranges_.erase(key);
        return nullptr;
      }
      r.keys.mrs.push_back(mr);
    }
    r.keys.near = near_rails(*e);
    if (devs_.size() > 1)
      SLUICE_LOG(kDebug, "rdma: region " << e->id << " (" << e->location.to_string() << ") nearest rails mask 0x"
                                         << std::hex << r.keys.near << std::dec);
  }
  r.refs++;
  regions_[e->id] = ByRegion{std::move(region), key, &r.keys};
  return &r.keys;
}

nlohmann::json Rails::rkeys(const Registry& reg) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& e : reg.entries()) {
    Status st;
    const RegionKeys* k = keys_for(reg, e.get(), &st);
    if (!k) continue;
    nlohmann::json keys = nlohmann::json::array();
    for (ibv_mr* mr : k->mrs) keys.push_back(mr->rkey);
    out[std::to_string(e->id)] = keys;
  }
  return out;
}

void Rails::start_sweeper(const Registry* reg) {
  reg_ = reg;
  sweeper_ = std::thread([this, reg] {
    uint64_t seen = reg->generation();
    bool waiting = false;
    while (!stop_.load()) {
      // Sleep until a region comes or goes; poll every 10 ms only while a removed region
      // still has operations in flight.
      uint64_t g = reg->wait_generation(seen, waiting ? std::chrono::milliseconds(10) : std::chrono::milliseconds(1000));
      if (stop_.load()) break;
      if (g == seen && !waiting) continue;
      seen = g;
      waiting = sweep(*reg);
    }
  });
}

bool Rails::sweep(const Registry& reg) {
  bool waiting = false;
  std::vector<uint64_t> gone;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [id, r] : regions_) {
      if (reg.find(id)) continue;
      if (r.pin.get()->inflight.load(std::memory_order_acquire) > 1) {  // operations still use it
        waiting = true;
        continue;
      }
      gone.push_back(id);
    }
  }
  if (gone.empty()) return waiting;
  // Tell every connected peer first (they drop the rkeys and refuse the region locally).
  std::vector<std::shared_ptr<GoneListener>> ls;
  {
    std::lock_guard<std::mutex> lk(listeners_mu_);
    for (auto it = listeners_.begin(); it != listeners_.end();) {
      if (auto l = it->lock()) {
        ls.push_back(std::move(l));
        ++it;
      } else {
        it = listeners_.erase(it);
      }
    }
  }
  for (uint64_t id : gone)
    for (auto& l : ls) l->region_gone(id);
  ls.clear();
  std::vector<RegionPin> release;  // released after mu_: releasing wakes Registry::remove()
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (uint64_t id : gone) {
      auto it = regions_.find(id);
      if (it == regions_.end()) continue;
      auto r = ranges_.find(it->second.key);
      if (r != ranges_.end() && --r->second.refs <= 0) {
        deregister(r->second.keys);
        ranges_.erase(r);
      }
      release.push_back(std::move(it->second.pin));
      regions_.erase(it);
    }
  }
  return waiting;
}

void Rails::add_listener(std::weak_ptr<GoneListener> l) {
  std::lock_guard<std::mutex> lk(listeners_mu_);
  std::erase_if(listeners_, [](const auto& w) { return w.expired(); });
  listeners_.push_back(std::move(l));
}

size_t Rails::cached_regions() {
  std::lock_guard<std::mutex> lk(mu_);
  return ranges_.size();
}

}  // namespace sluice::detail::rdma
