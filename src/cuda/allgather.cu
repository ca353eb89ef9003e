// Intra-node AllGather: see include/sluice/allgather.hpp.
//
// Receive buffer of each rank (one cudaMalloc, shared with cudaIpc handles):
//   [counter 256 B][flags: 2 parities x world x kMaxChunks x u32][LL: 2 x world x 2*ll_max]
//   [staging: 2 x world x max_bytes]
// The call number ("epoch", starting at 1) lives in device memory so that a captured graph
// replays correctly: every block reads it at start and the last block to finish bumps it.
// Call e uses parity e & 1. A rank cannot reach call e+2 before every peer has finished call
// e (call e+1 needs each peer's e+1 data, sent only after that peer's call e kernel ended), so
// the other parity is never overwritten while a peer still reads it.
#include <unistd.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <cstring>
#include <cstdlib>

#include "core/params.hpp"
#include "cuda/c_api.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/device_sync.cuh"
#include "sluice/allgather.hpp"

namespace sluice::cuda {
namespace {

namespace d = sluice::detail::cuda;
using namespace sluice::cuda::dev;

// Process-wide: an AllGather has no engine; read when one is created.
const sluice::detail::Param<uint64_t> kLlMax{
    "cuda.ag_ll_max", "SLUICE_AG_LL_MAX", 256 << 10, sluice::detail::size_in(0, 1ull << 40),
    "AllGather: messages up to this size use the low-latency protocol", sluice::detail::ParamScope::kProcess};

constexpr int kMaxWorld = 8;
constexpr uint64_t kMaxChunks = 1024;
constexpr uint64_t kHeader = 256;
constexpr int kThreads = 512;

struct Peers {
  uint8_t* buf[kMaxWorld];  // every rank's receive buffer as mapped here (own one included)
};

struct Layout {
  uint64_t flags_off, ll_off, ll_slot, staging_off, staging_slot, total;
};

Layout layout(uint64_t max_bytes, uint64_t ll_max, int world) {
  Layout l;
  l.flags_off = kHeader;
  l.ll_off = l.flags_off + 2ull * world * kMaxChunks * 4;
  l.ll_off = (l.ll_off + 255) / 256 * 256;
  l.ll_slot = (2 * ll_max + 255) / 256 * 256;
  l.staging_off = l.ll_off + 2ull * world * l.ll_slot;
  l.staging_slot = (max_bytes + 255) / 256 * 256;
  l.total = l.staging_off + 2ull * world * l.staging_slot;
  return l;
}

// 8 bytes (or the n < 8 remaining) at p, any alignment.
__device__ __forceinline__ uint2 load8(const uint8_t* p, uint64_t n) {
  if (n >= 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint2*>(p);
  uint8_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (uint64_t i = 0; i < n && i < 8; ++i) b[i] = p[i];
  uint2 v;
  memcpy(&v, b, 8);
  return v;
}
__device__ __forceinline__ void store8(uint8_t* p, uint2 v, uint64_t n) {
  if (n >= 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
    *reinterpret_cast<uint2*>(p) = v;
    return;
  }
  uint8_t b[8];
  memcpy(b, &v, 8);
  for (uint64_t i = 0; i < n && i < 8; ++i) p[i] = b[i];
}

__device__ __forceinline__ uint32_t begin_epoch(uint8_t* self) {
  return *reinterpret_cast<volatile uint32_t*>(self) + 1;
}
__device__ __forceinline__ void end_epoch(uint8_t* self, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* done = reinterpret_cast<unsigned*>(self + 64);
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      *reinterpret_cast<volatile uint32_t*>(self) = epoch;
      __threadfence();
    }
  }
}

// The optional spin bound (AllGather::set_timeout; bound_ns 0 = spin until the data comes, the
// default). Checked every 1024 spins: a flag in mapped host memory (set by whichever thread ran
// out of time first, read by the host through AllGather::timed_out()) and the global timer.
__device__ __forceinline__ bool spin_expired(uint64_t bound_ns, int* err, uint64_t& start, uint32_t& n) {
  if (bound_ns == 0 || (++n & 1023) != 0) return false;
  if (*reinterpret_cast<volatile int*>(err) != 0) return true;
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  if (start == 0) {
    start = now;
    return false;
  }
  if (now - start <= bound_ns) return false;
  atomicExch_system(err, 1);
  __threadfence_system();
  return true;
}

__global__ void __launch_bounds__(kThreads) ll_kernel(Peers peers, int world, int rank, const uint8_t* __restrict__ in,
                                                      uint8_t* __restrict__ out, uint64_t bytes, Layout L,
                                                      uint64_t bound_ns, int* err) {
  uint8_t* self = peers.buf[rank];
  const uint32_t epoch = begin_epoch(self);
  const uint64_t parity = epoch & 1;
  const uint64_t lines = (bytes + 7) / 8;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t first = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
  // Send: one 16-byte packet per 8 data bytes, flags inside.
  for (uint64_t i = first; i < lines; i += stride) {
    uint64_t n = bytes - i * 8;
    uint2 v = load8(in + i * 8, n);
    uint4 pkt = make_uint4(v.x, epoch, v.y, epoch);
    for (int k = 1; k < world; ++k) {
      int p = (rank + k) % world;
      uint8_t* slot = peers.buf[p] + L.ll_off + (parity * world + rank) * L.ll_slot;
      st_v4(reinterpret_cast<uint4*>(slot) + i, pkt);
    }
    store8(out + uint64_t(rank) * bytes + i * 8, v, n);
  }
  // Receive.
  bool dead = false;
  uint64_t t0 = 0;
  uint32_t spins = 0;
  for (int k = 1; k < world && !dead; ++k) {
    int p = (rank + world - k) % world;
    const uint8_t* slot = self + L.ll_off + (parity * world + p) * L.ll_slot;
    for (uint64_t i = first; i < lines; i += stride) {
      uint4 pkt;
      for (;;) {
        pkt = ld_v4(reinterpret_cast<const uint4*>(slot) + i);
        if (pkt.y == epoch && pkt.w == epoch) break;
        if (spin_expired(bound_ns, err, t0, spins)) {
          dead = true;
          break;
        }
      }
      if (dead) break;
      store8(out + uint64_t(p) * bytes + i * 8, make_uint2(pkt.x, pkt.z), bytes - i * 8);
    }
  }
  end_epoch(self, epoch);
}

__global__ void __launch_bounds__(kThreads) simple_kernel(Peers peers, int world, int rank, const uint8_t* __restrict__ in,
                                                          uint8_t* __restrict__ out, uint64_t bytes, uint64_t chunk,
                                                          Layout L, uint64_t bound_ns, int* err) {
  uint8_t* self = peers.buf[rank];
  const uint32_t epoch = begin_epoch(self);
  const uint64_t parity = epoch & 1;
  const uint64_t nchunks = (bytes + chunk - 1) / chunk;
  // Send every chunk this block owns to every peer, then publish it.
  for (uint64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    uint64_t off = c * chunk, n = std::min<uint64_t>(chunk, bytes - off);
    for (int k = 1; k < world; ++k) {
      int p = (rank + k) % world;
      block_copy(peers.buf[p] + L.staging_off + (parity * world + rank) * L.staging_slot + off, in + off, n, false);
    }
    block_copy(out + uint64_t(rank) * bytes + off, in + off, n, false);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int k = 1; k < world; ++k) {
        int p = (rank + k) % world;
        auto* flags = reinterpret_cast<uint32_t*>(peers.buf[p] + L.flags_off);
        st_release(flags + (parity * world + rank) * kMaxChunks + c, epoch);
      }
    }
  }
  // Receive: wait for each chunk, copy it out.
  __shared__ int ready;
  bool dead = false;
  uint64_t t0 = 0;
  uint32_t spins = 0;
  for (int k = 1; k < world && !dead; ++k) {
    int p = (rank + world - k) % world;
    auto* flags = reinterpret_cast<const uint32_t*>(self + L.flags_off) + (parity * world + p) * kMaxChunks;
    const uint8_t* slot = self + L.staging_off + (parity * world + p) * L.staging_slot;
    for (uint64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
      if (threadIdx.x == 0) {
        ready = 1;
        while (ld_acquire(flags + c) != epoch) {
          if (spin_expired(bound_ns, err, t0, spins)) {
            ready = 0;
            break;
          }
        }
      }
      __syncthreads();
      if (!ready) {  // uniform in the block: every thread read the same shared word
        dead = true;
        break;
      }
      uint64_t off = c * chunk, n = std::min<uint64_t>(chunk, bytes - off);
      block_copy(out + uint64_t(p) * bytes + off, slot + off, n, true);
      __syncthreads();
    }
  }
  end_epoch(self, epoch);
}

struct Handle {
  int pid;
  int device;
  uint64_t ptr;
  uint64_t size;
  cudaIpcMemHandle_t ipc;
};


int sm_count(int device) {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n > 0 ? n : 32;
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kUInt8:
    case DType::kInt8: return 1;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kInt64:
    case DType::kFloat64: return 8;
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown dtype");
}

struct AllGather::Impl {
  int world = 0, rank = 0, device = 0, sms = 0;
  DType dtype = DType::kUInt8;
  uint64_t max_bytes = 0, ll_max = 0;
  Layout L{};
  uint8_t* buf = nullptr;
  Peers peers{};
  std::vector<void*> opened;
  bool connected = false;
  uint64_t bound_ns = 0;  // 0: unbounded spins
  int* err = nullptr;     // mapped host memory: 1 once a spin ran out of time
  int* err_dev = nullptr; // its device address
};

AllGather::AllGather(uint64_t max_tokens, uint64_t token_bytes, DType dtype, int world, int rank, int device)
    : impl_(std::make_unique<Impl>()) {
  d::require_device(device, "AllGather");
  if (world < 1 || world > kMaxWorld)
    throw Error(ErrorCode::kInvalidArgument, "AllGather: world size must be 1.." + std::to_string(kMaxWorld));
  if (rank < 0 || rank >= world) throw Error(ErrorCode::kInvalidArgument, "AllGather: rank out of range");
  if (max_tokens == 0 || token_bytes == 0) throw Error(ErrorCode::kInvalidArgument, "AllGather: empty max size");
  auto& m = *impl_;
  m.world = world;
  m.rank = rank;
  m.device = device;
  m.dtype = dtype;
  m.max_bytes = max_tokens * token_bytes;
  const uint64_t ll = kLlMax.read();
  m.ll_max = std::min(m.max_bytes, ll);
  m.L = layout(m.max_bytes, m.ll_max, world);
  m.sms = sm_count(device);
  int prev = 0;
  cudaGetDevice(&prev);
  d::check(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, m.L.total);
  if (e == cudaSuccess) e = cudaMemset(p, 0, m.L.total);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  d::check(e, "AllGather: allocating the receive buffer");
  m.buf = static_cast<uint8_t*>(p);
  // A rank of this same process is reached through the raw pointer in its handle, honoured only
  // for a registered buffer (d::map_shared_buffer).
  d::register_shared_buffer(p, m.L.total, m.device);
  for (auto& b : m.peers.buf) b = nullptr;
  m.peers.buf[rank] = m.buf;
  // The timeout flag (mapped host memory), and both kernels loaded now: a kernel's first launch
  // waits for the kernels running on the device, e.g. a HierAllGather's exchange kernel
  // spinning ahead of it on the stream.
  d::check(cudaSetDevice(device), "cudaSetDevice");
  void* e2 = nullptr;
  e = cudaHostAlloc(&e2, 64, cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    m.err = static_cast<int*>(e2);
    std::memset(m.err, 0, 64);
    e = cudaHostGetDevicePointer(&e2, m.err, 0);
    m.err_dev = static_cast<int*>(e2);
  }
  cudaFuncAttributes attr;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, ll_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, simple_kernel);
  cudaSetDevice(prev);
  d::check(e, "AllGather: setting up the timeout flag and loading the kernels");
}

AllGather::~AllGather() {
  if (!impl_) return;
  auto& m = *impl_;
  d::release_shared_buffer(m.device, m.opened, m.buf, m.err);
}

std::string AllGather::handle() const {
  auto& m = *impl_;
  Handle h{};
  h.pid = ::getpid();
  h.device = m.device;
  h.ptr = reinterpret_cast<uint64_t>(m.buf);
  h.size = m.L.total;
  d::check(cudaIpcGetMemHandle(&h.ipc, m.buf), "cudaIpcGetMemHandle");
  return d::hex(&h, sizeof(h));
}

void AllGather::connect(const std::vector<std::string>& handles) {
  auto& m = *impl_;
  if (static_cast<int>(handles.size()) != m.world)
    throw Error(ErrorCode::kInvalidArgument, "AllGather::connect: need " + std::to_string(m.world) + " handles");
  for (int r = 0; r < m.world; ++r) {
    if (r == m.rank) continue;
    Handle h{};
    if (!d::unhex(handles[r], &h, sizeof(h)))
      throw Error(ErrorCode::kInvalidArgument, "AllGather::connect: handle " + std::to_string(r) + " is malformed");
    if (h.size != m.L.total)
      throw Error(ErrorCode::kInvalidArgument, "AllGather::connect: rank " + std::to_string(r) +
                                                   " was built with other sizes");
    m.peers.buf[r] = d::map_shared_buffer(h.pid, h.ptr, h.size, h.device, h.ipc, m.device, &m.opened,
                                          "AllGather::connect: rank " + std::to_string(r));
  }
  m.connected = true;
}

void AllGather::all_gather(const void* in, void* out, uint64_t count, void* stream) {
  all_gather_bytes(in, out, count * dtype_size(impl_->dtype), stream);
}

void AllGather::all_gather_bytes(const void* in, void* out, uint64_t bytes, void* stream) {
  auto& m = *impl_;
  if (!m.connected) throw Error(ErrorCode::kInvalidArgument, "AllGather: call connect() first");
  if (bytes > m.max_bytes)
    throw Error(ErrorCode::kOutOfRange, "AllGather: " + std::to_string(bytes) + " bytes exceed the maximum of " +
                                            std::to_string(m.max_bytes));
  if (bytes == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  auto* i8 = static_cast<const uint8_t*>(in);
  auto* o8 = static_cast<uint8_t*>(out);
  if (bytes <= m.ll_max) {
    uint64_t lines = (bytes + 7) / 8;
    unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>((lines + kThreads - 1) / kThreads, 1, std::min(m.sms, 64)));
    ll_kernel<<<blocks, kThreads, 0, s>>>(m.peers, m.world, m.rank, i8, o8, bytes, m.L, m.bound_ns, m.err_dev);
  } else {
    uint64_t chunk = std::max<uint64_t>(64 << 10, (bytes + kMaxChunks - 1) / kMaxChunks);
    uint64_t want = (bytes + 255) / 256;  // about 256 chunks when large
    chunk = std::max(chunk, (want + 15) / 16 * 16);
    chunk = (chunk + 15) / 16 * 16;
    uint64_t nchunks = (bytes + chunk - 1) / chunk;
    unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>(nchunks, 1, std::min(m.sms, 64)));
    simple_kernel<<<blocks, kThreads, 0, s>>>(m.peers, m.world, m.rank, i8, o8, bytes, chunk, m.L, m.bound_ns, m.err_dev);
  }
  d::check(cudaGetLastError(), "AllGather kernel launch");
}

void AllGather::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) throw Error(ErrorCode::kInvalidArgument, "AllGather::set_timeout: negative timeout");
  impl_->bound_ns = uint64_t(timeout.count()) * 1000000ull;
}
bool AllGather::timed_out() const { return __atomic_load_n(impl_->err, __ATOMIC_ACQUIRE) != 0; }

uint64_t AllGather::max_bytes() const { return impl_->max_bytes; }
uint64_t AllGather::ll_max_bytes() const { return impl_->ll_max; }
int AllGather::world_size() const { return impl_->world; }
int AllGather::rank() const { return impl_->rank; }

}  // namespace sluice::cuda

// C entry points for ctypes (python/sluice/cuda_allgather.py). Marked SLUICE_API: libsluice is
// built with hidden visibility and ctypes finds them by name.
extern "C" {

namespace capi = sluice::detail::capi;

SLUICE_API void* sluice_ag_create(uint64_t max_bytes, int world, int rank, int device, char* err, int errlen) {
  return capi::guarded<void*>(err, errlen, nullptr, [&] {
    return new sluice::cuda::AllGather(max_bytes, 1, sluice::cuda::DType::kUInt8, world, rank, device);
  });
}

SLUICE_API int sluice_ag_handle(void* ag, char* out, int outlen, char* err, int errlen) {
  return capi::guarded(err, errlen, -1, [&] {
    std::string h = static_cast<sluice::cuda::AllGather*>(ag)->handle();
    if (static_cast<int>(h.size()) + 1 > outlen) throw sluice::Error(sluice::ErrorCode::kInvalidArgument, "buffer too small");
    std::memcpy(out, h.c_str(), h.size() + 1);
    return static_cast<int>(h.size());
  });
}

SLUICE_API int sluice_ag_connect(void* ag, const char** handles, int n, char* err, int errlen) {
  return capi::guarded(err, errlen, -1, [&] {
    static_cast<sluice::cuda::AllGather*>(ag)->connect(std::vector<std::string>(handles, handles + n));
    return 0;
  });
}

SLUICE_API int sluice_ag_run(void* ag, const void* in, void* out, uint64_t bytes, void* stream, char* err, int errlen) {
  return capi::guarded(err, errlen, -1, [&] {
    static_cast<sluice::cuda::AllGather*>(ag)->all_gather_bytes(in, out, bytes, stream);
    return 0;
  });
}

SLUICE_API void sluice_ag_destroy(void* ag) { delete static_cast<sluice::cuda::AllGather*>(ag); }

}  // extern "C"
