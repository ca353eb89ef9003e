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

Rails::~Rails() {
  for (auto& [k, r] : ranges_) deregister(r.keys);
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
  regions_[e->id] = ByRegion{key, &r.keys};
  return &r.keys;
}

nlohmann::json Rails::rkeys() {
  nlohmann::json out = nlohmann::json::object();
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& [id, r] : regions_) {
    nlohmann::json keys = nlohmann::json::array();
    for (ibv_mr* mr : r.keys->mrs) keys.push_back(mr->rkey);
    out[std::to_string(id)] = keys;
  }
  return out;
}

void Rails::forget(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!regions_.count(id)) return;  // never registered here (its registration failed)
  }
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
  for (auto& l : ls) l->region_gone(id);
  ls.clear();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end()) return;
  auto r = ranges_.find(it->second.key);
  if (r != ranges_.end() && --r->second.refs <= 0) {
    deregister(r->second.keys);
    ranges_.erase(r);
  }
  regions_.erase(it);
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
