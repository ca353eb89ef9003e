// The peer's regions as seen from an nvlink endpoint: each described by its owner over the
// authenticated same-host socket, then mapped once (a cuda import shared by the regions of one
// allocation, or a mapped memfd for host memory) and kept until withdrawn.
//
// When: describing is a round trip to the peer, so it never happens on a thread that submits
// or posts (issue 11: no network on submit). The regions of the peer's info are described
// when that info arrives: at connect on the connecting thread, at refresh_remote_regions() on
// the refreshing thread (both already wait for the peer), and after accept on the poller. A
// region an op needs that is not described yet (the passive side right after accept, or a
// region withdrawn and described again) is described on the poller: the op is handed to it
// and started there (data_path.cpp). Ops that must be issued in their caller's order (posts,
// stream-ordered ops) cannot be handed over without holding every later one back too, so
// they fail at once with a clear error instead; that is a window of milliseconds after
// accept, closed by refresh_remote_regions(). Simpler than a queue that would have to hold
// back every later post of the endpoint, and it keeps the submit path free of I/O.
#include <algorithm>

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

// Peer access from device `from` to memory on device `to` (both as this process numbers
// them), where the hardware allows it; idempotent (an enabled pair is not an error here).
// Only for devices the process uses already: enabling creates contexts.
void enable_peer_access(int from, int to) {
  const int n = cu::device_count();
  if (from < 0 || to < 0 || from >= n || to >= n || from == to) return;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess || !can) {
    cudaGetLastError();
    return;
  }
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess) prev = from;
  if (cudaSetDevice(from) != cudaSuccess || cudaDeviceEnablePeerAccess(to, 0) != cudaSuccess) cudaGetLastError();
  if (prev != from) cudaSetDevice(prev);
  cudaGetLastError();
}

// A region the owner withdrew: its description (and, unless another region still uses it,
// its mapping) is dropped; ops that cannot wait for a new description get `why`.
void NvlinkEndpoint::forget_region(uint64_t id, const Status& why) {
  std::lock_guard<std::mutex> lk(map_mu_);
  views_.erase(id);
  view_errors_[id] = why;
}

// The description of `id` if we have one (never asks the peer). Else false, with *why set
// when describing it failed last time (else it is not described yet).
bool NvlinkEndpoint::cached_view(uint64_t id, RemoteView* out, Status* why) {
  std::lock_guard<std::mutex> lk(map_mu_);
  auto v = views_.find(id);
  if (v != views_.end()) {
    *out = v->second;
    return true;
  }
  auto e = view_errors_.find(id);
  if (why && e != view_errors_.end()) *why = e->second;
  return false;
}

// Describes every region of the peer's latest info that is not described yet (a failure is
// kept for the ops that name the region). Blocks on the peer, about the connect timeout at
// most (what is left then is described when an op needs it): never on a submitting thread.
void NvlinkEndpoint::resolve_known() {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (uint64_t id : known_)
      if (!views_.count(id)) ids.push_back(id);
  }
  const auto until = std::chrono::steady_clock::now() + timeout_;
  for (uint64_t id : ids) {
    if (failed() || std::chrono::steady_clock::now() > until) return;
    try {
      view(id, -1);
    } catch (const Error& e) {
      std::lock_guard<std::mutex> lk(map_mu_);
      view_errors_[id] = e.status();
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lk(map_mu_);
      view_errors_[id] = {ErrorCode::kProtocol, std::string("nvlink: describing peer region ") + std::to_string(id) + ": " + e.what()};
    }
  }
}

// The peer's info changed (connect's hello reply, refresh_remote_regions()): regions it no
// longer lists are forgotten, new ones described now if the peer has proven itself (this is
// the refreshing thread, which waits for the peer anyway), else once it has (connect, adopt).
void NvlinkEndpoint::peer_updated(const EngineInfo& peer) {
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    known_.clear();
    for (const auto& r : peer.regions) known_.push_back(r.info.id);
    std::sort(known_.begin(), known_.end());
    for (auto it = views_.begin(); it != views_.end();)
      it = std::binary_search(known_.begin(), known_.end(), it->first) ? std::next(it) : views_.erase(it);
    view_errors_.clear();  // a refresh is a fresh start for regions that failed
  }
  if (authenticated_.load() && !failed()) resolve_known();
}

// The peer's region `id`, as its owner describes it (asked over its same-host socket: a local
// round trip bounded by the connect timeout), mapped for copies driven by `device` (-1: the
// calling thread's current device). Throws Error. Never called on a submitting thread (see
// the top of this file).
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
        rv.mapping = m.get();
        rv.keep = m;
      }
    }
  } else {
    rv.ptr = map_cuda(id, r, fd, device, rv);
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  view_errors_.erase(id);
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
  auto dev = ex.find("device");
  const int owner = dev != ex.end() && dev->is_number_integer() ? dev->get<int>() : -1;
  rv.owner_device = owner >= 0 && owner < cu::device_count() ? owner : -1;
  // Copies into it are driven from `device`, or, described ahead of any op, from the
  // describing thread's device (as a submit without a cuda piece would); posts enable their
  // stream's device when they first use it (post_path.cpp).
  int from = device;
  if (from < 0 && cudaGetDevice(&from) != cudaSuccess) {
    cudaGetLastError();
    from = 0;
  }
  device = from;  // the device imports are made on, as when an op described it
  if (kind == "local") {
    // Only another engine of this very process may describe memory by address.
    if (!same_process_.load())
      throw Error(ErrorCode::kProtocol, "nvlink: a peer in another process described " + what + " by address");
    enable_peer_access(from, rv.owner_device);
    return reinterpret_cast<uint8_t*>(base + offset);
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  ImportRec& rec = imports_[base];
  bool live = false;
  for (auto& [slot, rid] : rec.users) live |= leases_.still(slot, rid);
  // A new allocation at the base of an old one (the owner freed and allocated again) is
  // another buffer: never reached through the old one's mapping. Ops still holding the old
  // mapping keep it (rv.keep) until they finish.
  auto bid = ex.find("buffer_id");
  const uint64_t buffer_id = bid != ex.end() && bid->is_number_unsigned() ? bid->get<uint64_t>() : 0;
  if (!rec.imp || !live || rec.buffer_id != buffer_id) {
    rec = ImportRec{};
    rec.buffer_id = buffer_id;
    rec.imp = cu::import_region(ex, fd, device);
    // cuMem imports get their access from the import; cudaIpc ones need peer access to the
    // device the memory is on (the owner's, as this process numbers devices).
    enable_peer_access(from, rv.owner_device);
  }
  if (rec.imp->size < base_size)
    throw Error(ErrorCode::kProtocol, "nvlink: " + what + " lies outside the peer's allocation as mapped");
  rec.users.emplace_back(rv.slot, id);
  rv.keep = rec.imp;
  return rec.imp->base + offset;
}

}  // namespace sluice::detail::nvlink
