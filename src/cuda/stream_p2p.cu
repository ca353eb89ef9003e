// Stream-ordered point-to-point messages: see include/sluice/stream_p2p.hpp.
//
// Each rank allocates one buffer (cudaMalloc, shared with a cudaIpc handle): a 4 KiB header (the
// object's failure word) and one region per peer. Region of rank A for peer B (B writes into it):
//   [lane control: lanes x 512 B][slots: lanes x slots x slot_bytes]
// Lane control (byte offsets), each written by one side only:
//   0   ready   B's sends published on this lane (a count; B writes)
//   128 freed   A's sends to B that B has copied out on this lane (B writes)
//   256 sent    A's own count of pieces sent to B on this lane (A's kernels)
//   264 got     A's own count of pieces received from B on this lane (A's kernels)
//   320 broken  nonzero once B's kernels failed (B writes)
//   384 sizes   per slot, the size of the message the piece belongs to (B writes)
//   448 tags    per slot, its tag (B writes)
// The counts live in device memory so that a captured graph replays correctly: a kernel reads
// them when it starts and writes them back when it ends, and the next kernel of the same peer
// and direction is ordered after it (the contract in the header).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "core/params.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/device_sync.cuh"
#include "sluice/stream_p2p.hpp"

namespace sluice::cuda {
namespace {

namespace d = sluice::detail::cuda;
using namespace sluice::cuda::dev;

constexpr int kP2pThreads = 512;
constexpr int kMaxLanes = 64;
constexpr int kMaxSlots = 8;
constexpr int kMaxPeers = 63;
constexpr uint64_t kLaneCtl = 512;
constexpr uint64_t kReady = 0, kFreed = 128, kSent = 256, kGot = 264, kBroken = 320, kSizes = 384, kTags = 448;
// The smallest piece a message is cut into: below it, fewer lanes carry the message. Measured on
// 2xH200 (2026-11-29): 64 KiB pieces moved 2 MiB in 14.6 us against 20.1 with 16 KiB ones.
constexpr uint64_t kMinPiece = 64 << 10;
// The buffer's header (before the regions): this object's failure word, which its kernels read
// when they start (a read of the mapped host word there cost 30 us at 512 KiB on 2xH200: 32
// blocks reading host memory over PCIe).
constexpr uint64_t kP2pHeader = 4096;
constexpr uint64_t kPiecesPerLane = 4;

// What a kernel that gives up leaves in the mapped host word (the first one wins).
enum Fail : int { kNone = 0, kTimedOut = 1, kAborted = 2, kMismatch = 3, kPeerFailed = 4 };
// Mapped host memory: the failure code, then (for kMismatch) what was expected and found.
struct ErrWord {
  int code;
  int lane;
  uint64_t want_bytes, got_bytes, want_tag, got_tag;
};

struct Ring {
  uint8_t* mine;    // our region for the peer
  uint8_t* theirs;  // the peer's region for us, mapped here
  int lanes, slots;
  uint64_t slot_bytes;
};
struct Msg {
  uint64_t bytes, piece, tag, bound_ns;
  ErrWord* err;
  uint32_t* failed;  // this object's failure word in its own device memory (the buffer's header)
};

__device__ __forceinline__ uint64_t* ctl64(uint8_t* region, int lane, uint64_t off) {
  return reinterpret_cast<uint64_t*>(region + uint64_t(lane) * kLaneCtl + off);
}

// Sets the failure code unless one is set (the details written before it are visible first),
// and this object's device word, which its later kernels read when they start. The host word
// is mapped host memory over PCIe: not atomic against other writers, so "first" is best effort.
__device__ void fail(const Msg& m, int code) {
  __threadfence_system();
  atomicCAS_system(&m.err->code, 0, code);
  atomicExch(m.failed, 1u);
  __threadfence_system();
}

// Thread 0 of a block, after giving up: every lane of the peer learns that this pair is broken.
__device__ void tell_peer(const Ring& r) {
  for (int l = 0; l < r.lanes; ++l) *reinterpret_cast<volatile uint64_t*>(ctl64(r.theirs, l, kBroken)) = 1;
  __threadfence_system();
}

struct Spin {
  uint64_t t0 = 0;
  uint32_t n = 0;
};

// Called by a spinning thread 0: true when it must give up (this object failed, the peer did,
// or the bound ran out). Checked every 1024 spins: the failure word is in host memory.
__device__ bool give_up(const Msg& m, const Ring& r, int lane, Spin& s) {
  if ((++s.n & 1023) != 0) return false;
  if (*reinterpret_cast<volatile int*>(&m.err->code) != kNone) return true;
  if (*reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kBroken)) != 0) {
    fail(m, kPeerFailed);
    return true;
  }
  if (m.bound_ns == 0) return false;
  const uint64_t now = global_ns();
  if (s.t0 == 0) {
    s.t0 = now;
    return false;
  }
  if (now - s.t0 <= m.bound_ns) return false;
  fail(m, kTimedOut);
  return true;
}

// Thread 0 decides for its block whether the kernel runs at all: not once this object failed
// or the peer said it did (later kernels then return at once instead of waiting out a bound).
__device__ __forceinline__ bool started(const Msg& m, const Ring& r, int* go) {
  if (threadIdx.x == 0) {
    *go = *reinterpret_cast<volatile uint32_t*>(m.failed) == 0;
    if (*go && *reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, blockIdx.x, kBroken)) != 0) {
      fail(m, kPeerFailed);
      *go = 0;
    }
    if (!*go) tell_peer(r);
  }
  __syncthreads();
  return *go;
}

__global__ void __launch_bounds__(kP2pThreads) send_kernel(Ring r, Msg m, const uint8_t* __restrict__ in) {
  __shared__ int go;
  if (!started(m, r, &go)) return;
  const int lane = blockIdx.x;
  uint8_t* slots = r.theirs + uint64_t(r.lanes) * kLaneCtl + uint64_t(lane) * r.slots * r.slot_bytes;
  uint64_t sent = *reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kSent));
  const uint64_t pieces = (m.bytes + m.piece - 1) / m.piece;
  Spin sp;
  for (uint64_t i = lane; i < pieces; i += gridDim.x) {
    if (threadIdx.x == 0) {
      // Wait for a free slot: at most `slots` pieces ahead of what the peer copied out.
      while (sent - ld_acquire64(ctl64(r.mine, lane, kFreed)) >= uint64_t(r.slots))
        if (give_up(m, r, lane, sp)) {
          go = 0;
          break;
        }
    }
    __syncthreads();
    if (!go) break;
    const uint64_t slot = sent % r.slots, off = i * m.piece, n = min(m.piece, m.bytes - off);
    block_copy(slots + slot * r.slot_bytes, in + off, n, false);
    __syncthreads();
    if (threadIdx.x == 0) {
      reinterpret_cast<volatile uint64_t*>(ctl64(r.theirs, lane, kSizes))[slot] = m.bytes;
      reinterpret_cast<volatile uint64_t*>(ctl64(r.theirs, lane, kTags))[slot] = m.tag;
      __threadfence_system();
      st_release64(ctl64(r.theirs, lane, kReady), sent + 1);
    }
    ++sent;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kSent)) = sent;
    if (!go) tell_peer(r);
  }
}

__global__ void __launch_bounds__(kP2pThreads) recv_kernel(Ring r, Msg m, uint8_t* __restrict__ out) {
  __shared__ int go;
  if (!started(m, r, &go)) return;
  const int lane = blockIdx.x;
  const uint8_t* slots = r.mine + uint64_t(r.lanes) * kLaneCtl + uint64_t(lane) * r.slots * r.slot_bytes;
  uint64_t got = *reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kGot));
  const uint64_t pieces = (m.bytes + m.piece - 1) / m.piece;
  Spin sp;
  for (uint64_t i = lane; i < pieces; i += gridDim.x) {
    const uint64_t slot = got % r.slots;
    if (threadIdx.x == 0) {
      while (ld_acquire64(ctl64(r.mine, lane, kReady)) <= got)
        if (give_up(m, r, lane, sp)) {
          go = 0;
          break;
        }
      if (go) {
        const uint64_t sz = reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kSizes))[slot];
        const uint64_t tg = reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kTags))[slot];
        if (sz != m.bytes || tg != m.tag) {
          // Another message than the one this recv was queued for: deliver nothing of it.
          if (atomicCAS_system(&m.err->lane, 0, lane + 1) == 0) {
            m.err->want_bytes = m.bytes;
            m.err->got_bytes = sz;
            m.err->want_tag = m.tag;
            m.err->got_tag = tg;
          }
          fail(m, kMismatch);
          go = 0;
        }
      }
    }
    __syncthreads();
    if (!go) break;
    const uint64_t off = i * m.piece, n = min(m.piece, m.bytes - off);
    // L2 loads: the slot's earlier contents may sit in this SM's L1.
    block_copy(out + off, slots + slot * r.slot_bytes, n, true);
    __syncthreads();
    if (threadIdx.x == 0) st_release64(ctl64(r.theirs, lane, kFreed), got + 1);
    ++got;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile uint64_t*>(ctl64(r.mine, lane, kGot)) = got;
    if (!go) tell_peer(r);
  }
}

// What handle() prints (hex).
struct P2pHandle {
  int pid, device, rank, lanes, slots, npeers;
  uint64_t slot_bytes, ptr, size;
  int peers[kMaxPeers];
  cudaIpcMemHandle_t ipc;
};


const sluice::detail::Param<int> kLanes{"cuda.p2p_lanes", "SLUICE_P2P_LANES", 32, sluice::detail::int_in(1, kMaxLanes),
                                        "stream-ordered send/recv: thread blocks (lanes) per message at most",
                                        sluice::detail::ParamScope::kProcess};
const sluice::detail::Param<int> kSlots{"cuda.p2p_slots", "SLUICE_P2P_SLOTS", 4, sluice::detail::int_in(2, kMaxSlots),
                                        "stream-ordered send/recv: ring slots per lane",
                                        sluice::detail::ParamScope::kProcess};
const sluice::detail::Param<uint64_t> kSlotBytes{
    "cuda.p2p_slot_bytes", "SLUICE_P2P_SLOT_BYTES", 256 << 10, sluice::detail::size_in(4 << 10, 64 << 20),
    "stream-ordered send/recv: bytes per ring slot (a multiple of 4 KiB)", sluice::detail::ParamScope::kProcess};

uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace

struct StreamP2p::Impl {
  int rank = 0, device = 0, lanes = 0, slots = 0;
  uint64_t slot_bytes = 0, region = 0;
  std::vector<int> peers;
  uint8_t* buf = nullptr;
  std::map<int, uint8_t*> theirs;  // peer -> its region for us, mapped here
  std::vector<void*> opened;
  uint64_t bound_ns = 0;
  ErrWord* err = nullptr;  // mapped host memory
  ErrWord* err_dev = nullptr;
  mutable std::mutex mu;

  int index_of(int peer) const {
    auto it = std::find(peers.begin(), peers.end(), peer);
    return it == peers.end() ? -1 : int(it - peers.begin());
  }
  Ring ring(int peer, const char* what) const {
    const int i = index_of(peer);
    if (i < 0)
      throw Error(ErrorCode::kInvalidArgument, std::string("StreamP2p::") + what + ": rank " + std::to_string(peer) +
                                                   " is not one of this object's peers");
    auto it = theirs.find(peer);
    if (it == theirs.end())
      throw Error(ErrorCode::kInvalidArgument, std::string("StreamP2p::") + what + ": rank " + std::to_string(peer) +
                                                   " is not connected (connect() first)");
    return Ring{buf + kP2pHeader + uint64_t(i) * region, it->second, lanes, slots, slot_bytes};
  }
  // Pieces of about bytes / (lanes x kPiecesPerLane): each lane then has a few pieces in
  // flight, so that its receiver copies one out while its sender stores the next (one piece
  // per lane would serialise the two); at least kMinPiece, at most a slot.
  Msg msg(uint64_t bytes, uint32_t tag) const {
    const uint64_t per = uint64_t(lanes) * kPiecesPerLane;
    uint64_t piece = round_up((bytes + per - 1) / per, 16);
    piece = std::min(slot_bytes, std::max(piece, kMinPiece));
    return Msg{bytes, piece, tag, bound_ns, err_dev, reinterpret_cast<uint32_t*>(buf)};
  }
};

StreamP2p::StreamP2p(int rank, const std::vector<int>& peers, int device, StreamP2pOptions o)
    : impl_(std::make_unique<Impl>()) {
  d::require_device(device, "StreamP2p");
  if (o.lanes <= 0) o.lanes = kLanes.read();
  if (o.slots <= 0) o.slots = kSlots.read();
  if (o.slot_bytes == 0) o.slot_bytes = kSlotBytes.read();
  if (o.lanes > kMaxLanes || o.slots < 2 || o.slots > kMaxSlots || o.slot_bytes % 4096 != 0)
    throw Error(ErrorCode::kInvalidArgument, "StreamP2p: lanes must be 1.." + std::to_string(kMaxLanes) +
                                                 ", slots 2.." + std::to_string(kMaxSlots) +
                                                 " and slot_bytes a nonzero multiple of 4096");
  if (peers.empty() || peers.size() > size_t(kMaxPeers))
    throw Error(ErrorCode::kInvalidArgument, "StreamP2p: 1.." + std::to_string(kMaxPeers) + " peers");
  for (size_t i = 0; i < peers.size(); ++i)
    if (peers[i] < 0 || peers[i] == rank || std::count(peers.begin(), peers.end(), peers[i]) != 1)
      throw Error(ErrorCode::kInvalidArgument, "StreamP2p: peers must be distinct ranks other than this one");
  auto& m = *impl_;
  m.rank = rank;
  m.device = device;
  m.lanes = o.lanes;
  m.slots = o.slots;
  m.slot_bytes = o.slot_bytes;
  m.peers = peers;
  m.region = round_up(uint64_t(m.lanes) * kLaneCtl + uint64_t(m.lanes) * m.slots * m.slot_bytes, 4096);
  const uint64_t total = kP2pHeader + m.region * peers.size();
  int prev = 0;
  cudaGetDevice(&prev);
  d::check(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, total);
  if (e == cudaSuccess) e = cudaMemset(p, 0, total);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  void* h = nullptr;
  if (e == cudaSuccess) e = cudaHostAlloc(&h, sizeof(ErrWord), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) {
    m.err = static_cast<ErrWord*>(h);
    std::memset(m.err, 0, sizeof(ErrWord));
    e = cudaHostGetDevicePointer(&h, m.err, 0);
    m.err_dev = static_cast<ErrWord*>(h);
  }
  // Both kernels loaded now: a kernel's first launch would wait for the device's running ones.
  cudaFuncAttributes attr;
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, send_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, recv_kernel);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    if (p) cudaFree(p);
    if (m.err) cudaFreeHost(m.err);
    m.err = nullptr;
    d::check(e, "StreamP2p: allocating its regions");
  }
  m.buf = static_cast<uint8_t*>(p);
  d::register_shared_buffer(p, total, device);
}

StreamP2p::~StreamP2p() {
  if (!impl_) return;
  auto& m = *impl_;
  d::release_shared_buffer(m.device, m.opened, m.buf, m.err);
}

std::string StreamP2p::handle() const {
  auto& m = *impl_;
  P2pHandle h{};
  h.pid = ::getpid();
  h.device = m.device;
  h.rank = m.rank;
  h.lanes = m.lanes;
  h.slots = m.slots;
  h.slot_bytes = m.slot_bytes;
  h.ptr = reinterpret_cast<uint64_t>(m.buf);
  h.size = kP2pHeader + m.region * m.peers.size();
  h.npeers = int(m.peers.size());
  for (size_t i = 0; i < m.peers.size(); ++i) h.peers[i] = m.peers[i];
  d::check(cudaIpcGetMemHandle(&h.ipc, m.buf), "cudaIpcGetMemHandle");
  return d::hex(&h, sizeof(h));
}

void StreamP2p::connect(int peer, const std::string& text) {
  auto& m = *impl_;
  std::lock_guard<std::mutex> lk(m.mu);
  const std::string who = "StreamP2p::connect: rank " + std::to_string(peer);
  if (m.index_of(peer) < 0) throw Error(ErrorCode::kInvalidArgument, who + " is not one of this object's peers");
  if (m.theirs.count(peer)) return;
  P2pHandle h{};
  if (!d::unhex(text, &h, sizeof(h))) throw Error(ErrorCode::kInvalidArgument, who + ": malformed handle");
  if (h.rank != peer) throw Error(ErrorCode::kInvalidArgument, who + ": the handle is rank " + std::to_string(h.rank) + "'s");
  if (h.lanes != m.lanes || h.slots != m.slots || h.slot_bytes != m.slot_bytes)
    throw Error(ErrorCode::kInvalidArgument,
                who + " uses other settings (lanes, slots, slot bytes: " + std::to_string(h.lanes) + ", " +
                    std::to_string(h.slots) + ", " + std::to_string(h.slot_bytes) + "; here " +
                    std::to_string(m.lanes) + ", " + std::to_string(m.slots) + ", " + std::to_string(m.slot_bytes) +
                    "): set SLUICE_P2P_LANES, SLUICE_P2P_SLOTS and SLUICE_P2P_SLOT_BYTES alike on every rank");
  if (h.npeers < 1 || h.npeers > kMaxPeers || h.size != kP2pHeader + m.region * uint64_t(h.npeers))
    throw Error(ErrorCode::kProtocol, who + ": inconsistent handle");
  int k = -1;
  for (int i = 0; i < h.npeers; ++i)
    if (h.peers[i] == m.rank) k = i;
  if (k < 0) throw Error(ErrorCode::kInvalidArgument, who + " does not list rank " + std::to_string(m.rank) + " as a peer");
  uint8_t* base = d::map_shared_buffer(h.pid, h.ptr, h.size, h.device, h.ipc, m.device, &m.opened, who);
  m.theirs[peer] = base + kP2pHeader + uint64_t(k) * m.region;
}

bool StreamP2p::connected(int peer) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->theirs.count(peer) != 0;
}

void StreamP2p::send(int peer, const void* in, uint64_t bytes, void* stream, uint32_t tag) {
  launch(true, peer, const_cast<void*>(in), bytes, stream, tag);
}

void StreamP2p::recv(int peer, void* out, uint64_t bytes, void* stream, uint32_t tag) {
  launch(false, peer, out, bytes, stream, tag);
}

void StreamP2p::launch(bool send, int peer, void* data, uint64_t bytes, void* stream, uint32_t tag) {
  auto& m = *impl_;
  Status st = status();
  if (!st.ok()) throw Error(st);
  Ring r;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    r = m.ring(peer, send ? "send" : "recv");
  }
  if (bytes == 0) return;
  const Msg g = m.msg(bytes, tag);
  const unsigned grid = unsigned(std::min<uint64_t>(m.lanes, (bytes + g.piece - 1) / g.piece));
  auto s = static_cast<cudaStream_t>(stream);
  auto* p = static_cast<uint8_t*>(data);
  if (send) send_kernel<<<grid, kP2pThreads, 0, s>>>(r, g, p);
  else recv_kernel<<<grid, kP2pThreads, 0, s>>>(r, g, p);
  d::check(cudaGetLastError(), send ? "StreamP2p: launching a send" : "StreamP2p: launching a recv");
}

void StreamP2p::set_timeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) throw Error(ErrorCode::kInvalidArgument, "StreamP2p::set_timeout: negative timeout");
  impl_->bound_ns = uint64_t(timeout.count()) * 1000000ull;
}

void StreamP2p::abort() { __atomic_store_n(&impl_->err->code, int(kAborted), __ATOMIC_RELEASE); }

Status StreamP2p::status() const {
  const ErrWord* e = impl_->err;
  switch (__atomic_load_n(&e->code, __ATOMIC_ACQUIRE)) {
    case kNone: return {};
    case kTimedOut:
      return {ErrorCode::kTimeout, "StreamP2p: a send or recv waited for its peer longer than the timeout"};
    case kAborted: return {ErrorCode::kCancelled, "StreamP2p: aborted"};
    case kMismatch:
      return {ErrorCode::kProtocol, "StreamP2p: a recv of " + std::to_string(e->want_bytes) + " bytes (tag " +
                                        std::to_string(e->want_tag) + ") met a message of " +
                                        std::to_string(e->got_bytes) + " bytes (tag " + std::to_string(e->got_tag) +
                                        "): the two ranks queued different messages"};
    case kPeerFailed: return {ErrorCode::kRemoteError, "StreamP2p: the peer's side failed or was aborted"};
    default: return {ErrorCode::kInternal, "StreamP2p: unknown failure code"};
  }
}

void StreamP2p::quiesce() {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(impl_->device);
  cudaDeviceSynchronize();
  cudaSetDevice(prev);
}

uint64_t StreamP2p::region_bytes() const { return impl_->region; }
int StreamP2p::rank() const { return impl_->rank; }

}  // namespace sluice::cuda
