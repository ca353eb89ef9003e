// Hierarchical AllGather: see include/sluice/hier_allgather.hpp for the protocol.
//
// Memory, all allocated at construction:
//   rail     pinned host memory (cudaHostAlloc, mapped), RailLayout: N slots + semaphores,
//            registered with this rank's engine as region "sluice.hier.rail". Host memory on
//            purpose: tcp moves it with plain socket calls and rdma registers it like any host
//            buffer, so the proxy never issues a CUDA call while our kernels spin (a staged
//            copy of device memory is a synchronous cudaMemcpy on the legacy stream, which
//            would wait for a kernel spinning on that stream).
//   mine     device, N x max_bytes: this rank's rail block for the intra-node phase.
//   scratch  device, K x N x max_bytes (K > 1): the intra-node AllGather's output.
//   status   mapped host memory, 4 ints: error code, step, peer node, PortResult.
//   dev      device: the channels' device handles, the permutation, the call counter and
//            the last kernel's block-arrival counter.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <set>

#include "collective/hier_allgather_wiring.hpp"
#include "collective/hier_rail.hpp"
#include "collective/topology.hpp"
#include "cuda/c_api.hpp"
#include "cuda/cuda_util.hpp"
#include "sluice/allgather.hpp"
#include "sluice/engine.hpp"
#include "sluice/hier_allgather.hpp"
#include "sluice/port_channel.hpp"

namespace sluice::cuda {
namespace {

namespace d = sluice::detail::cuda;
using sluice::detail::HierHandle;
using sluice::detail::HierWiring;
using sluice::detail::Topology;

constexpr int kHierThreads = 512;

// Which step failed (status[1]).
enum Step : int { kStepCredit = 1, kStepPut = 2, kStepData = 3, kStepCreditSignal = 4 };

struct Dev {
  PortChannelDeviceHandle* data = nullptr;    // [npeers]: puts + data signals; wait = peer's data
  PortChannelDeviceHandle* credit = nullptr;  // [npeers]: credit signals; wait = peer's credit
  const int* peer_node = nullptr;             // [npeers]
  const int* out_slot = nullptr;              // [K * N]
  uint32_t* calls = nullptr;                  // calls started (device)
  uint32_t* arrive = nullptr;                 // collect's block arrivals (device)
  int* status = nullptr;                      // mapped host memory
  int npeers = 0;
  int node = 0, nodes = 0, per_node = 0;
  uint64_t spin_ns = 0;
};

__device__ __forceinline__ int status_code(const int* status) {
  return *reinterpret_cast<const volatile int*>(status);
}

// The status word read once per block, for the wide copy kernels: a volatile read of mapped
// host memory by every thread, and a system-scope fence by every thread, each serialize
// across the GPU (measured 2026-11-28 on H200: about 17 us per block of 512 threads, so the
// stage and collect kernels took 280 us at 64 KiB and 550 us from 256 KiB). Call once per
// kernel, by every thread of the block.
__device__ __forceinline__ int block_status(const Dev& dv) {
  __shared__ int s;
  if (threadIdx.x == 0) s = status_code(dv.status);
  __syncthreads();
  return s;
}

__device__ void fail(const Dev& dv, int step, int peer, PortResult r) {
  // The first failure wins; the code is what the host reports.
  if (atomicCAS_system(dv.status, 0, r == PortResult::kTimeout ? int(ErrorCode::kTimeout) : int(ErrorCode::kPeerLost)) ==
      0) {
    reinterpret_cast<volatile int*>(dv.status)[1] = step;
    reinterpret_cast<volatile int*>(dv.status)[2] = peer;
    reinterpret_cast<volatile int*>(dv.status)[3] = int(r);
    __threadfence_system();
  }
}

// Copies n bytes with every thread of the grid; `cv`: the source is written by another agent
// (the host's transport), load it past the caches.
__device__ __forceinline__ void grid_copy(uint8_t* dst, const uint8_t* src, uint64_t n, bool cv) {
  const uint64_t first = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) & 15) == 0) {
    auto* d4 = reinterpret_cast<uint4*>(dst);
    auto* s4 = reinterpret_cast<const uint4*>(src);
    for (uint64_t i = first; i < n / 16; i += stride) d4[i] = cv ? __ldcv(s4 + i) : s4[i];
  } else {
    for (uint64_t i = first; i < n; i += stride)
      dst[i] = cv ? static_cast<uint8_t>(__ldcv(reinterpret_cast<const signed char*>(src) + i)) : src[i];
  }
}

// Step 1: from the second call on, every rail peer's credit for the previous call.
__global__ void credit_kernel(Dev dv) {
  __shared__ uint32_t call;
  if (threadIdx.x == 0) call = *dv.calls;
  __syncthreads();
  if (status_code(dv.status) == 0 && call > 0) {
    for (int p = threadIdx.x; p < dv.npeers; p += blockDim.x) {
      PortResult r = dv.credit[p].wait(dv.spin_ns);
      if (r != PortResult::kOk) fail(dv, kStepCredit, dv.peer_node[p], r);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *dv.calls = call + 1;
}

// Step 2: input -> own rail slot (host) and own slot of mine (device).
__global__ void __launch_bounds__(kHierThreads) stage_kernel(Dev dv, const uint8_t* in, uint8_t* rail, uint8_t* mine,
                                                         uint64_t bytes) {
  const uint64_t off = uint64_t(dv.node) * bytes;
  const bool ok = block_status(dv) == 0;
  grid_copy(mine + off, in, bytes, false);
  if (dv.npeers > 0 && ok) grid_copy(rail + off, in, bytes, false);
  // The proxy (a host thread) reads the rail once step 3 pushed the put: the block's writes,
  // ordered before thread 0 by the barrier, then one system-scope fence (fences are cumulative).
  __syncthreads();
  if (threadIdx.x == 0) __threadfence_system();
}

// Step 3: own shard to every rail peer, then every rail peer's shard.
__global__ void exchange_kernel(Dev dv, uint64_t bytes) {
  __shared__ int failed;  // one read for the block, so that every thread takes the same branch
  if (threadIdx.x == 0) failed = status_code(dv.status);
  __syncthreads();
  if (failed != 0) return;
  const uint64_t off = uint64_t(dv.node) * bytes;
  for (int p = threadIdx.x; p < dv.npeers; p += blockDim.x) {
    PortResult r = dv.data[p].put_with_signal(off, off, bytes);
    if (r != PortResult::kOk) fail(dv, kStepPut, dv.peer_node[p], r);
  }
  __syncthreads();
  for (int p = threadIdx.x; p < dv.npeers; p += blockDim.x) {
    if (status_code(dv.status) != 0) break;
    PortResult r = dv.data[p].wait(dv.spin_ns);
    if (r != PortResult::kOk) fail(dv, kStepData, dv.peer_node[p], r);
  }
}

// Step 4: the peers' rail slots -> mine; the last block signals the credits.
__global__ void __launch_bounds__(kHierThreads) collect_kernel(Dev dv, const uint8_t* rail, uint8_t* mine, uint64_t bytes) {
  const bool ok = block_status(dv) == 0;
  if (ok) {
    for (int p = 0; p < dv.npeers; ++p) {
      const uint64_t off = uint64_t(dv.peer_node[p]) * bytes;
      grid_copy(mine + off, rail + off, bytes, true);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(dv.arrive, 1u) == gridDim.x - 1) {
      *dv.arrive = 0;
      __threadfence();
      if (ok && status_code(dv.status) == 0) {
        for (int p = 0; p < dv.npeers; ++p) {
          PortResult r = dv.credit[p].signal();
          if (r != PortResult::kOk) fail(dv, kStepCreditSignal, dv.peer_node[p], r);
        }
      }
    }
  }
}

// Step 6: src block (j, m) -> out slot out_slot[j * N + m].
__global__ void __launch_bounds__(kHierThreads) permute_kernel(Dev dv, const uint8_t* src, uint8_t* out, uint64_t bytes) {
  const int blocks = dv.per_node * dv.nodes;
  for (int b = 0; b < blocks; ++b)
    grid_copy(out + uint64_t(dv.out_slot[b]) * bytes, src + uint64_t(b) * bytes, bytes, false);
}

int hier_sm_count(int device) {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  return n > 0 ? n : 32;
}

const char* step_name(int s) {
  switch (s) {
    case kStepCredit: return "waiting for a rail peer's credit";
    case kStepPut: return "pushing a put to a rail peer";
    case kStepData: return "waiting for a rail peer's shard";
    case kStepCreditSignal: return "signalling a credit";
  }
  return "?";
}

// Restores the caller's device on scope exit.
struct DeviceGuard {
  int prev = 0;
  explicit DeviceGuard(int dev) {
    cudaGetDevice(&prev);
    d::check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(prev); }
};

// One live rank per device in this process (see the constructor's comment in the header).
class DeviceClaim {
 public:
  explicit DeviceClaim(int device) : device_(device) {
    std::lock_guard<std::mutex> lk(mu());
    if (!claimed().insert(device).second)
      throw Error(ErrorCode::kInvalidArgument,
                  "HierAllGather: cuda:" + std::to_string(device) +
                      " already has a rank in this process; give each rank its own GPU (or process): one rank's "
                      "kernels wait for another's, and CUDA does not run kernels of two streams concurrently for "
                      "certain, so two ranks on one GPU can deadlock until the timeout");
  }
  ~DeviceClaim() {
    std::lock_guard<std::mutex> lk(mu());
    claimed().erase(device_);
  }
  DeviceClaim(const DeviceClaim&) = delete;
  DeviceClaim& operator=(const DeviceClaim&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::set<int>& claimed() {
    static std::set<int> s;
    return s;
  }
  int device_;
};

}  // namespace

struct HierAllGather::Impl {
  int world = 0, rank = 0, device = 0, sms = 0;
  uint64_t max_bytes = 0;
  HierAllGatherOptions opt;
  Topology topo;
  HierWiring w;
  uint8_t* rail = nullptr;      // pinned, mapped
  uint8_t* rail_dev = nullptr;  // its device address (the same under UVA)
  std::unique_ptr<sluice::detail::HierRail> net;  // engine, rail region, channels (N > 1)
  uint8_t* mine = nullptr;
  uint8_t* scratch = nullptr;
  int* status = nullptr;  // pinned, mapped
  uint8_t* devmem = nullptr;
  Dev dv{};
  std::unique_ptr<AllGather> ag;
  bool connected = false;
  std::unique_ptr<DeviceClaim> claim;  // released after the destructor synchronized and freed
};

HierAllGather::HierAllGather(uint64_t max_bytes, int world, int rank, int device, const std::vector<int>& node_of_rank,
                             HierAllGatherOptions options)
    : impl_(std::make_unique<Impl>()) {
  d::require_device(device, "HierAllGather");
  auto& m = *impl_;
  if (static_cast<int>(node_of_rank.size()) != world)
    throw Error(ErrorCode::kInvalidArgument, "HierAllGather: node_of_rank has " + std::to_string(node_of_rank.size()) +
                                                 " entries for a world of " + std::to_string(world));
  m.topo = Topology::from_node_ids(node_of_rank);
  if (rank < 0 || rank >= world) throw Error(ErrorCode::kInvalidArgument, "HierAllGather: rank out of range");
  if (options.timeout.count() <= 0) throw Error(ErrorCode::kInvalidArgument, "HierAllGather: timeout must be > 0");
  if (options.transport != "" && options.transport != "tcp" && options.transport != "rdma")
    throw Error(ErrorCode::kInvalidArgument, "HierAllGather: transport '" + options.transport +
                                                 "' (tcp, rdma or empty for automatic)");
  m.claim = std::make_unique<DeviceClaim>(device);
  m.world = world;
  m.rank = rank;
  m.device = device;
  m.max_bytes = max_bytes;
  m.opt = options;
  m.w = sluice::detail::hier_wiring(m.topo, rank, max_bytes);  // checks max_bytes
  m.sms = hier_sm_count(device);
  const int N = m.w.nodes, K = m.w.ranks_per_node;

  DeviceGuard g(device);
  if (N > 1) {
    void* p = nullptr;
    d::check(cudaHostAlloc(&p, m.w.rail.bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc (rail)");
    m.rail = static_cast<uint8_t*>(p);
    std::memset(m.rail, 0, m.w.rail.bytes);
    void* dp = nullptr;
    d::check(cudaHostGetDevicePointer(&dp, m.rail, 0), "cudaHostGetDevicePointer (rail)");
    m.rail_dev = static_cast<uint8_t*>(dp);
    sluice::detail::HierRailOptions ro;
    ro.transport = options.transport;
    ro.producers = ProducerKind::kCuda;
    ro.cuda_device = device;
    ro.workers = options.proxy_workers;
    ro.push_spin_ns = uint64_t(options.timeout.count()) * 1000000ull;
    m.net = std::make_unique<sluice::detail::HierRail>(m.w, m.rail, ro);
  }
  void* p = nullptr;
  d::check(cudaHostAlloc(&p, 64, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc (status)");
  m.status = static_cast<int*>(p);
  std::memset(m.status, 0, 64);
  d::check(cudaMalloc(&p, uint64_t(N) * max_bytes), "cudaMalloc (rail block)");
  m.mine = static_cast<uint8_t*>(p);
  if (K > 1) {
    d::check(cudaMalloc(&p, uint64_t(K) * N * max_bytes), "cudaMalloc (intra-node result)");
    m.scratch = static_cast<uint8_t*>(p);
    m.ag = std::make_unique<AllGather>(uint64_t(N) * max_bytes, 1, DType::kUInt8, K, m.w.local_rank, device);
    m.ag->set_timeout(options.timeout);  // a local peer gone must not hang this node
  }
  // Device tables: channel handles (filled by connect), peers, permutation, counters.
  const size_t np = m.w.peers.size();
  const size_t hbytes = sizeof(PortChannelDeviceHandle) * (np ? np : 1);
  const size_t total = 2 * hbytes + 4 * (np + 1) + 4 * m.w.out_slot.size() + 64;
  d::check(cudaMalloc(&p, total), "cudaMalloc (tables)");
  m.devmem = static_cast<uint8_t*>(p);
  d::check(cudaMemset(m.devmem, 0, total), "cudaMemset");
  uint8_t* at = m.devmem;
  m.dv.data = reinterpret_cast<PortChannelDeviceHandle*>(at);
  at += hbytes;
  m.dv.credit = reinterpret_cast<PortChannelDeviceHandle*>(at);
  at += hbytes;
  m.dv.calls = reinterpret_cast<uint32_t*>(at);
  m.dv.arrive = reinterpret_cast<uint32_t*>(at + 4);
  at += 64;
  std::vector<int> pn;
  for (auto& peer : m.w.peers) pn.push_back(peer.node);
  m.dv.peer_node = reinterpret_cast<int*>(at);
  if (np) d::check(cudaMemcpy(at, pn.data(), 4 * np, cudaMemcpyHostToDevice), "cudaMemcpy");
  at += 4 * (np + 1);
  m.dv.out_slot = reinterpret_cast<int*>(at);
  d::check(cudaMemcpy(at, m.w.out_slot.data(), 4 * m.w.out_slot.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  d::check(cudaHostGetDevicePointer(&p, m.status, 0), "cudaHostGetDevicePointer (status)");
  m.dv.status = static_cast<int*>(p);
  m.dv.npeers = static_cast<int>(np);
  m.dv.node = m.w.node;
  m.dv.nodes = N;
  m.dv.per_node = K;
  m.dv.spin_ns = uint64_t(options.timeout.count()) * 1000000ull;
  // Load the kernels now: a kernel's first launch waits for kernels already running on the
  // device, and ours run while others spin (docs/port-channel.md, lazy loading).
  cudaFuncAttributes attr;
  d::check(cudaFuncGetAttributes(&attr, credit_kernel), "loading credit_kernel");
  d::check(cudaFuncGetAttributes(&attr, stage_kernel), "loading stage_kernel");
  d::check(cudaFuncGetAttributes(&attr, exchange_kernel), "loading exchange_kernel");
  d::check(cudaFuncGetAttributes(&attr, collect_kernel), "loading collect_kernel");
  d::check(cudaFuncGetAttributes(&attr, permute_kernel), "loading permute_kernel");
  d::check(cudaDeviceSynchronize(), "HierAllGather setup");
}

HierAllGather::~HierAllGather() {
  if (!impl_) return;
  auto& m = *impl_;
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(m.device);
  cudaDeviceSynchronize();
  m.net.reset();  // stops the proxy and the engine before the rail is freed
  m.ag.reset();
  if (m.rail) cudaFreeHost(m.rail);
  if (m.status) cudaFreeHost(m.status);
  if (m.mine) cudaFree(m.mine);
  if (m.scratch) cudaFree(m.scratch);
  if (m.devmem) cudaFree(m.devmem);
  cudaSetDevice(prev);
}

std::string HierAllGather::handle() const {
  auto& m = *impl_;
  HierHandle h;
  h.world = m.world;
  h.rank = m.rank;
  h.node = m.w.node;
  h.local_rank = m.w.local_rank;
  h.max_bytes = m.max_bytes;
  h.rail_bytes = m.w.rail.bytes;
  if (m.net) h.engine_info = m.net->engine_info();
  if (m.ag) h.ag_handle = m.ag->handle();
  return h.encode();
}

void HierAllGather::connect(const std::vector<std::string>& handles) {
  auto& m = *impl_;
  if (m.connected) throw Error(ErrorCode::kInvalidArgument, "HierAllGather::connect: already connected");
  std::vector<HierHandle> hs = sluice::detail::check_hier_handles(handles, m.topo, m.rank, m.max_bytes);
  DeviceGuard g(m.device);
  if (m.ag) {
    std::vector<std::string> local(m.w.ranks_per_node);
    for (int j = 0; j < m.w.ranks_per_node; ++j) local[j] = hs[m.topo.rank_of(m.w.node, j)].ag_handle;
    m.ag->connect(local);
  }
  if (m.net) {
    m.net->connect(hs);
    std::vector<PortChannelDeviceHandle> dh, ch;
    for (const auto& c : m.net->data()) dh.push_back(c.device_handle());
    for (const auto& c : m.net->credit()) ch.push_back(c.device_handle());
    d::check(cudaMemcpy(m.dv.data, dh.data(), sizeof(PortChannelDeviceHandle) * dh.size(), cudaMemcpyHostToDevice),
             "cudaMemcpy (channel handles)");
    d::check(cudaMemcpy(m.dv.credit, ch.data(), sizeof(PortChannelDeviceHandle) * ch.size(), cudaMemcpyHostToDevice),
             "cudaMemcpy (channel handles)");
  }
  m.connected = true;
}

Status HierAllGather::status() const {
  auto& m = *impl_;
  const int code = __atomic_load_n(m.status, __ATOMIC_ACQUIRE);
  if (code != 0) {
    const int step = __atomic_load_n(m.status + 1, __ATOMIC_ACQUIRE);
    const int node = __atomic_load_n(m.status + 2, __ATOMIC_ACQUIRE);
    std::string why;
    ErrorCode ec = static_cast<ErrorCode>(code);
    for (size_t p = 0; m.net && p < m.net->data().size(); ++p) {
      if (m.w.peers[p].node != node) continue;
      Status a = m.net->data()[p].status(), b = m.net->credit()[p].status();
      const Status& bad = !a.ok() ? a : b;
      if (!bad.ok()) {
        why = ": " + bad.to_string();
        ec = bad.code;
      }
    }
    // A wait that timed out: what this rank's semaphores and proxy saw (the peer's report
    // says what it sent), enough to tell a signal never pushed from one lost on the way.
    if (code == int(ErrorCode::kTimeout) && why.empty() && m.net) why = " [" + m.net->counters() + "]";
    const int rail_rank = node >= 0 && node < m.w.nodes ? m.topo.rank_of(node, m.w.local_rank) : -1;
    return {ec, "HierAllGather rank " + std::to_string(m.rank) + ": " + step_name(step) +
                                              " (node " + std::to_string(node) + ", rank " + std::to_string(rail_rank) +
                                              ") " + (code == int(ErrorCode::kTimeout) ? "timed out" : "failed") + why};
  }
  if (m.ag && m.ag->timed_out())
    return {ErrorCode::kTimeout, "HierAllGather rank " + std::to_string(m.rank) +
                                     ": the intra-node AllGather timed out waiting for a local peer (node " +
                                     std::to_string(m.w.node) + ")"};
  if (m.net) {
    Status s = m.net->status();
    if (!s.ok()) return {s.code, "HierAllGather rank " + std::to_string(m.rank) + ": " + s.message};
  }
  return Status::Ok();
}

void HierAllGather::check() const {
  Status s = status();
  if (!s.ok()) throw Error(s);
}

void HierAllGather::all_gather_bytes(const void* in, void* out, uint64_t bytes, void* stream) {
  auto& m = *impl_;
  if (!m.connected) throw Error(ErrorCode::kInvalidArgument, "HierAllGather: call connect() first");
  if (bytes > m.max_bytes)
    throw Error(ErrorCode::kOutOfRange, "HierAllGather: " + std::to_string(bytes) + " bytes exceed the maximum of " +
                                            std::to_string(m.max_bytes));
  check();
  if (bytes == 0) return;
  auto s = static_cast<cudaStream_t>(stream);
  auto* i8 = static_cast<const uint8_t*>(in);
  auto* o8 = static_cast<uint8_t*>(out);
  const int N = m.w.nodes, K = m.w.ranks_per_node;
  if (N == 1 && K > 1) {  // one node: the plain LL AllGather, straight into out
    m.ag->all_gather_bytes(in, out, bytes, stream);
    return;
  }
  const uint64_t grid_lines = (uint64_t(N) * bytes + 16 * kHierThreads - 1) / (16 * kHierThreads);
  const unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>(grid_lines, 1, std::min(m.sms, 32)));
  if (N > 1) {
    credit_kernel<<<1, 32, 0, s>>>(m.dv);
    stage_kernel<<<blocks, kHierThreads, 0, s>>>(m.dv, i8, m.rail_dev, m.mine, bytes);
    exchange_kernel<<<1, 32, 0, s>>>(m.dv, bytes);
    collect_kernel<<<blocks, kHierThreads, 0, s>>>(m.dv, m.rail_dev, m.mine, bytes);
  } else {
    stage_kernel<<<blocks, kHierThreads, 0, s>>>(m.dv, i8, m.rail_dev, m.mine, bytes);
  }
  d::check(cudaGetLastError(), "HierAllGather kernel launch");
  const uint8_t* src = m.mine;
  if (K > 1) {
    m.ag->all_gather_bytes(m.mine, m.scratch, uint64_t(N) * bytes, stream);
    src = m.scratch;
  }
  const uint64_t out_lines = (uint64_t(N) * K * bytes + 16 * kHierThreads - 1) / (16 * kHierThreads);
  const unsigned pblocks = static_cast<unsigned>(std::clamp<uint64_t>(out_lines, 1, std::min(m.sms, 64)));
  permute_kernel<<<pblocks, kHierThreads, 0, s>>>(m.dv, src, o8, bytes);
  d::check(cudaGetLastError(), "HierAllGather kernel launch");
}

uint64_t HierAllGather::max_bytes() const { return impl_->max_bytes; }
int HierAllGather::world_size() const { return impl_->world; }
int HierAllGather::rank() const { return impl_->rank; }
int HierAllGather::nodes() const { return impl_->w.nodes; }
int HierAllGather::ranks_per_node() const { return impl_->w.ranks_per_node; }
std::string HierAllGather::transport() const {
  return impl_->connected && impl_->net ? impl_->net->transport() : std::string();
}

}  // namespace sluice::cuda

// C entry points for ctypes (python/sluice/hier_allgather.py).
extern "C" {

namespace capi = sluice::detail::capi;

// transport: "tcp", "rdma" or "" (automatic); timeout_ms > 0.
SLUICE_API void* sluice_hag_create(uint64_t max_bytes, int world, int rank, int device, const int* node_of_rank,
                                   const char* transport, int64_t timeout_ms, char* err, int errlen) {
  return capi::guarded<void*>(err, errlen, nullptr, [&] {
    sluice::cuda::HierAllGatherOptions o;
    o.transport = transport ? transport : "";
    o.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<int> nodes(node_of_rank, node_of_rank + (world > 0 ? world : 0));
    return new sluice::cuda::HierAllGather(max_bytes, world, rank, device, nodes, o);
  });
}

// Returns the handle's length (excluding the NUL), or -1; with out == nullptr only the length.
SLUICE_API int64_t sluice_hag_handle(void* h, char* out, int64_t outlen, char* err, int errlen) {
  return capi::guarded<int64_t>(err, errlen, -1, [&] {
    std::string s = static_cast<sluice::cuda::HierAllGather*>(h)->handle();
    if (out) {
      if (static_cast<int64_t>(s.size()) + 1 > outlen)
        throw sluice::Error(sluice::ErrorCode::kInvalidArgument, "buffer too small");
      std::memcpy(out, s.c_str(), s.size() + 1);
    }
    return static_cast<int64_t>(s.size());
  });
}

SLUICE_API int sluice_hag_connect(void* h, const char** handles, int n, char* err, int errlen) {
  return capi::guarded(err, errlen, -1, [&] {
    static_cast<sluice::cuda::HierAllGather*>(h)->connect(std::vector<std::string>(handles, handles + n));
    return 0;
  });
}

// 0, or the sluice::ErrorCode of the failure (message in err); -1 for anything else.
SLUICE_API int sluice_hag_run(void* h, const void* in, void* out, uint64_t bytes, void* stream, char* err, int errlen) {
  try {
    static_cast<sluice::cuda::HierAllGather*>(h)->all_gather_bytes(in, out, bytes, stream);
    return 0;
  } catch (const sluice::Error& e) {
    capi::put_message(e.what(), err, errlen);
    return static_cast<int>(e.code()) ? static_cast<int>(e.code()) : -1;
  } catch (const std::exception& e) {
    capi::put_message(e.what(), err, errlen);
    return -1;
  }
}

SLUICE_API int sluice_hag_status(void* h, char* err, int errlen) {
  sluice::Status s = static_cast<sluice::cuda::HierAllGather*>(h)->status();
  if (s.ok()) return 0;
  capi::put_message(s.to_string().c_str(), err, errlen);
  return static_cast<int>(s.code);
}

SLUICE_API const char* sluice_hag_transport(void* h) {
  thread_local std::string t;
  t = static_cast<sluice::cuda::HierAllGather*>(h)->transport();
  return t.c_str();
}

SLUICE_API void sluice_hag_destroy(void* h) { delete static_cast<sluice::cuda::HierAllGather*>(h); }

}  // extern "C"
