// The peer's regions as seen from an nvlink endpoint: each described by its owner over the
// authenticated same-host socket on first use, then mapped once (a cuda import shared by the
// regions of one allocation, or a mapped memfd for host memory) and kept until withdrawn.
#include "transport/nvlink/endpoint.hpp"

namespace sluice::detail::nvlink {

uint64_t unsigned_field(const nlohmann::json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned())
    throw Error(ErrorCode::kProtocol, std::string("nvlink: the peer's description of ") + what + " has no unsigned '" + key + "'");
  return it->get<uint64_t>();
}

std::string string_field(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A region the owner withdrew: its description (and, unless another region still uses it,
// its mapping) is dropped.
void NvlinkEndpoint::forget_region(uint64_t id) {
  std::lock_guard<std::mutex> lk(map_mu_);
  views_.erase(id);
}

// The peer's region `id` for copies driven by `device`, as its owner describes it (asked
// over its same-host socket the first time: a local round trip bounded by the connect
// timeout). Throws Error.
RemoteView NvlinkEndpoint::view(uint64_t id, int device) {
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto v = views_.find(id);
    if (v != views_.end()) return v->second;
  }
  if (!authenticated_.load()) throw Error(ErrorCode::kProtocol, "nvlink: the peer has not proven itself yet");
  int fd = -1;
  nlohmann::json r = same_host::ask(peer_socket_, pid_.load(),
                                    {{"op", "describe"}, {"token", token_}, {"to_passive", active_}, {"region", id}},
                                    same_host::Clock::now() + timeout_, &fd);
  FdGuard guard{fd};
  if (r.contains("error")) {
    // The owner's reason, with its code where that is one a description can fail with.
    auto code = r.find("code");
    auto c = code != r.end() && code->is_number_integer() ? static_cast<ErrorCode>(code->get<int>()) : ErrorCode::kUnknownHandle;
    if (c != ErrorCode::kUnsupported && c != ErrorCode::kOutOfRange) c = ErrorCode::kUnknownHandle;
    throw Error(c, "peer region " + std::to_string(id) + ": " + string_field(r, "error"));
  }
  const std::string what = "region " + std::to_string(id);
  RemoteView rv;
  rv.addr = unsigned_field(r, "addr", what.c_str());
  rv.length = unsigned_field(r, "length", what.c_str());
  uint64_t slot = unsigned_field(r, "slot", what.c_str());
  rv.slot = slot > kNoLease ? kNoLease : static_cast<uint32_t>(slot);
  auto host = r.find("host");
  if (host == r.end() || !host->is_boolean())
    throw Error(ErrorCode::kProtocol, "nvlink: the peer's description of " + what + " has no boolean 'host'");
  rv.host = host->get<bool>();
  if (rv.host) {
    // Mapped only from a memfd the owner passed us; otherwise moved with CMA to the proven
    // process at the address it described.
    if (fd >= 0 && !same_process_.load() && rv.length > 0 && same_host::is_memfd(fd, rv.length)) {
      void* p = ::mmap(nullptr, rv.length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        auto m = std::make_shared<HostMapping>();
        m->base = static_cast<uint8_t*>(p);
        m->length = rv.length;
        rv.ptr = m->base;
        rv.keep = m;
      }
    }
  } else {
    rv.ptr = map_cuda(id, r, fd, device, rv);
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  return views_.emplace(id, std::move(rv)).first->second;
}

// Where the peer's cuda region described in `r` is addressable here. Throws Error.
uint8_t* NvlinkEndpoint::map_cuda(uint64_t id, const nlohmann::json& r, int fd, int device, RemoteView& rv) {
  const std::string what = "region " + std::to_string(id);
  auto ex_it = r.find("export");
  if (ex_it == r.end() || !ex_it->is_object())
    throw Error(ErrorCode::kProtocol, "nvlink: the peer's description of " + what + " has no 'export'");
  const nlohmann::json& ex = *ex_it;
  const uint64_t offset = unsigned_field(ex, "offset", what.c_str());
  const uint64_t base_size = unsigned_field(ex, "base_size", what.c_str());
  const uint64_t base = unsigned_field(ex, "base", what.c_str());
  if (!in_bounds(offset, rv.length, base_size))
    throw Error(ErrorCode::kProtocol, "nvlink: the peer describes " + what + " as " + std::to_string(rv.length) +
                                          " bytes at offset " + std::to_string(offset) + " of a " +
                                          std::to_string(base_size) + "-byte allocation");
  const std::string kind = string_field(ex, "kind");
  if (kind == "local") {
    // Only another engine of this very process may describe memory by address.
    if (!same_process_.load())
      throw Error(ErrorCode::kProtocol, "nvlink: a peer in another process described " + what + " by address");
    auto dev = ex.find("device");
    if (dev != ex.end() && dev->is_number_integer()) {
      int owner = dev->get<int>();
      if (owner != device && owner >= 0 && owner < cu::device_count()) {
        // Peer access is enabled from the current device: make it the one that copies.
        int can = 0;
        cudaDeviceCanAccessPeer(&can, device, owner);
        if (can && (cudaSetDevice(device) != cudaSuccess || cudaDeviceEnablePeerAccess(owner, 0) != cudaSuccess))
          cudaGetLastError();
      }
    }
    return reinterpret_cast<uint8_t*>(base + offset);
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  ImportRec& rec = imports_[base];
  bool live = false;
  for (auto& [slot, rid] : rec.users) live |= leases_.still(slot, rid);
  if (!rec.imp || !live) {
    rec = ImportRec{};
    rec.imp = cu::import_region(ex, fd, device);
  }
  if (rec.imp->size < base_size)
    throw Error(ErrorCode::kProtocol, "nvlink: " + what + " lies outside the peer's allocation as mapped");
  rec.users.emplace_back(rv.slot, id);
  rv.keep = rec.imp;
  return rec.imp->base + offset;
}

}  // namespace sluice::detail::nvlink
