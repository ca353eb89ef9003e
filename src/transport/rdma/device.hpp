// One opened RDMA device port: context, protection domain, address (GID / LID / MTU) and the
// memory-registration cache shared by every endpoint of the engine.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <condition_variable>

#include <nlohmann/json.hpp>

#include "core/registry.hpp"
#include "sluice/error.hpp"
#include "transport/rdma/verbs_loader.hpp"

namespace sluice::detail::rdma {

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

// What the peer needs to reach one of our queue pairs.
struct QpAddress {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  std::string gid;  // 32 hex digits
  uint16_t lid = 0;
  int mtu = 0;      // enum ibv_mtu value (1=256 .. 5=4096)
  nlohmann::json to_json() const;
  static QpAddress from_json(const nlohmann::json& j);
};

// Endpoints hear about regions being unregistered before their MR goes away, so that they can
// tell their peer (which then refuses operations on the region locally instead of breaking the
// QP with a remote access error).
class GoneListener {
 public:
  virtual ~GoneListener() = default;
  // Blocks until the peer acknowledged (bounded; returns at once on a failed endpoint).
  virtual void region_gone(uint64_t id) = 0;
};

class Device {
 public:
  // Opens the first device/port that SLUICE_IB_HCA selects (every device when unset) and
  // whose port is ACTIVE. Returns nullptr with *why ("no RDMA device ...") otherwise.
  static std::shared_ptr<Device> open(const Verbs* v, const std::string& hca, const std::string& gid_index_env,
                                      std::string* why);
  ~Device();

  const Verbs& v() const { return *v_; }
  ibv_context* ctx() const { return ctx_; }
  ibv_pd* pd() const { return pd_; }
  const std::string& name() const { return name_; }
  int port() const { return port_; }
  bool ethernet() const { return link_layer_ == IBV_LINK_LAYER_ETHERNET; }
  int gid_index() const { return gid_index_; }
  const ibv_gid& gid() const { return gid_; }
  uint16_t lid() const { return lid_; }
  int active_mtu() const { return mtu_; }
  const ibv_device_attr& attr() const { return attr_; }
  nlohmann::json address() const;

  // Registration cache. Returns the MR covering the whole region (registering it the first
  // time; a region with the same range as a registered one shares its MR). The cache holds a
  // pin on every region it registered, so Registry::remove() (unregister_memory, free, engine
  // close) waits until the sweeper thread has deregistered the MR: once unregister returns, a
  // peer's stale rkey can no longer reach the memory.
  ibv_mr* mr_for(const Registry& reg, const RegionEntry* e, Status* st);
  // Registers every region of the registry (errors skipped) and returns {id: rkey}.
  nlohmann::json rkeys(const Registry& reg);
  // Starts the thread that deregisters regions removed from `reg` (checks the registry's
  // generation every 10 ms).
  void start_sweeper(const Registry* reg);
  size_t cached_mrs();
  void add_listener(std::weak_ptr<GoneListener> l);
  static std::string gid_text(const ibv_gid& g);
  static bool parse_gid(const std::string& s, ibv_gid* g);

 private:
  ibv_mr* register_range(uint8_t* base, uint64_t len, const Location& loc, Status* st);

  const Verbs* v_ = nullptr;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  std::string name_;
  int port_ = 1;
  int link_layer_ = IBV_LINK_LAYER_INFINIBAND;
  int gid_index_ = 0;
  ibv_gid gid_{};
  uint16_t lid_ = 0;
  int mtu_ = IBV_MTU_1024;
  ibv_device_attr attr_{};

  struct Range {
    ibv_mr* mr = nullptr;
    int refs = 0;
  };
  struct ByRegion {
    RegionPin pin;
    std::pair<uintptr_t, uint64_t> key;
  };
  bool sweep(const Registry& reg);  // returns true while a removed region still has pins
  std::mutex listeners_mu_;
  std::vector<std::weak_ptr<GoneListener>> listeners_;
  std::thread sweeper_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::mutex mu_;
  std::map<std::pair<uintptr_t, uint64_t>, Range> ranges_;
  std::unordered_map<uint64_t, ByRegion> regions_;
};

}  // namespace sluice::detail::rdma
