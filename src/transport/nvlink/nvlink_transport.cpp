// nvlink: peers on the same host with CUDA memory. The peer proves itself first, as in shm
// (transport/common/same_host.hpp): each engine serves an abstract Unix socket, the kernel
// names the process at the other end (SO_PEERCRED) and descriptors travel as SCM_RIGHTS.
// Nothing the info blob says about the peer's memory is used: each peer region is described
// by its owner over that socket on first use ("describe": its address, length, lease slot,
// and for cuda memory its cudaIpc handle or, for cuMem allocations, the POSIX-fd export as a
// passed descriptor; for memfd host memory the memfd), then mapped once. Offsets are checked
// against the described region at every use. Bytes move with cudaMemcpyAsync on dedicated
// streams (the copy engine; an SM copy kernel for pieces up to SLUICE_NVLINK_SM_COPY_MAX, off
// by default: slower here). The pieces the core cut for stream transports are merged back
// into one copy per contiguous range. CUDA events signal completion: small ops are polled on
// the submitting thread, the rest by a poller thread. The peer's host memory is mapped
// (memfd) or read with process_vm_readv from the proven pid; writes into it that are not
// through a mapping are PULL_WRITEs its owner executes (as in shm); a local cuda side stages
// through host memory. The authenticated socket is the control
// channel (imm values and send rendezvous); the listener's TCP channel only completes the
// endpoint. Two engines of one process are peers too (the kernel then names this process):
// the answering engine describes its regions by address and they are used directly.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/lease_table.hpp"
#include "core/log.hpp"
#include "core/params.hpp"
#include "cuda/copy_kernels.hpp"
#include "cuda/cuda_util.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_endpoints.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/common/cma.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

namespace cu = sluice::detail::cuda;

const Param<uint64_t> kSmCopyMax{"nvlink.sm_copy_max", "SLUICE_NVLINK_SM_COPY_MAX", 0, size_in(0, 1ull << 40),
                                  "copies up to this size from local GPU memory use an SM kernel, not the copy engine; 0 = off"};
const Param<int> kStreams{"nvlink.streams", "SLUICE_NVLINK_STREAMS", 1, int_in(1, 16),
                          "copy streams per endpoint; copies of at least nvlink.split_min are split over them"};
const Param<uint64_t> kSplitMin{"nvlink.split_min", "SLUICE_NVLINK_SPLIT_MIN", 8ull << 20, size_in(1, 1ull << 40),
                                "copies at least this large are split over nvlink.streams streams"};
const Param<uint64_t> kInlineMax{"nvlink.inline_max", "SLUICE_NVLINK_INLINE_MAX", 64ull << 10, size_in(0, 1ull << 30),
                                 "ops up to this size are polled to completion on the submitting thread (no hand-off)"};
const Param<bool> kDisable{"nvlink.disable", "SLUICE_NVLINK_DISABLE", false, boolean(),
                           "do not start the nvlink transport"};

struct OpTrack {
  std::atomic<int> lanes_left{0};
  std::atomic<bool> failed{false};
};

struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// Leases on the peer regions an op touches (see core/lease_table.hpp): the peer cannot finish
// unregistering one while our copies may still reach it.
struct LeaseHold {
  PeerLeases* leases = nullptr;
  std::vector<uint32_t> slots;
  std::vector<uint64_t> ids;
  ~LeaseHold() {
    for (uint32_t s : slots) leases->leave(s);
  }
  // After a read: the bytes count only if the owner withdrew none of the regions meanwhile (it
  // may have stopped waiting for us and reused the memory).
  Status still() const {
    for (size_t i = 0; i < slots.size(); ++i)
      if (!leases->still(slots[i], ids[i]))
        return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(ids[i]) +
                                               " was unregistered during the copy; the copy is discarded"};
    return Status::Ok();
  }
};

struct PullState;

// One submitted op: the events of the streams its copies went on; when every event has
// fired (and the owner answered every PULL_WRITE of it), each of its `lanes` non-empty lanes
// completes.
struct Inflight {
  std::shared_ptr<TransferOp> op;
  uint64_t token = 0;
  std::shared_ptr<OpTrack> track;
  std::vector<cudaEvent_t> events;
  int device = 0;
  int lanes = 0;
  std::shared_ptr<LeaseHold> leases;  // released when the op's copies are done
  std::shared_ptr<PullState> pull;    // the op's writes the owner executes, if any
};

// Writes into a peer's host memory that is not a mapped memfd are PULL_WRITEs, as in shm: the
// owner copies the bytes out of this process into its own region (process_vm_readv), so no
// late write of ours can land in memory the owner already reused. The op completes once its
// own copies are done and every frame was answered, whichever comes last.
struct PullState {
  std::mutex mu;
  int frames_left = 0;
  bool own_done = false;
  Status st;
  std::optional<Inflight> parked;  // the op, once its own copies are done, until the last answer
  std::vector<std::shared_ptr<std::vector<uint8_t>>> staged;  // host copies of cuda sources
};

const RegionEntry* pin_of(const TransferOp& op, const uint8_t* p) {
  for (const auto& pin : op.pins) {
    const RegionEntry* e = pin.get();
    if (p >= e->base && p < e->base + e->length) return e;
  }
  return nullptr;
}

// A copy after merging the op's pieces.
struct Seg {
  uint8_t* local;
  uint64_t remote_id;
  uint64_t remote_offset;
  uint64_t length;
};

// A peer region as its owner described it over the authenticated socket, and where its bytes
// are as seen from this process.
struct RemoteView {
  uint8_t* ptr = nullptr;  // byte 0 as addressable here (cuda regions, mapped memfd host regions)
  bool host = false;       // a host region: mapped (ptr) or else moved with CMA at `addr`
  uint64_t addr = 0;       // the owner's virtual address of byte 0
  uint64_t length = 0;     // every offset is checked against this
  uint32_t slot = kNoLease;
  std::shared_ptr<void> keep;  // the import or mapping `ptr` points into
};

// A peer's engine-allocated (memfd) host region mapped here, as shm does.
struct HostMapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  ~HostMapping() {
    if (base) ::munmap(base, length);
  }
};

// One of the peer's cuda allocations mapped here, and the regions that use it: the mapping is
// reused for a new region only while one of them is still registered (else the owner may have
// freed the allocation and made a new one at the same address).
struct ImportRec {
  std::shared_ptr<cu::Import> imp;
  std::vector<std::pair<uint32_t, uint64_t>> users;  // (lease slot, region id)
};

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

// What endpoints need from their transport (it outlives them).
class NvlinkHost {
 public:
  virtual ~NvlinkHost() = default;
  virtual const Registry& registry() const = 0;
  virtual const std::string& engine_id() const = 0;
  virtual int lease_fd() const = 0;
  virtual void forget(uint64_t token) = 0;
};

class NvlinkEndpoint final : public TransportEndpoint, public StreamChannel::Handler, public same_host::ProvenEndpoint {
 public:
  NvlinkEndpoint(const EndpointSetup& s, NvlinkHost& host, std::string peer_socket)
      : host_(host), events_(s.events), active_(s.active), token_(s.token), peer_socket_(std::move(peer_socket)),
        peer_engine_(s.peer.engine_id), timeout_(s.config.connect_timeout) {
    sm_copy_max_ = kSmCopyMax.get(s.config);
    nstreams_ = kStreams.get(s.config);
    split_min_ = kSplitMin.get(s.config);
    inline_max_ = kInlineMax.get(s.config);
    // Where the engine lets waiters poll (spare cores), let them poll for about as long as
    // the copy should take, as cudaStreamSynchronize does: a sleeping waiter wakes late.
    int us = s.config.busy_wait_us;
    if (us < 0) us = std::thread::hardware_concurrency() > 2 ? 20 : 0;
    poll_waiters_ = us > 0;
    poller_ = std::thread([this] { poll(); });
  }
  ~NvlinkEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  void connect(const ChannelOpener& open) override {
    // Prove ourselves on the peer's same-host socket and learn from the kernel which process
    // answers; only then ask the listener to complete the endpoint.
    same_host::Proof proof = same_host::prove(peer_socket_, token_, host_.engine_id(), host_.lease_fd(), peer_engine_,
                                              same_host::Clock::now() + timeout_, "nvlink");
    FdGuard guard{proof.lease_fd};
    {
      std::lock_guard<std::mutex> lk(map_mu_);
      if (!leases_.map_fd(proof.lease_fd))
        throw Error(ErrorCode::kProtocol, "nvlink: the peer did not pass a lease table (a memfd) on its same-host socket");
    }
    proven(proof.cred.pid);
    install(std::move(proof.sock));
    open(0, nlohmann::json::object());
  }

  nlohmann::json attach(int index, const nlohmann::json&) override {
    // The listener's channel only completes the endpoint: the peer must already have proven
    // on our Unix socket that it is a process on this host (a remote peer never can).
    if (index != 0) throw Error(ErrorCode::kProtocol, "nvlink takes one channel");
    if (!authenticated_.load())
      throw Error(ErrorCode::kProtocol, "nvlink: the peer has not proven that it is a process on this host "
                                        "(no authenticated same-host socket for this endpoint)");
    return nlohmann::json::object();
  }
  // The listener's socket carried only the handshake; the same-host socket is the channel.
  bool adopt(int, net::Socket) override { return true; }

  // Called by the transport's socket service.
  bool active() const { return active_; }

  // Passive side: the process `cred` proved itself with this endpoint's token; its socket
  // becomes the control channel.
  // `sock` is taken only on success (else the service answers the refusal on it).
  void authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string& engine) override {
    FdGuard guard{lease_fd};
    if (active_ || authenticated_.load()) throw Error(ErrorCode::kProtocol, "nvlink: endpoint already authenticated");
    if (engine != peer_engine_)
      throw Error(ErrorCode::kProtocol, "nvlink: engine '" + engine + "' proved itself for the endpoint that engine '" +
                                            peer_engine_ + "' opened");
    {
      std::lock_guard<std::mutex> lk(map_mu_);
      if (lease_fd < 0 || !same_host::is_memfd(lease_fd, sizeof(LeaseSlot)) || !leases_.map_fd(lease_fd))
        throw Error(ErrorCode::kProtocol, "nvlink: no lease table (a memfd) came with the authentication");
    }
    // Proven, and the control channel running, before we answer: the peer opens the TCP
    // channel as soon as it reads the answer, and attach() (after which the application may
    // send) must find both. The peer sends nothing on the socket before it has the answer.
    proven(cred.pid);
    const int fd = sock.fd();
    install(std::move(sock));
    try {
      same_host::send(fd, {{"ok", true}, {"engine", host_.engine_id()}}, host_.lease_fd());
    } catch (const Error& e) {
      fail(e.status(), false);
    }
  }

  // Answers the authenticated peer's question about one of our regions (*fd_out: a descriptor
  // to pass with the answer, or -1).
  nlohmann::json describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const override {
    *fd_out = -1;
    if (!authenticated_.load() || cred.pid != pid_.load())
      throw Error(ErrorCode::kProtocol, "describe from a process that is not this endpoint's peer");
    Status st;
    // Pinned while we answer: the region's memory (and its memfd or cuda export) stays while
    // we describe it.
    RegionPin pin = host_.registry().pin(id, 0, 1, &st, "target");
    if (!pin) throw Error(st.code, st.message);
    const RegionEntry* e = pin.get();
    const auto addr = reinterpret_cast<uint64_t>(e->base);
    nlohmann::json d{{"addr", addr}, {"length", e->length}, {"slot", e->lease_slot}, {"host", e->location.is_host()}};
    if (e->location.is_host()) {
      if (e->memfd >= 0) *fd_out = ::fcntl(e->memfd, F_DUPFD_CLOEXEC, 0);
      return d;
    }
    if (e->location.kind != Location::Kind::kCuda)
      throw Error(ErrorCode::kUnsupported, "region " + std::to_string(id) + " is " + e->location.to_string() + " memory");
    if (cred.pid == ::getpid()) {
      // Another engine of this process: the address is valid there as it is here.
      d["export"] = {{"kind", "local"}, {"base", addr}, {"offset", 0}, {"base_size", e->length},
                     {"device", e->location.device}};
      return d;
    }
    d["export"] = cu::export_region(e->base, e->length, fd_out);
    return d;
  }

  void submit(std::shared_ptr<TransferOp> op) override {
    uint64_t token = pending_.add(op);
    if (!token) return;
    Inflight f;
    f.op = op;
    f.token = token;
    f.track = std::make_shared<OpTrack>();
    for (auto& l : op->lanes) f.lanes += l.pieces.empty() ? 0 : 1;
    f.track->lanes_left = f.lanes;
    f.leases = std::make_shared<LeaseHold>();
    f.leases->leases = &leases_;
    // The caller's stream travels with the op (the core admitted it: stream_ordered).
    auto* user = static_cast<cudaStream_t>(op->options.cuda_stream);
    Status st = failed_.load() ? Status{ErrorCode::kCancelled, "endpoint closed"} : Status::Ok();
    std::unordered_map<uint64_t, RemoteView> views;
    if (st.ok()) st = resolve(*op, &f.device, &views);
    if (st.ok()) st = hold_leases(views, *f.leases);
    if (st.ok()) st = enqueue(*op, user, &f, views);
    if (!st.ok() || f.events.empty()) {
      for (auto e : f.events) {
        cudaEventSynchronize(e);
        give_event(f.device, e);
      }
      f.events.clear();
      if (st.ok() && op->kind == OpKind::kRead) st = f.leases->still();
      settle(f, st);
      return;
    }
    // Small ops: wait here a moment, so that the caller's Future is already complete (no
    // thread hand-off on the latency path). Never with a user stream: its earlier work may
    // take any time.
    if (!user && op->bytes <= inline_max_) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
      while (std::chrono::steady_clock::now() < until) {
        if (events_done(f) != cudaErrorNotReady) break;
      }
      cudaError_t e = events_done(f);
      if (e != cudaErrorNotReady) {
        complete(f, e);
        return;
      }
    }
    if (poll_waiters_) {
      // ~300 GB/s over NVLink, plus the completion path; at most 2 ms.
      uint64_t us = std::min<uint64_t>(op->bytes / 300000 + 30, 2000);
      op->future->set_busy_wait(std::chrono::microseconds(us));
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      inflight_.push_back(std::move(f));
      has_work_.store(true, std::memory_order_release);
    }
    cv_.notify_one();
  }

  void send(std::shared_ptr<MessageOp> op) override {
    if (!pending_.add_send(op)) return;
    OutFrame f;
    f.hdr = make_frame(FrameType::kSendRts, op->seq, reinterpret_cast<uint64_t>(op->ptr), op->pin.get()->id, 0, 0,
                       static_cast<uint32_t>(op->length), static_cast<uint32_t>(op->length >> 32));
    control_->post(std::move(f));
  }

  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }
  // Per-operation deadlines (PendingOps::expire), an op past its own deadline spared while
  // work of ours keeps completing (as shm): frames the peer sends of its own accord keep
  // nothing alive.
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override {
    auto moving = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(moving_.load()));
    return pending_.expire(now, timeout, what, /*fail=*/false,
                           [&](const TransferOp*) { return now - moving < timeout; });
  }

  void close(const Status& why) override {
    fail(why, false);
    std::lock_guard<std::mutex> close_lk(close_mu_);  // a second closer waits for the first
    if (closed_) return;
    closed_ = true;
    if (control_) control_->join();
    if (poller_.joinable() && poller_.get_id() != std::this_thread::get_id()) poller_.join();
    {
      std::lock_guard<std::mutex> lk(res_mu_);
      for (auto& [key, s] : streams_) cudaStreamSynchronize(s);
      for (auto& [key, s] : streams_) cudaStreamDestroy(s);
      streams_.clear();
      for (auto& [dev, pool] : event_pool_)
        for (auto e : pool) cudaEventDestroy(e);
      event_pool_.clear();
    }
    {
      std::lock_guard<std::mutex> lk2(map_mu_);
      views_.clear();
      imports_.clear();
    }
    host_.forget(token_);
  }

  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override {
    pending_.touch();
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kImm:
        events_->matcher().push_imm(h.imm);
        return Status::Ok();
      case FrameType::kSendRts: return serve_rts(ch, h);
      case FrameType::kPullWrite: return serve_pull(ch, h, payload);
      case FrameType::kAck:
      case FrameType::kNack:
        moved();
        return take_pull_ack(h, payload);
      case FrameType::kSendAck:
        moved();
        return complete_send_ack(pending_, h, payload);
      case FrameType::kError: return peer_error(payload);
      default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on nvlink control"};
    }
  }

  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

 private:
  void proven(pid_t pid) {
    pid_ = pid;
    same_process_ = pid == ::getpid();
    authenticated_ = true;
  }

  void install(net::Socket sock) {
    control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
    control_->start();
    if (failed_.load()) control_->shutdown();
  }

  // The device that drives the op's copies: its first local cuda piece's, else the current one.
  int op_device(const TransferOp& op) {
    for (const Lane& lane : op.lanes)
      for (const Piece& p : lane.pieces) {
        int d = local_device(op, p.local);
        if (d >= 0) return d;
      }
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }

  // Every peer region the op touches, as its owner described it, with each piece checked
  // against it.
  Status resolve(const TransferOp& op, int* device, std::unordered_map<uint64_t, RemoteView>* out) {
    try {
      *device = op_device(op);
      for (const Lane& lane : op.lanes)
        for (const Piece& p : lane.pieces) {
          auto it = out->find(p.remote_id);
          if (it == out->end()) it = out->emplace(p.remote_id, view(p.remote_id, *device)).first;
          if (!in_bounds(p.remote_offset, p.length, it->second.length))
            return {ErrorCode::kOutOfRange, "peer region " + std::to_string(p.remote_id) + " is " +
                                                std::to_string(it->second.length) + " bytes (as its owner describes it); " +
                                                std::to_string(p.length) + " bytes at offset " +
                                                std::to_string(p.remote_offset) + " do not fit"};
        }
      return Status::Ok();
    } catch (const Error& e) {
      return e.status();
    }
  }

  Status hold_leases(const std::unordered_map<uint64_t, RemoteView>& views, LeaseHold& h) {
    for (const auto& [id, v] : views) {
      if (v.slot == kNoLease || !leases_.enter(v.slot, id)) {
        forget_region(id);
        return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + " is no longer registered"};
      }
      h.slots.push_back(v.slot);
      h.ids.push_back(id);
    }
    return Status::Ok();
  }

  // A region the owner withdrew: its description (and, unless another region still uses it,
  // its mapping) is dropped.
  void forget_region(uint64_t id) {
    std::lock_guard<std::mutex> lk(map_mu_);
    views_.erase(id);
  }

  // The peer's region `id` for copies driven by `device`, as its owner describes it (asked
  // over its same-host socket the first time: a local round trip bounded by the connect
  // timeout). Throws Error.
  RemoteView view(uint64_t id, int device) {
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
          rv.keep = m;
        }
      }
    } else {
      rv.ptr = map_cuda(id, r, fd, device, rv);
    }
    std::lock_guard<std::mutex> lk(map_mu_);
    return views_.emplace(id, std::move(rv)).first->second;
  }

  // Where the peer's cuda region described in `r` is addressable here. Throws Error.
  uint8_t* map_cuda(uint64_t id, const nlohmann::json& r, int fd, int device, RemoteView& rv) {
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
    if (kind == "local") {
      // Only another engine of this very process may describe memory by address.
      if (!same_process_.load())
        throw Error(ErrorCode::kProtocol, "nvlink: a peer in another process described " + what + " by address");
      auto dev = ex.find("device");
      if (dev != ex.end() && dev->is_number_integer()) {
        int owner = dev->get<int>();
        if (owner != device && owner >= 0 && owner < cu::device_count()) {
          // Peer access is enabled from the current device: make it the one that copies.
          int can = 0;
          cudaDeviceCanAccessPeer(&can, device, owner);
          if (can && (cudaSetDevice(device) != cudaSuccess || cudaDeviceEnablePeerAccess(owner, 0) != cudaSuccess))
            cudaGetLastError();
        }
      }
      return reinterpret_cast<uint8_t*>(base + offset);
    }
    std::lock_guard<std::mutex> lk(map_mu_);
    ImportRec& rec = imports_[base];
    bool live = false;
    for (auto& [slot, rid] : rec.users) live |= leases_.still(slot, rid);
    if (!rec.imp || !live) {
      rec = ImportRec{};
      rec.imp = cu::import_region(ex, fd, device);
    }
    if (rec.imp->size < base_size)
      throw Error(ErrorCode::kProtocol, "nvlink: " + what + " lies outside the peer's allocation as mapped");
    rec.users.emplace_back(rv.slot, id);
    rv.keep = rec.imp;
    return rec.imp->base + offset;
  }

  cudaStream_t stream(int device, size_t lane) {
    std::lock_guard<std::mutex> lk(res_mu_);
    auto& s = streams_[{device, lane}];
    if (!s) {
      cu::check(cudaSetDevice(device), "cudaSetDevice");
      cu::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    }
    return s;
  }

  cudaEvent_t take_event(int device) {
    std::lock_guard<std::mutex> lk(res_mu_);
    auto& pool = event_pool_[device];
    if (!pool.empty()) {
      auto e = pool.back();
      pool.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    cu::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }

  void give_event(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> lk(res_mu_);
    event_pool_[device].push_back(e);
  }

  // The device of local address p (from the op's pins), or -1 for host memory.
  static int local_device(const TransferOp& op, const uint8_t* p) {
    for (const auto& pin : op.pins) {
      const RegionEntry* e = pin.get();
      if (p >= e->base && p < e->base + e->length) return e->location.is_host() ? -1 : e->location.device;
    }
    return cu::pointer_device(p);
  }

  // Enqueue every copy of the op (its regions resolved and leased in `views`): pieces
  // contiguous on both sides are merged back into one copy (the core cut them for stream
  // transports), large copies are split over SLUICE_NVLINK_STREAMS streams. Appends one event
  // per stream used to f->events (none when everything completed synchronously).
  Status enqueue(const TransferOp& op, cudaStream_t user, Inflight* f,
                 const std::unordered_map<uint64_t, RemoteView>& views) {
    try {
      const bool write = op.kind != OpKind::kRead;
      std::vector<Seg> segs;
      for (const Lane& lane : op.lanes)
        for (const Piece& p : lane.pieces) segs.push_back({p.local, p.remote_id, p.remote_offset, p.length});
      if (op.lanes.size() > 1)
        std::sort(segs.begin(), segs.end(), [](const Seg& a, const Seg& b) {
          return a.remote_id != b.remote_id ? a.remote_id < b.remote_id : a.remote_offset < b.remote_offset;
        });
      std::vector<Seg> merged;
      for (const Seg& g : segs) {
        if (!merged.empty()) {
          Seg& m = merged.back();
          if (m.remote_id == g.remote_id && m.remote_offset + m.length == g.remote_offset && m.local + m.length == g.local) {
            m.length += g.length;
            continue;
          }
        }
        merged.push_back(g);
      }
      const int device = f->device;
      bool local_cuda = false;
      for (const Seg& g : merged) local_cuda |= local_device(op, g.local) >= 0;
      cu::check(cudaSetDevice(device), "cudaSetDevice");
      const int nstreams = user ? 1 : nstreams_;
      std::vector<bool> used(nstreams, false);
      auto stream_at = [&](int k) { return user ? user : stream(device, static_cast<size_t>(k)); };
      std::vector<cma::Span> spans;
      std::vector<same_host::PullPiece> pulls;
      std::vector<std::shared_ptr<std::vector<uint8_t>>> staged;
      const pid_t pid = pid_.load();
      int next = 0;
      for (const Seg& g : merged) {
        // resolve() checked every piece against the described region; merging keeps that.
        const RemoteView& rv = views.at(g.remote_id);
        if (rv.host && rv.ptr) {
          // The peer's memfd memory is mapped here: a plain memcpy, or a copy from / to the GPU.
          uint8_t* remote = rv.ptr + g.remote_offset;
          if (!local_cuda || local_device(op, g.local) < 0) {
            if (write) std::memcpy(remote, g.local, g.length);
            else std::memcpy(g.local, remote, g.length);
          } else {
            cudaStream_t s = stream_at(0);
            used[0] = true;
            cu::check(cudaMemcpyAsync(write ? remote : g.local, write ? g.local : remote, g.length, cudaMemcpyDefault, s),
                      "cudaMemcpyAsync");
          }
          continue;
        }
        if (rv.host) {
          const uint64_t at = rv.addr + g.remote_offset;  // the owner's address, as it described it
          const bool here_cuda = local_cuda && local_device(op, g.local) >= 0;
          if (write) {
            same_host::PullPiece pp{g.remote_id, g.remote_offset, g.length, reinterpret_cast<uint64_t>(g.local), 0, kNoLease, 0};
            if (here_cuda) {
              // The owner pulls a host copy of our cuda bytes, kept until it answered.
              cudaStream_t s = stream_at(0);
              auto tmp = std::make_shared<std::vector<uint8_t>>(g.length);
              cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
              cu::check(cudaMemcpy(tmp->data(), g.local, g.length, cudaMemcpyDefault), "cudaMemcpy");
              pp.src_addr = reinterpret_cast<uint64_t>(tmp->data());
              staged.push_back(std::move(tmp));
            } else if (const RegionEntry* e = pin_of(op, g.local)) {
              pp.src_region = e->id;  // the owner holds our lease on it while it copies
              pp.src_slot = e->lease_slot;
            }
            pulls.push_back(pp);
            continue;
          }
          if (!here_cuda) {
            spans.push_back({g.local, at, g.length});
            continue;
          }
          // Local GPU, remote host: stage through host memory.
          cudaStream_t s = stream_at(0);
          std::vector<uint8_t> tmp(g.length);
          Status st = cma::read(pid, {{tmp.data(), at, g.length}});
          if (!st.ok()) return st;
          if (st = f->leases->still(); !st.ok()) return st;
          cu::check(cudaMemcpyAsync(g.local, tmp.data(), g.length, cudaMemcpyDefault, s), "cudaMemcpyAsync");
          cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
          continue;
        }
        uint8_t* remote = rv.ptr + g.remote_offset;
        uint8_t* dst = write ? remote : g.local;
        const uint8_t* src = write ? g.local : remote;
        int parts = g.length >= split_min_ ? nstreams : 1;
        uint64_t step = (g.length / parts + 4095) / 4096 * 4096;
        for (uint64_t off = 0; off < g.length; off += step) {
          uint64_t n = std::min(step, g.length - off);
          int k = next++ % nstreams;
          cudaStream_t s = stream_at(k);
          used[k] = true;
          if (local_cuda && n <= sm_copy_max_)
            cu::check(cu::sm_copy(dst + off, src + off, n, s), "sm_copy");
          else
            cu::check(cudaMemcpyAsync(dst + off, src + off, n, cudaMemcpyDefault, s), "cudaMemcpyAsync");
        }
      }
      if (!spans.empty()) {  // reads only: writes into such memory are pulled by its owner
        Status st = cma::read(pid, spans);
        if (!st.ok()) return st;
      }
      for (int k = 0; k < nstreams; ++k) {
        if (!used[k]) continue;
        cudaEvent_t e = take_event(device);
        f->events.push_back(e);
        cu::check(cudaEventRecord(e, stream_at(k)), "cudaEventRecord");
      }
      if (!pulls.empty()) post_pulls(f, pulls, std::move(staged));
      return Status::Ok();
    } catch (const Error& e) {
      return e.status();
    }
  }

  // Last step of enqueue: the owner is asked to pull `pulls` (at most kMaxPullPieces a frame).
  void post_pulls(Inflight* f, const std::vector<same_host::PullPiece>& pulls,
                  std::vector<std::shared_ptr<std::vector<uint8_t>>> staged) {
    auto p = std::make_shared<PullState>();
    p->staged = std::move(staged);
    p->frames_left = static_cast<int>((pulls.size() + same_host::kMaxPullPieces - 1) / same_host::kMaxPullPieces);
    f->pull = p;
    {
      std::lock_guard<std::mutex> lk(pull_mu_);
      pulls_[f->token] = p;
    }
    for (size_t first = 0; first < pulls.size(); first += same_host::kMaxPullPieces) {
      auto buf = std::make_shared<std::vector<same_host::PullPiece>>(
          pulls.begin() + first, pulls.begin() + std::min(pulls.size(), first + same_host::kMaxPullPieces));
      OutFrame fr;
      fr.hdr = make_frame(FrameType::kPullWrite, f->token, 0, 0, buf->size() * sizeof(same_host::PullPiece));
      fr.data = reinterpret_cast<const uint8_t*>(buf->data());
      fr.keep = buf;
      control_->post(std::move(fr));
    }
  }

  // This side's copies of the op are done with `st`: complete it, unless the owner has yet to
  // answer PULL_WRITEs of it (then the last answer completes it).
  void settle(Inflight& f, Status st) {
    if (auto p = f.pull) {
      {
        std::lock_guard<std::mutex> lk(p->mu);
        p->own_done = true;
        if (p->st.ok() && !st.ok()) p->st = st;
        if (p->frames_left > 0) {
          f.pull.reset();  // no cycle through the parked op
          p->parked.emplace(std::move(f));
          return;
        }
        st = p->st;
      }
      std::lock_guard<std::mutex> lk(pull_mu_);
      pulls_.erase(f.token);
    }
    finish_all(f, st);
  }

  // The owner answered a PULL_WRITE frame.
  Status take_pull_ack(const FrameHeader& h, PayloadReader& payload) {
    Status st = frame_status(h, payload);
    if (h.type == static_cast<uint8_t>(FrameType::kNack) && st.ok()) st = {ErrorCode::kRemoteError, "peer refused the write"};
    std::shared_ptr<PullState> p;
    {
      std::lock_guard<std::mutex> lk(pull_mu_);
      auto it = pulls_.find(h.op_id);
      if (it != pulls_.end()) p = it->second;
    }
    if (!p) return {ErrorCode::kProtocol, "ack for an unknown operation"};
    std::optional<Inflight> done;
    {
      std::lock_guard<std::mutex> lk(p->mu);
      if (p->frames_left <= 0) return {ErrorCode::kProtocol, "more acks than PULL_WRITE frames"};
      if (p->st.ok() && !st.ok()) p->st = st;
      if (--p->frames_left > 0 || !p->own_done) return Status::Ok();
      done = std::move(p->parked);
      p->parked.reset();
      st = p->st;
    }
    {
      std::lock_guard<std::mutex> lk(pull_mu_);
      pulls_.erase(h.op_id);
    }
    if (done) finish_all(*done, st);
    return Status::Ok();
  }

  // The peer asks us to copy bytes of its process into our region(s): each must be a host
  // region of ours, the bytes are read from the proven peer process, and its source region
  // (if it named one) is held under its lease for the copy.
  Status serve_pull(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
    if (h.length % sizeof(same_host::PullPiece) != 0 || h.length == 0 || h.length / sizeof(same_host::PullPiece) > same_host::kMaxPullPieces)
      return {ErrorCode::kProtocol, "PULL_WRITE of " + std::to_string(h.length) + " bytes (pieces of 48 bytes, at most " +
                                        std::to_string(same_host::kMaxPullPieces) + ")"};
    std::vector<same_host::PullPiece> pieces(h.length / sizeof(same_host::PullPiece));
    if (!payload.read(pieces.data(), h.length)) return {ErrorCode::kPeerLost, "connection lost mid-frame"};
    Status st;
    std::vector<RegionPin> pins;
    std::vector<cma::Span> spans;
    LeaseHold held;
    held.leases = &leases_;
    for (const same_host::PullPiece& p : pieces) {
      RegionPin pin = events_->registry().pin(p.dst_region, p.dst_offset, p.length, &st, "target");
      if (!pin) break;
      if (!pin.get()->location.is_host()) {
        st = {ErrorCode::kUnsupported, "region " + std::to_string(p.dst_region) + " is " +
                                           pin.get()->location.to_string() + " memory, not written by PULL_WRITE"};
        break;
      }
      if (p.src_region != 0 && std::find(held.ids.begin(), held.ids.end(), p.src_region) == held.ids.end()) {
        if (p.src_slot == kNoLease || !leases_.enter(p.src_slot, p.src_region)) {
          st = {ErrorCode::kUnknownHandle, "your source region " + std::to_string(p.src_region) + " is no longer registered"};
          break;
        }
        held.slots.push_back(p.src_slot);
        held.ids.push_back(p.src_region);
      }
      spans.push_back({pin.get()->base + p.dst_offset, p.src_addr, p.length});
      pins.push_back(std::move(pin));
    }
    if (st.ok()) st = cma::read(pid_.load(), spans);
    if (st.ok()) st = held.still();
    pins.clear();
    post_status(ch, st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, 0, st);
    return Status::Ok();
  }

  // cudaSuccess when every event fired, cudaErrorNotReady, or the first error.
  static cudaError_t events_done(const Inflight& f) {
    for (auto e : f.events) {
      cudaError_t r = cudaEventQuery(e);
      if (r != cudaSuccess) return r;
    }
    return cudaSuccess;
  }

  void complete(Inflight& f, cudaError_t e) {
    Status st = Status::Ok();
    if (e != cudaSuccess) {
      cudaGetLastError();
      st = {ErrorCode::kInternal, std::string("nvlink copy failed: ") + cudaGetErrorString(e)};
    }
    for (auto ev : f.events) give_event(f.device, ev);
    f.events.clear();
    if (st.ok() && f.op->kind == OpKind::kRead) st = f.leases->still();
    settle(f, st);
  }

  void finish_all(Inflight& f, const Status& st) {
    for (int i = 0; i < std::max(f.lanes, 1); ++i) finish(f, st);
  }

  // A lane finished (or failed): imm after the last lane of a write_with_imm, then complete.
  void finish(Inflight& f, const Status& st) {
    pending_.touch();
    moved();
    if (!st.ok()) f.track->failed = true;
    if (f.track->lanes_left.fetch_sub(1) == 1 && f.op->kind == OpKind::kWriteImm && !f.track->failed && control_) {
      OutFrame fr;
      fr.hdr = make_frame(FrameType::kImm, f.token, 0, 0, 0, 0, f.op->imm);
      control_->post(std::move(fr));
    }
    pending_.lane_done(f.token, st);
  }

  void poll() {
    std::deque<Inflight> mine;
    auto idle_since = std::chrono::steady_clock::now();
    for (;;) {
      if (mine.empty() && !has_work_.load(std::memory_order_acquire)) {
        // Spin a little before sleeping: a new op is often right behind the last one.
        if (std::chrono::steady_clock::now() - idle_since < std::chrono::microseconds(200)) {
          if (stop_flag_.load(std::memory_order_acquire)) break;
          std::this_thread::yield();
          continue;
        }
      }
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (mine.empty()) cv_.wait(lk, [&] { return stop_ || !inflight_.empty(); });
        if (stop_) break;
        while (!inflight_.empty()) {
          mine.push_back(std::move(inflight_.front()));
          inflight_.pop_front();
        }
        has_work_.store(false, std::memory_order_release);
      }
      bool progressed = false;
      for (auto it = mine.begin(); it != mine.end();) {
        cudaError_t e = events_done(*it);
        if (e == cudaErrorNotReady) {
          ++it;
          continue;
        }
        complete(*it, e);
        it = mine.erase(it);
        progressed = true;
      }
      if (mine.empty()) idle_since = std::chrono::steady_clock::now();
      if (!progressed && !mine.empty()) std::this_thread::yield();
    }
    // Closing: wait for the copies so that no engine thread touches memory after close().
    for (auto& f : mine)
      for (auto e : f.events) {
        cudaEventSynchronize(e);
        give_event(f.device, e);
      }
  }


  // The peer sends us a message: copy it out of its region (h.offset: the region's id,
  // h.region: the message's address in the peer), which must lie inside that region as the
  // peer described it, under its lease.
  Status serve_rts(StreamChannel& ch, const FrameHeader& h) {
    uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
    auto claim = events_->matcher().claim(h.op_id, length);
    if (claim.error.code == ErrorCode::kProtocol) return claim.error;
    Status st = claim.error;
    if (claim.dest) {
      uint64_t n = std::min(length, claim.capacity);
      if (n) {
        try {
          int device = cu::pointer_device(claim.dest);
          const bool dest_cuda = device >= 0;
          if (device < 0) cudaGetDevice(&device);
          RemoteView rv = view(h.offset, device);
          if (h.region < rv.addr || !in_bounds(h.region - rv.addr, n, rv.length))
            throw Error(ErrorCode::kProtocol, "SEND_RTS names " + std::to_string(n) + " bytes outside the sender's region " +
                                                  std::to_string(h.offset));
          const uint64_t off = h.region - rv.addr;
          LeaseHold held;
          held.leases = &leases_;
          if (rv.slot == kNoLease || !leases_.enter(rv.slot, h.offset)) {
            forget_region(h.offset);
            throw Error(ErrorCode::kUnknownHandle, "the sender's region " + std::to_string(h.offset) + " is no longer registered");
          }
          held.slots.push_back(rv.slot);
          held.ids.push_back(h.offset);
          if (rv.ptr) {
            cu::check(cudaSetDevice(device), "cudaSetDevice");
            cu::check(cudaMemcpy(claim.dest, rv.ptr + off, n, cudaMemcpyDefault), "cudaMemcpy");
          } else if (!dest_cuda) {
            st = cma::read(pid_.load(), {{claim.dest, rv.addr + off, n}});
          } else {
            std::vector<uint8_t> tmp(n);
            st = cma::read(pid_.load(), {{tmp.data(), rv.addr + off, n}});
            if (st.ok()) st = held.still();
            if (st.ok()) cu::check(cudaMemcpy(claim.dest, tmp.data(), n, cudaMemcpyDefault), "cudaMemcpy");
          }
          if (st.ok()) st = held.still();
        } catch (const Error& e) {
          st = e.status();
        }
      }
    }
    st = events_->matcher().deliver(claim, st);
    post_status(ch, FrameType::kSendAck, h.op_id, 0, st);
    return Status::Ok();
  }

  void fail(const Status& why, bool notify) {
    if (failed_.exchange(true)) return;
    if (control_) control_->shutdown();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      stop_flag_.store(true);
      cv_.notify_all();
    }
    if (poller_.joinable() && poller_.get_id() != std::this_thread::get_id()) poller_.join();
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& f : inflight_)
        for (auto e : f.events) {
          cudaEventSynchronize(e);
          give_event(f.device, e);
        }
      inflight_.clear();
    }
    pending_.fail_all(why);
    {
      // Ops waiting for the owner's answers: failed above; their leases and copies go now.
      std::lock_guard<std::mutex> lk(pull_mu_);
      pulls_.clear();
    }
    if (notify) events_->on_failure(why);
  }

  NvlinkHost& host_;
  EndpointEvents* events_;
  const bool active_;
  const uint64_t token_;
  const std::string peer_socket_;
  const std::string peer_engine_;
  const std::chrono::milliseconds timeout_;
  // Set once the peer proved itself: the process the kernel named, never a pid a message claimed.
  std::atomic<pid_t> pid_{0};
  std::atomic<bool> same_process_{false};
  std::atomic<bool> authenticated_{false};
  uint64_t sm_copy_max_ = 0;
  int nstreams_ = 1;
  uint64_t split_min_ = 8ull << 20;
  uint64_t inline_max_ = 64ull << 10;
  bool poll_waiters_ = false;
  std::unique_ptr<StreamChannel> control_;
  PendingOps pending_;
  std::atomic<std::chrono::steady_clock::rep> moving_{0};  // when work of ours last completed
  void moved() { moving_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  PeerLeases leases_;  // declared before inflight_: destroyed after the ops holding leases
  std::deque<Inflight> inflight_;
  bool stop_ = false;
  std::atomic<bool> stop_flag_{false};
  std::atomic<bool> has_work_{false};
  std::thread poller_;

  std::mutex res_mu_;
  std::map<std::pair<int, size_t>, cudaStream_t> streams_;
  std::map<int, std::vector<cudaEvent_t>> event_pool_;

  std::mutex map_mu_;
  std::unordered_map<uint64_t, RemoteView> views_;   // peer region id -> its owner's description
  std::unordered_map<uint64_t, ImportRec> imports_;  // peer allocation base -> its mapping here

  std::mutex pull_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<PullState>> pulls_;  // op token -> its PULL_WRITEs

  std::mutex close_mu_;
  bool closed_ = false;
};

class NvlinkTransport final : public Transport, public NvlinkHost {
 public:
  explicit NvlinkTransport(const EngineContext& ctx) : host_id_(ctx.host_id), engine_id_(ctx.engine_id), registry_(ctx.registry) {
    endpoints_.start("sluice-nvl", engine_id_, nullptr);
  }
  ~NvlinkTransport() override { endpoints_.stop(); }

  std::string name() const override { return "nvlink"; }
  int priority() const override { return 30; }
  bool supports(const Location& loc) const override { return loc.is_host() || loc.kind == Location::Kind::kCuda; }
  // One-sided copies are enqueued on the op's cuda_stream when it has one (enqueue()); messages
  // go over the control socket and are not stream-ordered.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cuda_memory = true;
    c.stream_ordered = true;
    c.imm = true;
    return c;
  }
  // No pid, no handles, no addresses: a peer learns about our memory only after proving itself.
  nlohmann::json local_address() const override { return {{"socket", endpoints_.name()}, {"devices", cu::device_count()}}; }

  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    const auto& a = peer.transports.at("nvlink");
    auto devices = a.find("devices");
    if (devices == a.end() || !devices->is_number_integer() || devices->get<int64_t>() <= 0) {
      *why = "the peer has no CUDA device";
      return false;
    }
    std::string name = string_field(a, "socket");
    if (name.empty()) {
      *why = "the peer's nvlink address names no same-host socket";
      return false;
    }
    if (name == endpoints_.name()) {
      *why = "the peer's same-host socket is this engine's own";
      return false;
    }
    try {
      net::Socket s = same_host::connect(name);
      (void)same_host::peer_cred(s.fd());
      same_host::send(s.fd(), {{"op", "probe"}});
      nlohmann::json r = same_host::recv(s.fd(), same_host::Clock::now() + std::chrono::seconds(2));
      if (string_field(r, "engine") != peer.engine_id) {
        *why = "the same-host socket named in the peer's info is served by another engine";
        return false;
      }
      return true;
    } catch (const Error& e) {
      *why = e.what();
      SLUICE_LOG(kInfo, "nvlink: " << *why << "; trying the next transport");
      return false;
    }
  }

  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto it = setup.peer.transports.find("nvlink");
    std::string name = it == setup.peer.transports.end() ? std::string() : string_field(it->second, "socket");
    if (name.empty()) throw Error(ErrorCode::kProtocol, "nvlink: the peer's info names no same-host socket");
    auto ep = std::make_shared<NvlinkEndpoint>(setup, *this, name);
    endpoints_.add(setup.token, setup.active, ep);
    return ep;
  }

  // NvlinkHost
  const Registry& registry() const override { return *registry_; }
  const std::string& engine_id() const override { return engine_id_; }
  int lease_fd() const override { return registry_->leases().ok() ? registry_->leases().memfd() : -1; }
  void forget(uint64_t) override { endpoints_.forget(); }

 private:
  std::string host_id_;
  std::string engine_id_;
  const Registry* registry_;
  same_host::Endpoints endpoints_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(nvlink, "nvlink", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  if (kDisable.get(*ctx.config)) {
    *why = "disabled by nvlink.disable / SLUICE_NVLINK_DISABLE";
    return nullptr;
  }
  if (cu::device_count(why) == 0) return nullptr;
  try {
    return std::make_unique<NvlinkTransport>(ctx);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
});

}  // namespace sluice::detail
