// Internal CUDA helpers shared by the engine's GPU memory, the nvlink transport and the
// AllGather. The runtime is linked statically and the driver API is reached through
// cudaGetDriverEntryPointByVersion, so libsluice loads on hosts without an NVIDIA driver;
// there available() is false and every CUDA feature reports kNoDevice.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sluice/error.hpp"

namespace sluice::detail::cuda {

// Number of usable CUDA devices (0 without driver or GPU); *why says why when 0.
int device_count(std::string* why = nullptr);
inline bool available() { return device_count() > 0; }

// Throws Error(kNoDevice) unless `device` is a usable ordinal.
void require_device(int device, const char* what);

// Throws Error naming `what` when `err` is not cudaSuccess.
void check(cudaError_t err, const char* what);
void check_cu(CUresult res, const char* what);

// The driver entry points we use (nullptr members when the driver lacks them).
struct Driver {
  decltype(&::cuMemCreate) memCreate = nullptr;
  decltype(&::cuMemRelease) memRelease = nullptr;
  decltype(&::cuMemAddressReserve) memAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) memAddressFree = nullptr;
  decltype(&::cuMemMap) memMap = nullptr;
  decltype(&::cuMemUnmap) memUnmap = nullptr;
  decltype(&::cuMemSetAccess) memSetAccess = nullptr;
  decltype(&::cuMemGetAllocationGranularity) memGetAllocationGranularity = nullptr;
  decltype(&::cuMemExportToShareableHandle) memExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) memImportFromShareableHandle = nullptr;
  decltype(&::cuMemRetainAllocationHandle) memRetainAllocationHandle = nullptr;
  decltype(&::cuMemGetAddressRange) memGetAddressRange = nullptr;
  decltype(&::cuPointerGetAttribute) pointerGetAttribute = nullptr;
  bool vmm = false;  // every cuMem* entry point above was found
};
const Driver& driver();

// Device memory the engine allocated: cuMem* with a POSIX-fd export when the driver allows
// it, else cudaMalloc (shared through cudaIpc handles).
struct DeviceBuffer {
  void* ptr = nullptr;
  uint64_t size = 0;
  int device = -1;
  bool vmm = false;
  CUmemGenericAllocationHandle handle = 0;
};
DeviceBuffer allocate(uint64_t length, int device);
void release(const DeviceBuffer& b);
// Releases an engine allocation by its address (engine hooks).
void release_ptr(void* ptr);

// The device that owns `ptr`, or -1 if it is not device memory.
int pointer_device(const void* ptr);

// How a same-host peer can map the allocation that holds [ptr, ptr+length):
// {"kind": "fd"|"ipc", "handle": hex (ipc), "base": n, "base_size": n, "offset": n, "device": n}.
// For "fd", *fd_out is a fresh duplicate of the allocation's POSIX-fd export (the caller passes
// it over a Unix socket with SCM_RIGHTS and closes it); descriptor numbers never travel in a
// message. Cached per allocation base. Throws Error when the memory cannot be shared.
nlohmann::json export_region(const void* ptr, uint64_t length, int* fd_out);

// A peer's allocation mapped into this process.
struct Import {
  uint8_t* base = nullptr;  // mapped base of the peer's allocation
  uint64_t size = 0;        // bytes mapped: never more than the allocation really has
  bool vmm = false;
  CUmemGenericAllocationHandle handle = 0;
  ~Import();
};
// Maps what a peer's export_region() described: kind "fd" from `fd`, the descriptor the peer
// passed us (not taken over: the caller closes it), kind "ipc" from the handle. `device` is the
// local device that will drive copies. Throws Error (kProtocol when the description does not
// match what the driver maps, e.g. a base_size larger than the allocation).
std::shared_ptr<Import> import_region(const nlohmann::json& desc, int fd, int device);

// Device buffers that the NVLink kernel objects (AllGather, StreamP2p) share with peers by
// cudaIpc handle. A handle is only bytes from a rendezvous, so mapping one checks it: one that
// names this process must name a registered buffer of that size and device (a forged one could
// otherwise aim our kernels at any memory of the process), and another process's allocation
// must be at least as large as the handle says (our kernels write that far).
void register_shared_buffer(const void* ptr, uint64_t size, int device);
void unregister_shared_buffer(const void* ptr);
// The peer's buffer as this process reaches it from `my_device` (the current device is left
// as it was): its own address for a buffer of this process (peer access enabled between the
// devices), else a new IPC mapping, appended to *opened (close each with cudaIpcCloseMemHandle).
// Throws Error naming `who`.
// Undoes both for one object (the AllGather, StreamP2p) when it is destroyed: waits for
// `device`, closes the peers' buffers in `opened`, unregisters and frees `buf`, frees the
// mapped host word `host_word` (each may be null); the caller's current device is kept.
void release_shared_buffer(int device, const std::vector<void*>& opened, void* buf, void* host_word);

uint8_t* map_shared_buffer(int pid, uint64_t ptr, uint64_t size, int peer_device, const cudaIpcMemHandle_t& ipc,
                           int my_device, std::vector<void*>* opened, const std::string& who);

// A 64-bit word in pinned host memory mapped into every device (same address on host and
// device), on a cache line of its own, zeroed: a kernel publishes progress there with a
// release store and the host reads it without a CUDA call (nvlink's batch kernel). Taken from
// 4 KiB slabs that are never freed: cudaFreeHost may wait for every kernel of a device, and
// a port channel's kernel may be spinning there. Throws Error when pinning fails.
uint64_t* take_mapped_word();
void give_mapped_word(uint64_t* word);

std::string hex(const void* data, size_t n);
bool unhex(const std::string& text, void* out, size_t n);

}  // namespace sluice::detail::cuda
