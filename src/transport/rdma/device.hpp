// One opened RDMA device port and the queue-pair address exchanged with peers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/registry.hpp"
#include "sluice/error.hpp"
#include "transport/rdma/affinity.hpp"
#include "transport/rdma/negotiate.hpp"
#include "transport/rdma/verbs_loader.hpp"

namespace sluice::detail::rdma {

constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
// Regions and queue pairs also take remote atomics (post_signal's fetch-and-add on a counter
// in a registered region) on devices that have them.
constexpr int kAccessAtomic = kAccess | IBV_ACCESS_REMOTE_ATOMIC;

// One opened RDMA device port (a "rail"): context, protection domain, address (GID / LID /
// MTU) and where it sits (NUMA node, PCIe position). Rails (rails.hpp) holds the set an engine
// uses and the memory registrations on each.
class Device {
 public:
  // Every device/port that SLUICE_IB_HCA selects (every device when unset) and whose port is
  // ACTIVE, in ibv_get_device_list order then port order; only ports of the first port's link
  // layer (InfiniBand and RoCE do not mix). Empty with *why ("no RDMA device ...") otherwise.
  static std::vector<std::shared_ptr<Device>> open_all(const Verbs* v, const std::string& hca,
                                                       const std::string& gid_index_env, std::string* why);
  ~Device();

  const Verbs& v() const { return *v_; }
  ibv_context* ctx() const { return ctx_->ctx; }
  ibv_pd* pd() const { return ctx_->pd; }
  const std::string& name() const { return name_; }
  int port() const { return port_; }
  bool ethernet() const { return link_layer_ == IBV_LINK_LAYER_ETHERNET; }
  int gid_index() const { return gid_index_; }
  const ibv_gid& gid() const { return gid_; }
  // 1 or 2 for a RoCE GID whose type sysfs names; 0 on InfiniBand or where sysfs says nothing.
  int roce_version() const { return roce_version_; }
  uint16_t lid() const { return lid_; }
  int active_mtu() const { return mtu_; }
  uint64_t max_msg_sz() const { return max_msg_sz_; }
  const ibv_device_attr& attr() const { return ctx_->attr; }
  // Access flags for regions and queue pairs: kAccessAtomic unless the device has no atomics.
  int access() const { return attr().atomic_cap == IBV_ATOMIC_NONE ? kAccess : kAccessAtomic; }
  const Locality& locality() const { return locality_; }
  nlohmann::json address() const;
  // This port as the handshake describes it to the peer (negotiate.hpp).
  PortDesc desc() const;

  // Registers [base, base+len) with this device's protection domain (GPU memory through a
  // dma-buf where possible). nullptr with *st on failure.
  ibv_mr* register_range(uint8_t* base, uint64_t len, const Location& loc, Status* st) const;

 private:
  // Ports of one device share its context and protection domain.
  struct Context {
    const Verbs* v = nullptr;
    ibv_context* ctx = nullptr;
    ibv_pd* pd = nullptr;
    ibv_device_attr attr{};
    ~Context();
  };

  const Verbs* v_ = nullptr;
  std::shared_ptr<Context> ctx_;
  std::string name_;
  int port_ = 1;
  int link_layer_ = IBV_LINK_LAYER_INFINIBAND;
  int gid_index_ = 0;
  ibv_gid gid_{};
  int roce_version_ = 0;
  uint16_t lid_ = 0;
  int mtu_ = IBV_MTU_1024;
  uint64_t max_msg_sz_ = 1ull << 31;
  Locality locality_;
};

}  // namespace sluice::detail::rdma
