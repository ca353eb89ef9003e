#include "transport/rdma/rails.hpp"

#include <fcntl.h>
#include <algorithm>
#include <chrono>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstring>

#include "core/log.hpp"

namespace sluice::detail::rdma {

std::shared_ptr<Rails> Rails::open(const Verbs* v, const std::string& hca, const std::string& gid_env, std::string* why) {
  auto devs = Device::open_all(v, hca, gid_env, why);
  if (devs.empty()) return nullptr;
  auto r = std::shared_ptr<Rails>(new Rails());
  r->v_ = v;
  r->devs_ = std::move(devs);
  for (auto& d : r->devs_) r->nics_.push_back(d->locality());
  r->mon_->v = v;
  r->mon_->devs = r->devs_;
  r->mon_->up = std::make_unique<std::atomic<bool>[]>(r->devs_.size());
  for (size_t i = 0; i < r->devs_.size(); ++i) r->mon_->up[i].store(true);
  return r;
}

Rails::~Rails() {
  mon_->stop.store(true);
  if (mon_->wake_fd >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(mon_->wake_fd, &one, sizeof one);
  }
  if (mon_thread_) {
    if (mon_pid_ != ::getpid())
      (void)mon_thread_.release();  // a forked child's copy: the thread is not in this process
    else if (mon_thread_->get_id() == std::this_thread::get_id())
      mon_thread_->detach();  // a listener it notified held the last reference
    else
      mon_thread_->join();
  }
  for (auto& [k, r] : ranges_) deregister(r.keys);
}

Rails::Monitor::~Monitor() {
  if (wake_fd >= 0) ::close(wake_fd);
}

int Rails::up_rail(int preferred) const {
  const int n = size();
  if (n == 0) return -1;
  preferred = ((preferred % n) + n) % n;
  for (int i = 0; i < n; ++i)
    if (up((preferred + i) % n)) return (preferred + i) % n;
  return -1;
}

bool Rails::port_active_now(int r) const {
  if (r < 0 || r >= size()) return false;
  ibv_port_attr pa{};
  if (v_->query_port(devs_[r]->ctx(), static_cast<uint8_t>(devs_[r]->port()), &pa) != 0) return up(r);
  return pa.state == IBV_PORT_ACTIVE;
}

void Rails::add_rail_listener(std::weak_ptr<RailListener> l) {
  {
    std::lock_guard<std::mutex> lk(mon_->mu);
    std::erase_if(mon_->listeners, [](const auto& w) { return w.expired(); });
    mon_->listeners.push_back(std::move(l));
  }
  if (size() < 2) return;  // nowhere to move a queue pair to: no monitor
  std::lock_guard<std::mutex> lk(mu_);
  if (mon_thread_ && mon_pid_ == ::getpid()) return;
  if (mon_thread_) (void)mon_thread_.release();  // started before a fork: not in this process
  if (mon_->wake_fd < 0) mon_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (mon_->wake_fd < 0) {
    SLUICE_LOG(kWarn, "rdma: no rail monitor (eventfd: " << std::strerror(errno)
                                                         << "): queue pairs stay on a rail that goes down");
    return;
  }
  for (auto& d : devs_) {
    int fd = d->ctx()->async_fd;
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }
  // A lambda: the thread's state type stays local to the library (see Redialer::post).
  mon_thread_ = std::make_unique<std::thread>([m = mon_] { monitor(m); });
  mon_pid_ = ::getpid();
}

void Rails::set_state(Monitor& m, int rail, bool up, const std::string& why) {
  if (m.up[rail].exchange(up) == up) return;
  const Device& d = *m.devs[rail];
  if (up)
    SLUICE_LOG(kInfo, "rdma: rail " << rail << " (" << d.name() << " port " << d.port() << ") is up again (" << why
                                    << ")");
  else
    SLUICE_LOG(kWarn, "rdma: rail " << rail << " (" << d.name() << " port " << d.port() << ") went down (" << why
                                    << "): moving queue pairs off it");
  std::vector<std::shared_ptr<RailListener>> ls;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    for (auto& w : m.listeners)
      if (auto l = w.lock()) ls.push_back(std::move(l));
  }
  for (auto& l : ls) l->rail_changed(rail, up);
}

// The monitor thread: async events of every device (port up / down, fatal errors), and the
// ports' state queried every second in case an event was missed.
void Rails::monitor(std::shared_ptr<Monitor> m) {
  const Verbs& v = *m->v;
  std::vector<ibv_context*> ctxs;
  for (auto& d : m->devs)
    if (std::find(ctxs.begin(), ctxs.end(), d->ctx()) == ctxs.end()) ctxs.push_back(d->ctx());
  auto last_query = std::chrono::steady_clock::now();
  while (!m->stop.load()) {
    std::vector<pollfd> fds;
    fds.push_back({m->wake_fd, POLLIN, 0});
    for (ibv_context* c : ctxs) fds.push_back({c->async_fd, POLLIN, 0});
    int rc = ::poll(fds.data(), fds.size(), 1000);
    if (m->stop.load()) break;
    for (size_t i = 1; rc > 0 && i < fds.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      ibv_async_event ev;
      while (v.get_async_event(ctxs[i - 1], &ev) == 0) {
        const ibv_event_type type = ev.event_type;
        const int port = ev.element.port_num;
        v.ack_async_event(&ev);
        const bool port_ev = type == IBV_EVENT_PORT_ACTIVE || type == IBV_EVENT_PORT_ERR;
        if (!port_ev && type != IBV_EVENT_DEVICE_FATAL) continue;
        for (size_t r = 0; r < m->devs.size(); ++r) {
          if (m->devs[r]->ctx() != ctxs[i - 1] || (port_ev && m->devs[r]->port() != port)) continue;
          set_state(*m, static_cast<int>(r), type == IBV_EVENT_PORT_ACTIVE, v.event_type_str(type));
        }
        if (m->stop.load()) return;
      }
    }
    if (std::chrono::steady_clock::now() - last_query >= std::chrono::seconds(1)) {
      last_query = std::chrono::steady_clock::now();
      for (size_t r = 0; r < m->devs.size() && !m->stop.load(); ++r) {
        ibv_port_attr pa{};
        if (v.query_port(m->devs[r]->ctx(), static_cast<uint8_t>(m->devs[r]->port()), &pa) != 0) continue;
        set_state(*m, static_cast<int>(r), pa.state == IBV_PORT_ACTIVE, "port state queried");
      }
    }
    if (rc > 0 && (fds[0].revents & POLLIN)) {
      uint64_t x;
      [[maybe_unused]] auto n = ::read(m->wake_fd, &x, sizeof x);
    }
  }
}

nlohmann::json Rails::address() const {
  nlohmann::json rails = nlohmann::json::array();
  for (int r = 0; r < size(); ++r) {
    rails.push_back(devs_[r]->address());
    if (!up(r)) rails.back()["down"] = true;  // a peer connecting now picks another of our rails
  }
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
