#include "cuda_registrations.hpp"

#include "core/log.hpp"
#include "sluice/cuda.hpp"

namespace sluice::torch_backend {

CudaRegistrations::CudaRegistrations(Engine& engine, size_t max_entries) : engine_(engine), max_entries_(max_entries) {}

CudaRegistrations::~CudaRegistrations() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : entries_) {
    try {
      engine_.unregister_memory(e.handle);
    } catch (const Error&) {
      // The engine closed first: its registry went with it.
    }
  }
  entries_.clear();
}

std::optional<CudaRegistrations::Lease> CudaRegistrations::acquire(const void* ptr, uint64_t n, std::string* why) {
  cuda::Allocation a;
  if (!cuda::allocation_of(ptr, &a)) {
    *why = "not CUDA device memory the driver can describe";
    return std::nullopt;
  }
  const uint64_t off = static_cast<const uint8_t*>(ptr) - static_cast<const uint8_t*>(a.base);
  if (off > a.size || n > a.size - off) {
    *why = "the tensor's bytes run past its CUDA allocation";
    return std::nullopt;
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->base != a.base) continue;
    if (it->size == a.size && it->buffer_id == a.buffer_id) {
      entries_.splice(entries_.begin(), entries_, it);  // most recently used first
      ++it->uses;
      return Lease{it->handle, off, it->base};
    }
    // Another allocation now lives at this address: the old registration described memory
    // that is gone. An op still using it means the old tensor was freed under it; do not
    // touch that, move this tensor through host memory.
    if (it->uses > 0) {
      *why = "an earlier CUDA allocation at this address is still in use by an operation";
      return std::nullopt;
    }
    engine_.unregister_memory(it->handle);
    entries_.erase(it);
    break;
  }
  MemoryHandle h;
  try {
    h = engine_.register_memory(a.base, a.size, Location::cuda(a.device));
  } catch (const Error& e) {
    *why = e.what();
    return std::nullopt;
  }
  entries_.push_front(Entry{a.base, a.size, a.buffer_id, h, 1});
  trim_locked();
  return Lease{h, off, a.base};
}

void CudaRegistrations::release(void* key) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& e : entries_)
    if (e.base == key && e.uses > 0) {
      --e.uses;
      break;
    }
  trim_locked();
}

void CudaRegistrations::trim_locked() {
  for (auto it = entries_.end(); entries_.size() > max_entries_ && it != entries_.begin();) {
    --it;
    if (it->uses == 0) {
      try {
        engine_.unregister_memory(it->handle);
      } catch (const Error& e) {
        SLUICE_LOG(kWarn, "sluice torch: dropping a CUDA registration: " << e.what());
      }
      it = entries_.erase(it);
    }
  }
}

size_t CudaRegistrations::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return entries_.size();
}

}  // namespace sluice::torch_backend
