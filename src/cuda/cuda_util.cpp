#include "cuda/cuda_util.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

#include "core/log.hpp"
#include "core/params.hpp"

namespace sluice::detail::cuda {
namespace {

struct Probe {
  int count = 0;
  std::string why;
};

const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      r.why = std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(e) + ")";
      cudaGetLastError();
      return r;
    }
    if (n == 0) r.why = "no CUDA device";
    r.count = n;
    return r;
  }();
  return p;
}

template <class F>
void entry(const char* name, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess)
    fn = reinterpret_cast<F>(p);
  else
    cudaGetLastError();
}

// Engine allocations by address (for release_ptr) and exports by allocation base.
std::mutex g_mu;
std::map<uintptr_t, DeviceBuffer> g_allocs;
std::map<uintptr_t, nlohmann::json> g_exports;  // base -> desc without "offset"
std::map<uintptr_t, int> g_export_fds;

}  // namespace

int device_count(std::string* why) {
  const Probe& p = probe();
  if (why) *why = p.why;
  return p.count;
}

void require_device(int device, const char* what) {
  std::string why;
  int n = device_count(&why);
  if (n == 0) throw Error(ErrorCode::kNoDevice, std::string(what) + ": " + why);
  if (device < 0 || device >= n)
    throw Error(ErrorCode::kNoDevice, std::string(what) + ": cuda:" + std::to_string(device) + " does not exist (" +
                                          std::to_string(n) + " device(s) visible)");
}

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  ErrorCode code = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ? ErrorCode::kNoDevice
                   : err == cudaErrorMemoryAllocation                             ? ErrorCode::kSystem
                                                                                  : ErrorCode::kInternal;
  throw Error(code, std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

void check_cu(CUresult res, const char* what) {
  if (res == CUDA_SUCCESS) return;
  throw Error(res == CUDA_ERROR_OUT_OF_MEMORY ? ErrorCode::kSystem : ErrorCode::kInternal,
              std::string(what) + ": CUresult " + std::to_string(int(res)));
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    if (device_count() == 0) return r;
    entry("cuMemCreate", r.memCreate);
    entry("cuMemRelease", r.memRelease);
    entry("cuMemAddressReserve", r.memAddressReserve);
    entry("cuMemAddressFree", r.memAddressFree);
    entry("cuMemMap", r.memMap);
    entry("cuMemUnmap", r.memUnmap);
    entry("cuMemSetAccess", r.memSetAccess);
    entry("cuMemGetAllocationGranularity", r.memGetAllocationGranularity);
    entry("cuMemExportToShareableHandle", r.memExportToShareableHandle);
    entry("cuMemImportFromShareableHandle", r.memImportFromShareableHandle);
    entry("cuMemRetainAllocationHandle", r.memRetainAllocationHandle);
    entry("cuMemGetAddressRange", r.memGetAddressRange);
    entry("cuPointerGetAttribute", r.pointerGetAttribute);
    r.vmm = r.memCreate && r.memRelease && r.memAddressReserve && r.memAddressFree && r.memMap && r.memUnmap &&
            r.memSetAccess && r.memGetAllocationGranularity && r.memExportToShareableHandle &&
            r.memImportFromShareableHandle && r.memGetAddressRange;
    return r;
  }();
  return d;
}

namespace {

// Grant every device that can reach `owner` access to [ptr, ptr+size).
void set_access(CUdeviceptr ptr, uint64_t size, int owner) {
  const Driver& d = driver();
  int n = device_count();
  std::vector<CUmemAccessDesc> acc;
  for (int i = 0; i < n; ++i) {
    int ok = i == owner;
    if (!ok) cudaDeviceCanAccessPeer(&ok, i, owner);
    if (!ok) continue;
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = i;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    acc.push_back(a);
  }
  if (d.memSetAccess(ptr, size, acc.data(), acc.size()) != CUDA_SUCCESS) {
    // Some peers may refuse: fall back to the owner alone.
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = owner;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check_cu(d.memSetAccess(ptr, size, &a, 1), "cuMemSetAccess");
  }
}

// Process-wide: read at each allocation (allocation has no engine config at hand).
const Param<bool> kNoVmm{"cuda.no_vmm", "SLUICE_CUDA_NO_VMM", false, boolean(),
                         "allocate GPU memory with cudaMalloc (cudaIpc sharing) instead of cuMem (POSIX fd)",
                         ParamScope::kProcess};

bool vmm_supported(int device) {
  const Driver& d = driver();
  if (!d.vmm) return false;
  (void)device;  // cuMemCreate itself reports a device without VMM / POSIX-fd support
  return !kNoVmm.read();
}

}  // namespace

DeviceBuffer allocate(uint64_t length, int device) {
  require_device(device, "allocate");
  DeviceBuffer b;
  b.device = device;
  int prev = 0;
  cudaGetDevice(&prev);
  check(cudaSetDevice(device), "cudaSetDevice");
  struct Restore {
    int d;
    ~Restore() { cudaSetDevice(d); }
  } restore{prev};
  if (vmm_supported(device)) {
    const Driver& d = driver();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t gran = 0;
    check_cu(d.memGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
             "cuMemGetAllocationGranularity");
    uint64_t size = (length + gran - 1) / gran * gran;
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.memCreate(&h, size, &prop, 0);
    if (r == CUDA_SUCCESS) {
      CUdeviceptr ptr = 0;
      bool ok = d.memAddressReserve(&ptr, size, gran, 0, 0) == CUDA_SUCCESS;
      if (ok && d.memMap(ptr, size, 0, h, 0) != CUDA_SUCCESS) {
        d.memAddressFree(ptr, size);
        ok = false;
      }
      if (ok) {
        try {
          set_access(ptr, size, device);
        } catch (...) {
          d.memUnmap(ptr, size);
          d.memAddressFree(ptr, size);
          d.memRelease(h);
          throw;
        }
        b.ptr = reinterpret_cast<void*>(ptr);
        b.size = size;
        b.vmm = true;
        b.handle = h;
      } else {
        d.memRelease(h);
      }
    }
    if (!b.vmm) SLUICE_LOG(kInfo, "cuMemCreate on cuda:" << device << " failed; using cudaMalloc");
  }
  if (!b.vmm) {
    uint64_t size = (length + 4095) / 4096 * 4096;
    void* p = nullptr;
    check(cudaMalloc(&p, size), "cudaMalloc");
    b.ptr = p;
    b.size = size;
  }
  cudaError_t e = cudaMemset(b.ptr, 0, b.size);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    release(b);
    check(e, "cudaMemset");
  }
  std::lock_guard<std::mutex> lk(g_mu);
  g_allocs[reinterpret_cast<uintptr_t>(b.ptr)] = b;
  return b;
}

void release(const DeviceBuffer& b) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    uintptr_t base = reinterpret_cast<uintptr_t>(b.ptr);
    g_allocs.erase(base);
    g_exports.erase(base);
    auto f = g_export_fds.find(base);
    if (f != g_export_fds.end()) {
      ::close(f->second);
      g_export_fds.erase(f);
    }
  }
  if (!b.ptr) return;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(b.device);
  cudaDeviceSynchronize();
  cudaSetDevice(prev);
  if (b.vmm) {
    const Driver& d = driver();
    auto p = reinterpret_cast<CUdeviceptr>(b.ptr);
    d.memUnmap(p, b.size);
    d.memAddressFree(p, b.size);
    d.memRelease(b.handle);
  } else {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(b.device);
    cudaFree(b.ptr);
    cudaSetDevice(prev);
  }
}

void release_ptr(void* ptr) {
  DeviceBuffer b;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_allocs.end()) return;
    b = it->second;
  }
  release(b);
}

int pointer_device(const void* ptr) {
  if (!available()) return -1;
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (a.type != cudaMemoryTypeDevice) return -1;
  return a.device;
}

nlohmann::json export_region(const void* ptr, uint64_t length, int* fd_out) {
  *fd_out = -1;
  const Driver& d = driver();
  int dev = pointer_device(ptr);
  if (dev < 0) throw Error(ErrorCode::kInvalidArgument, "export: not device memory");
  // The driver calls below need a current context; this may be any engine thread.
  int prev = 0;
  cudaGetDevice(&prev);
  check(cudaSetDevice(dev), "cudaSetDevice");
  struct Restore {
    int d;
    ~Restore() { cudaSetDevice(d); }
  } restore{prev};
  CUdeviceptr base = 0;
  size_t size = 0;
  if (d.memGetAddressRange) check_cu(d.memGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)),
                                     "cuMemGetAddressRange");
  else {
    base = reinterpret_cast<CUdeviceptr>(ptr);
    size = length;
  }
  uint64_t offset = reinterpret_cast<uintptr_t>(ptr) - base;
  // The driver's id of this allocation: user memory freed and allocated again at the same
  // base is a new buffer whose export must not be the old one's (the peer would map the
  // freed memory). Engine allocations are dropped from the cache by release() as well.
  unsigned long long buffer_id = 0;
  if (d.pointerGetAttribute && d.pointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base) != CUDA_SUCCESS)
    buffer_id = 0;
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_exports.find(base);
  if (it != g_exports.end() && it->second.value("buffer_id", uint64_t(0)) != static_cast<uint64_t>(buffer_id)) {
    auto f = g_export_fds.find(base);
    if (f != g_export_fds.end()) {
      ::close(f->second);
      g_export_fds.erase(f);
    }
    g_exports.erase(it);
    it = g_exports.end();
  }
  if (it == g_exports.end()) {
    nlohmann::json desc{{"device", dev},
                        {"base_size", static_cast<uint64_t>(size)},
                        {"base", static_cast<uint64_t>(base)},
                        {"buffer_id", static_cast<uint64_t>(buffer_id)}};
    bool done = false;
    // cuMem* memory exported as a POSIX fd (engine allocations, or user memory created with
    // that handle type).
    // cudaMalloc memory says so (legacy IPC capable) and goes to the IPC path below without
    // the retain probe, whose expected failure on such memory is an API error under
    // compute-sanitizer and tools that log every failed driver call.
    int legacy_ipc = 0;
    if (d.pointerGetAttribute &&
        d.pointerGetAttribute(&legacy_ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, base) != CUDA_SUCCESS)
      legacy_ipc = 0;
    if (d.vmm && d.memRetainAllocationHandle && !legacy_ipc) {
      CUmemGenericAllocationHandle h = 0;
      if (d.memRetainAllocationHandle(&h, reinterpret_cast<void*>(base)) == CUDA_SUCCESS) {
        int fd = -1;
        if (d.memExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) == CUDA_SUCCESS) {
          desc["kind"] = "fd";
          g_export_fds[base] = fd;
          done = true;
        }
        d.memRelease(h);  // drop the retain
      }
    }
    if (!done) {
      cudaIpcMemHandle_t ih{};
      cudaError_t e = cudaIpcGetMemHandle(&ih, reinterpret_cast<void*>(base));
      if (e != cudaSuccess) {
        cudaGetLastError();
        throw Error(ErrorCode::kUnsupported, std::string("cuda memory at ") + std::to_string(base) +
                                                 " cannot be shared: neither a POSIX-fd cuMem allocation nor "
                                                 "cudaIpcGetMemHandle (" + cudaGetErrorString(e) + ")");
      }
      desc["kind"] = "ipc";
      desc["handle"] = hex(&ih, sizeof(ih));
    }
    it = g_exports.emplace(base, std::move(desc)).first;
  }
  nlohmann::json out = it->second;
  out["offset"] = offset;
  if (out["kind"] == "fd") {
    // Duplicated under g_mu: release() closes the export only under it, so this is the
    // allocation's descriptor and not a reused number.
    auto f = g_export_fds.find(base);
    if (f == g_export_fds.end() || (*fd_out = ::fcntl(f->second, F_DUPFD_CLOEXEC, 0)) < 0)
      throw Error(ErrorCode::kSystem, std::string("cannot duplicate the export of cuda memory at ") + std::to_string(base));
  }
  return out;
}

Import::~Import() {
  if (!base) return;
  if (vmm) {
    const Driver& d = driver();
    auto p = reinterpret_cast<CUdeviceptr>(base);
    d.memUnmap(p, size);
    d.memAddressFree(p, size);
    d.memRelease(handle);
  } else {
    cudaIpcCloseMemHandle(base);
  }
}

std::shared_ptr<Import> import_region(const nlohmann::json& desc, int fd, int device) {
  auto imp = std::make_shared<Import>();
  auto kind_it = desc.find("kind");
  auto size_it = desc.find("base_size");
  if (kind_it == desc.end() || !kind_it->is_string() || size_it == desc.end() || !size_it->is_number_unsigned() ||
      size_it->get<uint64_t>() == 0)
    throw Error(ErrorCode::kProtocol, "import: the description needs a string 'kind' and a positive 'base_size'");
  const std::string kind = kind_it->get<std::string>();
  imp->size = size_it->get<uint64_t>();
  int prev = 0;
  cudaGetDevice(&prev);
  check(cudaSetDevice(device), "cudaSetDevice");
  struct Restore {
    int d;
    ~Restore() { cudaSetDevice(d); }
  } restore{prev};
  if (kind == "fd") {
    const Driver& d = driver();
    if (!d.vmm) throw Error(ErrorCode::kUnsupported, "import: the driver lacks cuMem* entry points");
    if (fd < 0) throw Error(ErrorCode::kProtocol, "import: the peer passed no descriptor for its cuMem allocation");
    CUmemGenericAllocationHandle h = 0;
    CUresult r = d.memImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS)
      throw Error(ErrorCode::kProtocol, "import: the descriptor the peer passed is not a cuMem allocation (CUresult " +
                                            std::to_string(int(r)) + ")");
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    size_t gran = 0;
    d.memGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    CUdeviceptr ptr = 0;
    r = d.memAddressReserve(&ptr, imp->size, gran ? gran : (2 << 20), 0, 0);
    if (r != CUDA_SUCCESS) {
      d.memRelease(h);
      check_cu(r, "cuMemAddressReserve");
    }
    // The driver refuses to map more than the allocation holds: a base_size that overstates
    // it fails here instead of letting offsets run past the mapping.
    r = d.memMap(ptr, imp->size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      d.memAddressFree(ptr, imp->size);
      d.memRelease(h);
      throw Error(ErrorCode::kProtocol, "import: cannot map " + std::to_string(imp->size) +
                                            " bytes of the peer's cuMem allocation (CUresult " + std::to_string(int(r)) + ")");
    }
    try {
      set_access(ptr, imp->size, device);
    } catch (...) {
      d.memUnmap(ptr, imp->size);
      d.memAddressFree(ptr, imp->size);
      d.memRelease(h);
      throw;
    }
    imp->base = reinterpret_cast<uint8_t*>(ptr);
    imp->vmm = true;
    imp->handle = h;
  } else if (kind == "ipc") {
    cudaIpcMemHandle_t ih{};
    auto handle = desc.find("handle");
    if (handle == desc.end() || !handle->is_string() || !unhex(handle->get<std::string>(), &ih, sizeof(ih)))
      throw Error(ErrorCode::kProtocol, "import: malformed cudaIpc handle");
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    imp->base = static_cast<uint8_t*>(p);
    // The handle maps the whole allocation; its real size bounds every offset we use, however
    // large the peer said it was.
    const Driver& d = driver();
    CUdeviceptr rb = 0;
    size_t rs = 0;
    if (!d.memGetAddressRange || d.memGetAddressRange(&rb, &rs, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS ||
        rb > reinterpret_cast<CUdeviceptr>(p) || rb + rs - reinterpret_cast<CUdeviceptr>(p) < imp->size)
      throw Error(ErrorCode::kProtocol, "import: the peer's cudaIpc allocation is " + std::to_string(rs) +
                                            " bytes, not the " + std::to_string(imp->size) + " it described");
  } else {
    throw Error(ErrorCode::kProtocol, "import: unknown export kind '" + kind + "'");
  }
  return imp;
}

namespace {
std::mutex g_shared_mu;
std::map<uint64_t, std::pair<uint64_t, int>> g_shared;  // buffer -> (size, device)
}  // namespace

void register_shared_buffer(const void* ptr, uint64_t size, int device) {
  std::lock_guard<std::mutex> lk(g_shared_mu);
  g_shared[reinterpret_cast<uint64_t>(ptr)] = {size, device};
}

void unregister_shared_buffer(const void* ptr) {
  std::lock_guard<std::mutex> lk(g_shared_mu);
  g_shared.erase(reinterpret_cast<uint64_t>(ptr));
}

void release_shared_buffer(int device, const std::vector<void*>& opened, void* buf, void* host_word) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaDeviceSynchronize();
  for (void* p : opened) cudaIpcCloseMemHandle(p);
  if (buf) {
    unregister_shared_buffer(buf);
    cudaFree(buf);
  }
  if (host_word) cudaFreeHost(host_word);
  cudaSetDevice(prev);
}

uint8_t* map_shared_buffer(int pid, uint64_t ptr, uint64_t size, int peer_device, const cudaIpcMemHandle_t& ipc,
                           int my_device, std::vector<void*>* opened, const std::string& who) {
  int prev = 0;
  cudaGetDevice(&prev);
  check(cudaSetDevice(my_device), "cudaSetDevice");
  struct Restore {
    int dev;
    ~Restore() { cudaSetDevice(dev); }
  } restore{prev};
  if (pid == ::getpid()) {
    {
      std::lock_guard<std::mutex> lk(g_shared_mu);
      auto it = g_shared.find(ptr);
      if (it == g_shared.end() || it->second.first != size || it->second.second != peer_device)
        throw Error(ErrorCode::kProtocol, who + "'s handle claims this process but names none of its shared buffers");
    }
    if (peer_device != my_device) {
      int ok = 0;
      cudaDeviceCanAccessPeer(&ok, my_device, peer_device);
      if (!ok) throw Error(ErrorCode::kUnsupported, who + ": no peer access between the devices");
      cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();
      else check(e, "cudaDeviceEnablePeerAccess");
    }
    return reinterpret_cast<uint8_t*>(ptr);
  }
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, ipc, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  opened->push_back(p);
  const Driver& drv = driver();
  CUdeviceptr rb = 0;
  size_t rs = 0;
  auto at = reinterpret_cast<CUdeviceptr>(p);
  if (!drv.memGetAddressRange || drv.memGetAddressRange(&rb, &rs, at) != CUDA_SUCCESS || rb > at || rb + rs - at < size)
    throw Error(ErrorCode::kProtocol, who + "'s buffer is " + std::to_string(rs) + " bytes, smaller than its handle says");
  return static_cast<uint8_t*>(p);
}

std::string hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(n * 2, '0');
  auto* b = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[b[i] >> 4];
    s[2 * i + 1] = digits[b[i] & 15];
  }
  return s;
}

bool unhex(const std::string& text, void* out, size_t n) {
  if (text.size() != n * 2) return false;
  auto* b = static_cast<uint8_t*>(out);
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < n; ++i) {
    int hi = val(text[2 * i]), lo = val(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    b[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

namespace {
std::mutex g_words_mu;
std::vector<uint64_t*> g_free_words;
constexpr size_t kWordSlab = 4096, kWordStride = 64;
}  // namespace

uint64_t* take_mapped_word() {
  std::lock_guard<std::mutex> lk(g_words_mu);
  if (g_free_words.empty()) {
    void* p = nullptr;
    check(cudaHostAlloc(&p, kWordSlab, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc (mapped words)");
    for (size_t off = 0; off < kWordSlab; off += kWordStride)
      g_free_words.push_back(reinterpret_cast<uint64_t*>(static_cast<uint8_t*>(p) + off));
  }
  uint64_t* w = g_free_words.back();
  g_free_words.pop_back();
  __atomic_store_n(w, 0, __ATOMIC_RELEASE);
  return w;
}

void give_mapped_word(uint64_t* word) {
  if (!word) return;
  std::lock_guard<std::mutex> lk(g_words_mu);
  g_free_words.push_back(word);
}

}  // namespace sluice::detail::cuda
