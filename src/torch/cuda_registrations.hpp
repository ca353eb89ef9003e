// CUDA memory that the backend sends from or receives into directly (the device path,
// docs/torch.md "CUDA tensors"). Registering GPU memory costs an engine registration here and,
// on the peer, a description round trip and an import for every new region, so a region per
// message would cost more than moving a 64 MiB tensor over NVLink. Instead the whole CUDA
// allocation that holds a tensor (a segment of torch's caching allocator) is registered once
// and kept, keyed by its base address and checked against the driver's buffer id on every
// use: when torch frees a segment and a new one is made at the same address, the id differs
// and the old registration is dropped (never reused for memory it did not describe).
// Registrations nobody uses are dropped oldest first beyond `max_entries`. Torch-free.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <optional>
#include <string>

#include "sluice/engine.hpp"

namespace sluice::torch_backend {

class CudaRegistrations {
 public:
  struct Lease {
    MemoryHandle handle;  // the allocation's registration
    uint64_t offset = 0;  // of the pointer in it
    void* key = nullptr;  // for release()
  };

  explicit CudaRegistrations(Engine& engine, size_t max_entries = 64);
  ~CudaRegistrations();  // unregisters every entry (the engine must still be open)
  CudaRegistrations(const CudaRegistrations&) = delete;
  CudaRegistrations& operator=(const CudaRegistrations&) = delete;

  // The registration covering [ptr, ptr+n), held until release(key). Nullopt with *why when
  // the memory is not a CUDA allocation the engine can register; the caller then moves the
  // tensor through host memory instead.
  std::optional<Lease> acquire(const void* ptr, uint64_t n, std::string* why);
  void release(void* key);
  size_t size() const;

 private:
  struct Entry {
    void* base = nullptr;
    uint64_t size = 0;
    uint64_t buffer_id = 0;
    MemoryHandle handle;
    int uses = 0;
  };
  void trim_locked();  // drops unused entries, oldest first, beyond max_entries_

  Engine& engine_;
  const size_t max_entries_;
  mutable std::mutex mu_;
  std::list<Entry> entries_;  // most recently used first
};

}  // namespace sluice::torch_backend
