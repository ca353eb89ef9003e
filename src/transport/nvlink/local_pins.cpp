// Page-locking our own engine-allocated host regions for copies to and from GPUs (see the header).
#include "transport/nvlink/local_pins.hpp"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/log.hpp"

namespace sluice::detail::nvlink {

int64_t absent_pages(const uint8_t* base, uint64_t length) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((1ull << 30) / page);
  int64_t absent = 0;
  for (uint64_t off = 0; off < length; off += 1ull << 30) {
    const uint64_t n = std::min<uint64_t>(1ull << 30, length - off);
    if (::mincore(const_cast<uint8_t*>(base + off), n, vec.data()) != 0) return -1;
    for (uint64_t i = 0; i < (n + page - 1) / page; ++i) absent += (vec[i] & 1) ? 0 : 1;
  }
  return absent;
}

bool LocalPins::pin(const RegionEntry& e) {
  if (e.memfd < 0 || !e.location.is_host() || e.length == 0) return false;
  std::shared_ptr<Pin> p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = pins_[e.id];
    if (!slot) slot = std::make_shared<Pin>();
    p = slot;
  }
  std::call_once(p->once, [&] {
    if (int64_t absent = absent_pages(e.base, e.length); absent != 0) {
      SLUICE_LOG(kInfo, "nvlink: our host region of " << e.length << " bytes is not page-locked: "
                            << (absent < 0 ? std::string("mincore failed") : std::to_string(absent) + " of its pages are not in memory")
                            << "; copies between it and GPUs stay pageable");
      return;
    }
    cudaError_t err = cudaHostRegister(e.base, e.length, cudaHostRegisterPortable);
    if (err == cudaSuccess) {
      p->base = e.base;
      p->locked = p->usable = true;
      SLUICE_LOG(kInfo, "nvlink: page-locked our host region of " << e.length << " bytes for copies to and from GPUs");
    } else if (err == cudaErrorHostMemoryAlreadyRegistered) {
      (void)cudaGetLastError();
      p->usable = true;  // the application locked it: not ours to unlock
    } else {
      (void)cudaGetLastError();  // not sticky, but leave no error for the next call to find
      SLUICE_LOG(kWarn, "nvlink: cannot page-lock our host region of " << e.length << " bytes ("
                            << cudaGetErrorString(err) << "); copies between it and GPUs stay pageable (slower)");
    }
  });
  return p->usable;
}

void LocalPins::forget(const RegionEntry& e) {
  std::shared_ptr<Pin> p;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pins_.find(e.id);
    if (it == pins_.end()) return;
    p = std::move(it->second);
    pins_.erase(it);
  }
  // The engine unmaps the region after this returns: CUDA must not keep it registered.
  if (p->locked) (void)cudaHostUnregister(p->base);
}

LocalPins::~LocalPins() {
  for (auto& [id, p] : pins_)
    if (p->locked) (void)cudaHostUnregister(p->base);  // at exit CUDA may be gone already: nothing to do then
}

}  // namespace sluice::detail::nvlink
