// The RDMA ports ("rails") an engine stripes over, and the memory registrations on each:
// every region is registered with every rail (one MR per protection domain), so any queue
// pair can move it; the rails nearest to the region's memory are its preferred ones.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/registry.hpp"
#include "transport/rdma/device.hpp"

namespace sluice::detail::rdma {

// Endpoints hear about regions being unregistered before their MRs go away, so that they can
// tell their peer (which then refuses operations on the region locally instead of breaking the
// QP with a remote access error).
class GoneListener {
 public:
  virtual ~GoneListener() = default;
  // Blocks until the peer acknowledged (bounded; returns at once on a failed endpoint).
  virtual void region_gone(uint64_t id) = 0;
};

// Endpoints hear about a rail's port going down or coming back (ibv async events), to move
// their queue pairs off it and back (rdma failover, docs/cluster.md).
class RailListener {
 public:
  virtual ~RailListener() = default;
  // Called on the rails' monitor thread; must not block on the network.
  virtual void rail_changed(int rail, bool up) = 0;
};

// A region's registration on every rail.
struct RegionKeys {
  std::vector<ibv_mr*> mrs;  // by rail
  uint32_t near = 0;         // bit i: rail i is among the nearest to the memory
};

class Rails {
 public:
  // Every selected ACTIVE port (Device::open_all). nullptr with *why when there is none.
  static std::shared_ptr<Rails> open(const Verbs* v, const std::string& hca, const std::string& gid_index_env,
                                     std::string* why);
  ~Rails();

  const Verbs& v() const { return *v_; }
  int size() const { return static_cast<int>(devs_.size()); }
  const Device& at(int i) const { return *devs_[i]; }
  bool ethernet() const { return devs_[0]->ethernet(); }
  // {"link": "eth"|"ib", "rails": [Device::address(), ...]}
  nlohmann::json address() const;

  // Registration cache. Returns the region's keys on every rail (registering it the first time:
  // the transport's region_added(); a region with the same range as a registered one shares
  // its MRs); nullptr with *st. The result stays valid while the caller holds a pin on the
  // region (forget() runs only after the region's pins drained).
  const RegionKeys* keys_for(const Registry& reg, const RegionEntry* e, Status* st);
  // The regions registered so far (no registration): {id: [rkey on rail 0, ...]}.
  nlohmann::json rkeys();
  // The region was unregistered and no local operation uses it: tell every connected peer
  // (each acknowledges, bounded), then deregister its MRs. Once this returns a peer's stale
  // rkey can no longer reach the memory.
  void forget(uint64_t id);
  size_t cached_regions();
  void add_listener(std::weak_ptr<GoneListener> l);

  // Port health. A rail is up from open() (only ACTIVE ports are opened) until its port
  // reports IBV_EVENT_PORT_ERR (or the device a fatal error), and up again on
  // IBV_EVENT_PORT_ACTIVE. With two or more rails a monitor thread (one per engine) reads the
  // devices' async events and tells the listeners; with one there is nowhere to move to.
  bool up(int r) const { return r >= 0 && r < size() && mon_->up[r].load(std::memory_order_acquire); }
  // `preferred` if it is up, else the next rail up after it (round robin); -1 if none is.
  int up_rail(int preferred) const;
  // The port's state asked of the device now (a system call), not the monitor's last word:
  // for decisions that must not race the monitor's event.
  bool port_active_now(int r) const;
  void add_rail_listener(std::weak_ptr<RailListener> l);

 private:
  struct Range {
    RegionKeys keys;
    int refs = 0;
  };
  struct ByRegion {
    std::pair<uintptr_t, uint64_t> key;
    const RegionKeys* keys = nullptr;  // in ranges_[key] (map nodes stay put): one lookup per op
  };
  // The monitor's state, shared with its thread: the thread may outlive this object (a
  // listener it notified dropped the last reference to the engine), so it holds the devices.
  struct Monitor {
    const Verbs* v = nullptr;
    std::vector<std::shared_ptr<Device>> devs;
    std::unique_ptr<std::atomic<bool>[]> up;
    std::mutex mu;  // listeners
    std::vector<std::weak_ptr<RailListener>> listeners;
    std::atomic<bool> stop{false};
    int wake_fd = -1;
    ~Monitor();
  };
  static void monitor(std::shared_ptr<Monitor> m);
  static void set_state(Monitor& m, int rail, bool up, const std::string& why);
  uint32_t near_rails(const RegionEntry& e) const;
  void deregister(RegionKeys& k);

  const Verbs* v_ = nullptr;
  std::vector<std::shared_ptr<Device>> devs_;
  std::vector<Locality> nics_;
  std::shared_ptr<Monitor> mon_ = std::make_shared<Monitor>();
  std::unique_ptr<std::thread> mon_thread_;
  int mon_pid_ = 0;
  std::mutex listeners_mu_;
  std::vector<std::weak_ptr<GoneListener>> listeners_;
  std::mutex mu_;
  std::map<std::pair<uintptr_t, uint64_t>, Range> ranges_;
  std::unordered_map<uint64_t, ByRegion> regions_;
};

}  // namespace sluice::detail::rdma
