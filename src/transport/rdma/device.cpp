#include "transport/rdma/device.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>

#include "core/log.hpp"
#include "transport/rdma/hca_filter.hpp"
#include "transport/rdma/sysfs.hpp"

namespace sluice::detail::rdma {
namespace {

std::string read_line(const std::string& path) { return read_sysfs_line(path); }

// The RoCE v2 GID of the netdev's IPv4 address: ::ffff:a.b.c.d with type "RoCE v2".
// Read from sysfs (querying 1024 entries through verbs is slow on some providers).
int find_roce_v2_ipv4_gid(const std::string& dev, int port, int table_len) {
  std::string base = "/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port);
  int fallback = -1;
  for (int i = 0; i < std::min(table_len, 256); ++i) {
    std::string g = read_line(base + "/gids/" + std::to_string(i));
    if (g.empty()) break;
    if (g.rfind("0000:0000:0000:0000:0000:ffff:", 0) != 0) continue;
    std::string type = read_line(base + "/gid_attrs/types/" + std::to_string(i));
    if (type.find("v2") != std::string::npos) return i;
    if (fallback < 0) fallback = i;
  }
  return fallback;
}

}  // namespace

static_assert(kMtu256 == IBV_MTU_256 && kMtu4096 == IBV_MTU_4096, "negotiate.hpp's MTU values are enum ibv_mtu's");

namespace {
Gid to_gid(const ibv_gid& g) {
  Gid out;
  std::memcpy(out.data(), g.raw, 16);
  return out;
}
}  // namespace

PortDesc Device::desc() const {
  PortDesc p;
  p.dev = name_;
  p.port = port_;
  p.ethernet = ethernet();
  p.gid_index = gid_index_;
  p.gid = to_gid(gid_);
  p.roce_version = roce_version_;
  p.lid = lid_;
  p.mtu = mtu_;
  return p;
}

Device::Context::~Context() {
  if (pd) v->dealloc_pd(pd);
  if (ctx) v->close_device(ctx);
}

std::vector<std::shared_ptr<Device>> Device::open_all(const Verbs* v, const std::string& hca, const std::string& gid_env,
                                                      std::string* why) {
  std::vector<std::shared_ptr<Device>> out;
  HcaFilter filter;
  try {
    filter = HcaFilter::parse(hca);
  } catch (const Error& e) {
    *why = e.what();
    return out;
  }
  int n = 0;
  ibv_device** list = v->get_device_list(&n);
  if (!list || n == 0) {
    if (list) v->free_device_list(list);
    *why = "no RDMA device";
    return out;
  }
  std::string seen;
  for (int i = 0; i < n; ++i) {
    std::string name = v->get_device_name(list[i]);
    bool any_port = false;
    for (int p = 1; p <= 16 && !any_port; ++p) any_port = filter.matches(name, p);
    if (!any_port) {
      seen += " " + name + "(not selected by rdma.hca / SLUICE_IB_HCA)";
      continue;
    }
    auto c = std::make_shared<Context>();
    c->v = v;
    c->ctx = v->open_device(list[i]);
    if (!c->ctx) {
      seen += " " + name + "(cannot open)";
      continue;
    }
    if (v->query_device(c->ctx, &c->attr) != 0) {
      seen += " " + name + "(cannot query)";
      continue;
    }
    c->pd = v->alloc_pd(c->ctx);
    if (!c->pd) {
      seen += " " + name + "(cannot allocate a protection domain)";
      continue;
    }
    for (int p = 1; p <= c->attr.phys_port_cnt; ++p) {
      std::string where = " " + name + ":" + std::to_string(p);
      if (!filter.matches(name, p)) {
        seen += where + "(not selected by rdma.hca / SLUICE_IB_HCA)";
        continue;
      }
      ibv_port_attr pa{};
      if (v->query_port(c->ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) {
        seen += where + "(port not ACTIVE)";
        continue;
      }
      auto d = std::shared_ptr<Device>(new Device());
      d->v_ = v;
      d->ctx_ = c;
      d->name_ = name;
      d->port_ = p;
      d->link_layer_ = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
      d->lid_ = pa.lid;
      d->mtu_ = pa.active_mtu;
      if (pa.max_msg_sz > 0) d->max_msg_sz_ = pa.max_msg_sz;
      if (!out.empty() && out[0]->ethernet() != d->ethernet()) {
        seen += where + "(link layer differs from " + out[0]->name() + ")";
        continue;
      }
      if (!gid_env.empty()) {
        d->gid_index_ = std::atoi(gid_env.c_str());
      } else if (d->ethernet()) {
        d->gid_index_ = find_roce_v2_ipv4_gid(name, p, pa.gid_tbl_len);
        if (d->gid_index_ < 0) {
          seen += where + "(no RoCE v2 IPv4 GID)";
          continue;
        }
      }
      if (d->gid_index_ >= pa.gid_tbl_len) {
        seen += where + "(GID index " + std::to_string(d->gid_index_) + " is beyond its table of " +
                std::to_string(pa.gid_tbl_len) + ")";
        continue;
      }
      if (v->query_gid(c->ctx, static_cast<uint8_t>(p), d->gid_index_, &d->gid_) != 0) {
        seen += where + "(cannot read GID " + std::to_string(d->gid_index_) + ")";
        continue;
      }
      if (d->ethernet()) {
        // An unpopulated entry reads as all zeros: a QP would send from no address and the
        // peer could never answer (a hang until the retry limit), so refuse it here.
        if (gid_zero(to_gid(d->gid_))) {
          seen += where + "(GID index " + std::to_string(d->gid_index_) + " is empty: all-zero GID)";
          continue;
        }
        d->roce_version_ = roce_version_of(read_line("/sys/class/infiniband/" + name + "/ports/" + std::to_string(p) +
                                                     "/gid_attrs/types/" + std::to_string(d->gid_index_)));
      }
      if (!d->ethernet() && d->lid_ == 0) {
        seen += where + "(IB port without a LID)";
        continue;
      }
      d->locality_ = nic_locality("/sys", name);
      out.push_back(std::move(d));
    }
  }
  v->free_device_list(list);
  if (out.empty()) {
    *why = "no RDMA device" + (seen.empty() ? std::string() : " usable:" + seen);
    return out;
  }
  for (auto& d : out)
    SLUICE_LOG(kInfo, "rdma: rail " << d->name_ << ":" << d->port_ << " (" << (d->ethernet() ? "RoCE" : "InfiniBand")
                                    << ", gid index " << d->gid_index_ << " "
                                    << gid_readable(to_gid(d->gid_))
                                    << (d->roce_version_ ? " RoCE v" + std::to_string(d->roce_version_) : std::string()) << ", active_mtu " << (128 << d->mtu_) << ", numa "
                                    << d->locality_.numa << ")");
  return out;
}

Device::~Device() = default;

nlohmann::json Device::address() const {
  return {{"dev", name_}, {"port", port_}, {"link", ethernet() ? "eth" : "ib"}, {"gid", gid_hex(to_gid(gid_))},
          {"lid", lid_}, {"mtu", mtu_}};
}

ibv_mr* Device::register_range(uint8_t* base, uint64_t len, const Location& loc, Status* st) const {
  ibv_mr* mr = nullptr;
  std::string dmabuf_why;
  if (!loc.is_host()) {
    // GPU memory: a dma-buf of the range (CUDA >= 11.7 driver, kernel >= 5.12) when both
    // libcuda and ibv_reg_dmabuf_mr exist; otherwise ibv_reg_mr on the device pointer
    // (needs nvidia-peermem).
    using GetHandle = int (*)(void*, uint64_t, size_t, int, unsigned long long);
    void* cuda = cuda_driver();
    GetHandle get = cuda ? reinterpret_cast<GetHandle>(::dlsym(cuda, "cuMemGetHandleForAddressRange")) : nullptr;
    if (get && v_->reg_dmabuf_mr) {
      int fd = -1;
      uintptr_t page = reinterpret_cast<uintptr_t>(base) & ~uintptr_t(0xffff);
      size_t span = (reinterpret_cast<uintptr_t>(base) + len - page + 0xffff) & ~size_t(0xffff);
      int rc = get(&fd, page, span, 1 /*CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD*/, 0);
      if (rc == 0 && fd >= 0) {
        mr = v_->reg_dmabuf_mr(pd(), reinterpret_cast<uintptr_t>(base) - page, len, reinterpret_cast<uintptr_t>(base), fd,
                               access());
        if (!mr && access() != kAccess)  // a driver that refuses remote atomics on device memory
          mr = v_->reg_dmabuf_mr(pd(), reinterpret_cast<uintptr_t>(base) - page, len, reinterpret_cast<uintptr_t>(base),
                                 fd, kAccess);
        int err = errno;
        ::close(fd);
        if (!mr) dmabuf_why = "ibv_reg_dmabuf_mr: " + std::string(std::strerror(err)) + "; ";
      } else {
        dmabuf_why = "cuMemGetHandleForAddressRange failed (" + std::to_string(rc) + "); ";
      }
    } else {
      dmabuf_why = std::string(cuda ? "" : "libcuda not found; ") + (v_->reg_dmabuf_mr ? "" : "no ibv_reg_dmabuf_mr; ");
    }
  }
  if (!mr) mr = v_->reg_mr(pd(), base, len, access());
  // Remote atomics are only for post_signal's counters: a region the device will not register
  // with them is still a region (a signal to it then fails the QP with a remote access error).
  if (!mr && access() != kAccess) mr = v_->reg_mr(pd(), base, len, kAccess);
  if (!mr) {
    int err = errno;
    *st = {loc.is_host() ? ErrorCode::kSystem : ErrorCode::kUnsupported,
           "rdma: cannot register " + loc.to_string() + " memory [" + std::to_string(reinterpret_cast<uintptr_t>(base)) +
               ", +" + std::to_string(len) + ") with " + name_ + ": " + dmabuf_why + "ibv_reg_mr: " + std::strerror(err)};
  }
  return mr;
}

}  // namespace sluice::detail::rdma
