// Plugs GPU memory into the engine (Engine::allocate / register_memory for cuda:N).
#include "core/device_hooks.hpp"
#include "cuda/copy_kernels.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/staging.hpp"

namespace sluice::detail::cuda {
namespace {

// The engine's own kernels (the post path's signal, SM copies) load on a device before the
// user's kernels run there: a lazy load later would wait for a kernel spinning on a port
// channel semaphore that only our signal kernel can raise (copy_kernels.hpp).
void load_ours(int device) {
  if (cudaError_t e = load_kernels_on(device); e != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kSystem, std::string("loading the engine's kernels on cuda:") + std::to_string(device) +
                                        ": " + cudaGetErrorString(e));
  }
}

void* hook_allocate(uint64_t length, int device, uint64_t* size) {
  require_device(device, "allocate");  // no GPU is kNoDevice, before any CUDA call can say otherwise
  load_ours(device);
  DeviceBuffer b = allocate(length, device);
  *size = b.size;
  return b.ptr;
}

void hook_free(void* ptr) { release_ptr(ptr); }

void hook_check(const void* ptr, uint64_t length, int device) {
  require_device(device, "register_memory");
  int owner = pointer_device(ptr);
  if (owner < 0)
    throw Error(ErrorCode::kInvalidArgument, "register_memory: the pointer is not CUDA device memory but the location "
                                             "says cuda:" + std::to_string(device));
  if (owner != device)
    throw Error(ErrorCode::kInvalidArgument, "register_memory: the memory is on cuda:" + std::to_string(owner) +
                                                 ", not cuda:" + std::to_string(device));
  int last = pointer_device(static_cast<const uint8_t*>(ptr) + length - 1);
  if (last != device)
    throw Error(ErrorCode::kInvalidArgument, "register_memory: [ptr, ptr+length) runs past the device allocation");
  load_ours(device);
}

void hook_upload(void* device, const void* host, uint64_t n) { staging::upload(device, host, n); }

bool hook_host_mapped(const void* ptr, uint64_t length) {
  if (!ptr || length == 0) return false;
  for (const uint8_t* p : {static_cast<const uint8_t*>(ptr), static_cast<const uint8_t*>(ptr) + length - 1}) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    if (a.type != cudaMemoryTypeHost || a.devicePointer != p) return false;
  }
  return true;
}

const DeviceMemoryHooks kHooks{hook_allocate, hook_free, hook_check, hook_upload, hook_host_mapped};

const bool registered = [] {
  device_memory_hooks() = &kHooks;
  return true;
}();

}  // namespace
}  // namespace sluice::detail::cuda
