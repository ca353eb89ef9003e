#include "transport/rdma/device.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/log.hpp"
#include "transport/rdma/hca_filter.hpp"

namespace sluice::detail::rdma {
namespace {

std::string read_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

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

nlohmann::json QpAddress::to_json() const { return {{"qpn", qpn}, {"psn", psn}, {"gid", gid}, {"lid", lid}, {"mtu", mtu}}; }

QpAddress QpAddress::from_json(const nlohmann::json& j) {
  QpAddress a;
  try {
    a.qpn = j.at("qpn").get<uint32_t>();
    a.psn = j.at("psn").get<uint32_t>();
    a.gid = j.at("gid").get<std::string>();
    a.lid = j.at("lid").get<uint16_t>();
    a.mtu = j.at("mtu").get<int>();
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kProtocol, std::string("rdma: malformed queue pair address: ") + e.what());
  }
  if (a.mtu < IBV_MTU_256 || a.mtu > IBV_MTU_4096) throw Error(ErrorCode::kProtocol, "rdma: peer sent a bad MTU");
  return a;
}

std::string Device::gid_text(const ibv_gid& g) {
  char buf[33];
  for (int i = 0; i < 16; ++i) std::snprintf(buf + 2 * i, 3, "%02x", g.raw[i]);
  return buf;
}

bool Device::parse_gid(const std::string& s, ibv_gid* g) {
  if (s.size() != 32) return false;
  for (int i = 0; i < 16; ++i) {
    unsigned v;
    if (std::sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;
    g->raw[i] = static_cast<uint8_t>(v);
  }
  return true;
}

std::shared_ptr<Device> Device::open(const Verbs* v, const std::string& hca, const std::string& gid_env, std::string* why) {
  HcaFilter filter;
  try {
    filter = HcaFilter::parse(hca);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
  int n = 0;
  ibv_device** list = v->get_device_list(&n);
  if (!list || n == 0) {
    if (list) v->free_device_list(list);
    *why = "no RDMA device";
    return nullptr;
  }
  std::string seen;
  std::shared_ptr<Device> chosen;
  for (int i = 0; i < n && !chosen; ++i) {
    std::string name = v->get_device_name(list[i]);
    ibv_context* ctx = v->open_device(list[i]);
    if (!ctx) {
      seen += " " + name + "(cannot open)";
      continue;
    }
    ibv_device_attr attr{};
    if (v->query_device(ctx, &attr) != 0) {
      v->close_device(ctx);
      continue;
    }
    for (int p = 1; p <= attr.phys_port_cnt && !chosen; ++p) {
      if (!filter.matches(name, p)) {
        seen += " " + name + ":" + std::to_string(p) + "(excluded by SLUICE_IB_HCA)";
        continue;
      }
      ibv_port_attr pa{};
      if (v->query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) {
        seen += " " + name + ":" + std::to_string(p) + "(port not ACTIVE)";
        continue;
      }
      auto d = std::shared_ptr<Device>(new Device());
      d->v_ = v;
      d->ctx_ = ctx;
      d->name_ = name;
      d->port_ = p;
      d->attr_ = attr;
      d->link_layer_ = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
      d->lid_ = pa.lid;
      d->mtu_ = pa.active_mtu;
      if (!gid_env.empty()) {
        d->gid_index_ = std::atoi(gid_env.c_str());
      } else if (d->ethernet()) {
        d->gid_index_ = find_roce_v2_ipv4_gid(name, p, pa.gid_tbl_len);
        if (d->gid_index_ < 0) {
          seen += " " + name + ":" + std::to_string(p) + "(no RoCE v2 IPv4 GID)";
          d->ctx_ = nullptr;
          continue;
        }
      }
      if (v->query_gid(ctx, static_cast<uint8_t>(p), d->gid_index_, &d->gid_) != 0) {
        seen += " " + name + ":" + std::to_string(p) + "(cannot read GID " + std::to_string(d->gid_index_) + ")";
        d->ctx_ = nullptr;
        continue;
      }
      if (!d->ethernet() && d->lid_ == 0) {
        seen += " " + name + ":" + std::to_string(p) + "(IB port without a LID)";
        d->ctx_ = nullptr;
        continue;
      }
      d->pd_ = v->alloc_pd(ctx);
      if (!d->pd_) {
        seen += " " + name + "(cannot allocate a protection domain)";
        d->ctx_ = nullptr;
        continue;
      }
      chosen = d;
    }
    if (!chosen) v->close_device(ctx);
  }
  v->free_device_list(list);
  if (!chosen) {
    *why = "no RDMA device" + (seen.empty() ? std::string() : " usable:" + seen);
    return nullptr;
  }
  SLUICE_LOG(kInfo, "rdma: using " << chosen->name_ << ":" << chosen->port_ << " ("
                                   << (chosen->ethernet() ? "RoCE" : "InfiniBand") << ", gid index " << chosen->gid_index_
                                   << ", active_mtu " << (128 << chosen->mtu_) << ")");
  return chosen;
}

Device::~Device() {
  {
    std::lock_guard<std::mutex> lk(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  for (auto& [k, r] : ranges_)
    if (r.mr) v_->dereg_mr(r.mr);
  regions_.clear();  // releases the pins
  if (pd_) v_->dealloc_pd(pd_);
  if (ctx_) v_->close_device(ctx_);
}

void Device::start_sweeper(const Registry* reg) {
  sweeper_ = std::thread([this, reg] {
    uint64_t seen = reg->generation();
    bool waiting = false;
    std::unique_lock<std::mutex> lk(stop_mu_);
    while (!stop_) {
      stop_cv_.wait_for(lk, std::chrono::milliseconds(10));
      if (stop_) break;
      uint64_t g = reg->generation();
      if (g == seen && !waiting) continue;
      seen = g;
      lk.unlock();
      waiting = sweep(*reg);
      lk.lock();
    }
  });
}

nlohmann::json Device::address() const {
  return {{"dev", name_}, {"port", port_}, {"link", ethernet() ? "eth" : "ib"}, {"gid", gid_text(gid_)},
          {"lid", lid_}, {"mtu", mtu_}};
}

ibv_mr* Device::register_range(uint8_t* base, uint64_t len, const Location& loc, Status* st) {
  ibv_mr* mr = nullptr;
  std::string dmabuf_why;
  if (!loc.is_host()) {
    // GPU memory: a dma-buf of the range (CUDA >= 11.7 driver, kernel >= 5.12) when both
    // libcuda and ibv_reg_dmabuf_mr exist; otherwise ibv_reg_mr on the device pointer
    // (needs nvidia-peermem).
    using GetHandle = int (*)(void*, uint64_t, size_t, int, unsigned long long);
    static void* cuda = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    GetHandle get = cuda ? reinterpret_cast<GetHandle>(::dlsym(cuda, "cuMemGetHandleForAddressRange")) : nullptr;
    if (get && v_->reg_dmabuf_mr) {
      int fd = -1;
      uintptr_t page = reinterpret_cast<uintptr_t>(base) & ~uintptr_t(0xffff);
      size_t span = (reinterpret_cast<uintptr_t>(base) + len - page + 0xffff) & ~size_t(0xffff);
      int rc = get(&fd, page, span, 1 /*CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD*/, 0);
      if (rc == 0 && fd >= 0) {
        mr = v_->reg_dmabuf_mr(pd_, reinterpret_cast<uintptr_t>(base) - page, len, reinterpret_cast<uintptr_t>(base), fd,
                               kAccess);
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
  if (!mr) mr = v_->reg_mr(pd_, base, len, kAccess);
  if (!mr) {
    int err = errno;
    *st = {loc.is_host() ? ErrorCode::kSystem : ErrorCode::kUnsupported,
           "rdma: cannot register " + loc.to_string() + " memory [" + std::to_string(reinterpret_cast<uintptr_t>(base)) +
               ", +" + std::to_string(len) + ") with " + name_ + ": " + dmabuf_why + "ibv_reg_mr: " + std::strerror(err)};
  }
  return mr;
}

ibv_mr* Device::mr_for(const Registry& reg, const RegionEntry* e, Status* st) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = regions_.find(e->id);
  if (it != regions_.end()) return ranges_[it->second.key].mr;
  auto region = reg.find(e->id);
  if (!region) {
    *st = {ErrorCode::kUnknownHandle, "rdma: region " + std::to_string(e->id) + " is no longer registered"};
    return nullptr;
  }
  auto key = std::make_pair(reinterpret_cast<uintptr_t>(e->base), e->length);
  Range& r = ranges_[key];
  if (!r.mr) {
    r.mr = register_range(e->base, e->length, e->location, st);
    if (!r.mr) {
      ranges_.erase(key);
      return nullptr;
    }
  }
  r.refs++;
  regions_[e->id] = ByRegion{RegionPin(std::move(region)), key};
  return r.mr;
}

nlohmann::json Device::rkeys(const Registry& reg) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& e : reg.entries()) {
    Status st;
    ibv_mr* mr = mr_for(reg, e.get(), &st);
    if (mr) out[std::to_string(e->id)] = mr->rkey;
  }
  return out;
}

bool Device::sweep(const Registry& reg) {
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
  // Tell every connected peer first (they drop the rkey and refuse the region locally).
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
        v_->dereg_mr(r->second.mr);
        ranges_.erase(r);
      }
      release.push_back(std::move(it->second.pin));
      regions_.erase(it);
    }
  }
  return waiting;
}

void Device::add_listener(std::weak_ptr<GoneListener> l) {
  std::lock_guard<std::mutex> lk(listeners_mu_);
  std::erase_if(listeners_, [](const auto& w) { return w.expired(); });
  listeners_.push_back(std::move(l));
}

size_t Device::cached_mrs() {
  std::lock_guard<std::mutex> lk(mu_);
  return ranges_.size();
}

}  // namespace sluice::detail::rdma
