// nvlink: peers on the same host with CUDA memory. Each side exports its cuda regions in its
// info blob (cuMem* allocations as POSIX fds fetched with pidfd_getfd, cudaMalloc memory as
// cudaIpc handles, both with the region's offset inside its allocation); the other side maps
// them once and moves bytes with cudaMemcpyAsync on dedicated streams (the copy engine; an
// SM copy kernel for pieces up to SLUICE_NVLINK_SM_COPY_MAX, off by default: slower here).
// The pieces the core cut for stream transports are merged back into one copy per contiguous
// range. CUDA events signal completion: small ops are polled on the submitting thread, the
// rest by a poller thread. Host memory on both sides moves with process_vm_readv/writev; host <-> peer-host
// with a local cuda side stages through host memory. A control StreamChannel carries imm
// values and send rendezvous, as in shm.
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
#include <thread>
#include <unordered_map>

#include "bootstrap/messages.hpp"
#include "core/lease_table.hpp"
#include "core/log.hpp"
#include "cuda/copy_kernels.hpp"
#include "cuda/cuda_util.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/shm/cma.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

namespace cu = sluice::detail::cuda;

uint64_t env_u64(const char* name, uint64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  return std::strtoull(v, nullptr, 10);
}

struct OpTrack {
  std::atomic<int> lanes_left{0};
  std::atomic<bool> failed{false};
};

// One submitted op: the events of the streams its copies went on; when every event has
// fired, each of its `lanes` non-empty lanes completes.
struct Inflight {
  std::shared_ptr<TransferOp> op;
  uint64_t token = 0;
  std::shared_ptr<OpTrack> track;
  std::vector<cudaEvent_t> events;
  int device = 0;
  int lanes = 0;
  std::shared_ptr<struct LeaseHold> leases;  // released when the op's copies are done
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
};

// A copy after merging the op's pieces.
struct Seg {
  uint8_t* local;
  uint64_t remote_id;
  uint64_t remote_offset;
  uint64_t remote_addr;
  uint64_t length;
};

// Where a remote region's bytes are, as seen from this process.
struct RemoteView {
  uint8_t* ptr = nullptr;  // byte 0 as addressable here: cuda regions, mapped memfd host regions
  bool host = false;       // a host region: mapped (ptr) or else moved with CMA at its address
  uint64_t addr = 0;       // the peer's virtual address of byte 0
};

// A peer's engine-allocated (memfd) host region mapped here, as shm does.
struct HostMapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  ~HostMapping() {
    if (base) ::munmap(base, length);
  }
};

class NvlinkEndpoint final : public TransportEndpoint, public StreamChannel::Handler {
 public:
  explicit NvlinkEndpoint(const EndpointSetup& s)
      : events_(s.events), peer_host_(s.peer.listen_host), peer_port_(s.peer.listen_port),
        timeout_(s.config.connect_timeout) {
    const auto& a = s.peer.transports.at("nvlink");
    pid_ = a.value("pid", s.peer.pid);
    same_process_ = pid_ == ::getpid();
    sm_copy_max_ = env_u64("SLUICE_NVLINK_SM_COPY_MAX", 0);
    nstreams_ = static_cast<int>(std::clamp<uint64_t>(env_u64("SLUICE_NVLINK_STREAMS", 1), 1, 16));
    split_min_ = env_u64("SLUICE_NVLINK_SPLIT_MIN", 8ull << 20);
    inline_max_ = env_u64("SLUICE_NVLINK_INLINE_MAX", 64ull << 10);
    // Where the engine lets waiters poll (spare cores), let them poll for about as long as
    // the copy should take, as cudaStreamSynchronize does: a sleeping waiter wakes late.
    int us = s.config.busy_wait_us;
    if (us < 0) us = std::thread::hardware_concurrency() > 2 ? 20 : 0;
    poll_waiters_ = us > 0;
    if (!leases_.map(pid_, s.peer.lease_memfd, s.peer.lease_slots))
      throw Error(ErrorCode::kUnsupported, "nvlink: cannot map the peer's lease table");
    load_peer(s.peer);
    poller_ = std::thread([this] { poll(); });
  }
  ~NvlinkEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  void connect(const ChannelOpener& open) override {
    auto [sock, reply] = open(0, nlohmann::json::object());
    install(std::move(sock));
  }

  bool attach(int index, net::Socket sock, const nlohmann::json&) override {
    if (index != 0 || control_) throw Error(ErrorCode::kProtocol, "nvlink takes one control channel");
    bootstrap::send_msg(sock.fd(), bootstrap::MsgKind::kReply, nlohmann::json::object());
    install(std::move(sock));
    return true;
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
    if (Status ls = hold_leases(*op, *f.leases); !ls.ok()) {
      finish_all(f, ls);
      return;
    }
    auto* user = static_cast<cudaStream_t>(cu::current_user_stream());
    Status st = failed_.load() ? Status{ErrorCode::kCancelled, "endpoint closed"} : enqueue(*op, user, &f);
    if (!st.ok() || f.events.empty()) {
      for (auto e : f.events) {
        cudaEventSynchronize(e);
        give_event(f.device, e);
      }
      f.events.clear();
      finish_all(f, st);
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

  // New regions (hello reply, refresh_remote_regions): take their export entries.
  void peer_updated(const EngineInfo& peer) override { load_peer(peer); }

  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }

  void close(const Status& why) override {
    fail(why, false);
    if (control_) control_->join();
    if (poller_.joinable()) poller_.join();
    std::lock_guard<std::mutex> lk(res_mu_);
    for (auto& [key, s] : streams_) cudaStreamSynchronize(s);
    for (auto& [key, s] : streams_) cudaStreamDestroy(s);
    streams_.clear();
    for (auto& [dev, pool] : event_pool_)
      for (auto e : pool) cudaEventDestroy(e);
    event_pool_.clear();
    std::lock_guard<std::mutex> lk2(map_mu_);
    imports_.clear();
    views_.clear();
    host_maps_.clear();
  }

  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override {
    pending_.touch();
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kImm:
        events_->matcher().push_imm(h.imm);
        return Status::Ok();
      case FrameType::kSendRts: return serve_rts(ch, h);
      case FrameType::kSendAck: return complete_send_ack(pending_, h, payload);
      case FrameType::kError: return peer_error(payload);
      default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on nvlink control"};
    }
  }

  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

 private:
  void install(net::Socket sock) {
    control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
    control_->start();
  }

  Status hold_leases(const TransferOp& op, LeaseHold& h) {
    for (const Lane& lane : op.lanes)
      for (const Piece& p : lane.pieces) {
        if (std::find(h.ids.begin(), h.ids.end(), p.remote_id) != h.ids.end()) continue;
        uint32_t slot = kNoLease;
        {
          std::lock_guard<std::mutex> lk(map_mu_);
          auto it = lease_slots_.find(p.remote_id);
          if (it != lease_slots_.end()) slot = it->second;
        }
        if (slot == kNoLease || !leases_.enter(slot, p.remote_id))
          return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(p.remote_id) + " is no longer registered"};
        h.slots.push_back(slot);
        h.ids.push_back(p.remote_id);
      }
    return Status::Ok();
  }

  void load_peer(const EngineInfo& peer) {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (const auto& r : peer.regions) {
      lease_slots_[r.info.id] = r.lease_slot;
      region_addr_[r.info.id] = r.info.addr;
      region_host_[r.info.id] = r.info.location.is_host();
      if (r.info.shareable && r.memfd >= 0) memfds_[r.info.id] = {r.memfd, r.info.length};
    }
    auto it = peer.transports.find("nvlink");
    if (it == peer.transports.end() || !it->second.contains("regions")) return;
    for (const auto& d : it->second["regions"]) exports_[d.at("id").get<uint64_t>()] = d;
  }

  // The peer registered regions after we connected: fetch its info again.
  void refetch() {
    try {
      net::Socket s = net::connect_tcp(peer_host_, peer_port_, timeout_);
      net::set_io_timeout(s.fd(), timeout_);
      bootstrap::send_msg(s.fd(), bootstrap::MsgKind::kInfo, nlohmann::json::object());
      auto reply = bootstrap::expect_reply(s.fd(), "info query");
      load_peer(EngineInfo::from_json(reply.at("info")));
    } catch (const std::exception& e) {
      SLUICE_LOG(kWarn, "nvlink: cannot refresh the peer's regions: " << e.what());
    }
  }

  // Resolve remote region `id` for copies driven by `device`. Throws Error.
  RemoteView view(uint64_t id, int device) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      {
        std::lock_guard<std::mutex> lk(map_mu_);
        auto v = views_.find(id);
        if (v != views_.end()) return v->second;
        auto h = region_host_.find(id);
        if (h != region_host_.end() && h->second) {
          RemoteView rv{map_host(id), true, region_addr_[id]};
          views_[id] = rv;
          return rv;
        }
        auto e = exports_.find(id);
        if (e != exports_.end()) {
          const auto& desc = e->second;
          RemoteView rv;
          rv.addr = desc.value("addr", uint64_t(0));
          uint64_t base = desc.at("base").get<uint64_t>();
          uint64_t off = desc.at("offset").get<uint64_t>();
          if (same_process_) {
            // Our own process: the address is valid here; let `device` reach it directly.
            int owner = desc.value("device", device);
            if (owner != device) {
              int can = 0;
              cudaDeviceCanAccessPeer(&can, device, owner);
              if (can && cudaDeviceEnablePeerAccess(owner, 0) != cudaSuccess) cudaGetLastError();
            }
            rv.ptr = reinterpret_cast<uint8_t*>(base + off);
          } else {
            auto& imp = imports_[base];
            if (!imp) imp = cu::import_region(pid_, desc, device);
            rv.ptr = imp->base + off;
          }
          views_[id] = rv;
          return rv;
        }
      }
      if (attempt == 0) refetch();
    }
    throw Error(ErrorCode::kUnsupported, "nvlink: the peer does not export region " + std::to_string(id) +
                                             " (cuda memory that cannot be shared?)");
  }

  // The peer's memfd host region `id` mapped here (map_mu_ held), or nullptr (then CMA).
  uint8_t* map_host(uint64_t id) {
    auto it = memfds_.find(id);
    if (it == memfds_.end() || same_process_) return nullptr;
    std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(it->second.first);
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st {};
    uint8_t* out = nullptr;
    if (::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= it->second.second) {
      void* p = ::mmap(nullptr, it->second.second, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        auto m = std::make_shared<HostMapping>();
        m->base = static_cast<uint8_t*>(p);
        m->length = it->second.second;
        host_maps_[id] = m;
        out = m->base;
      }
    }
    ::close(fd);
    return out;
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

  // Enqueue every copy of the op: pieces contiguous on both sides are merged back into one
  // copy (the core cut them for stream transports), large copies are split over
  // SLUICE_NVLINK_STREAMS streams. Appends one event per stream used to f->events (none when
  // everything completed synchronously).
  Status enqueue(const TransferOp& op, cudaStream_t user, Inflight* f) {
    try {
      const bool write = op.kind != OpKind::kRead;
      std::vector<Seg> segs;
      for (const Lane& lane : op.lanes)
        for (const Piece& p : lane.pieces) segs.push_back({p.local, p.remote_id, p.remote_offset, p.remote_addr, p.length});
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
      int device = -1;
      for (const Seg& g : merged)
        if ((device = local_device(op, g.local)) >= 0) break;
      bool local_cuda = device >= 0;
      if (device < 0) cudaGetDevice(&device);
      f->device = device;
      cu::check(cudaSetDevice(device), "cudaSetDevice");
      const int nstreams = user ? 1 : nstreams_;
      std::vector<bool> used(nstreams, false);
      auto stream_at = [&](int k) { return user ? user : stream(device, static_cast<size_t>(k)); };
      std::vector<cma::Span> spans;
      int next = 0;
      for (const Seg& g : merged) {
        RemoteView rv = view(g.remote_id, device);
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
          if (!local_cuda || local_device(op, g.local) < 0) {
            spans.push_back({g.local, g.remote_addr, g.length});
            continue;
          }
          // Local GPU, remote host: stage through host memory.
          cudaStream_t s = stream_at(0);
          std::vector<uint8_t> tmp(g.length);
          if (write) {
            cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
            cu::check(cudaMemcpy(tmp.data(), g.local, g.length, cudaMemcpyDefault), "cudaMemcpy");
            Status st = cma::move(pid_, {{tmp.data(), g.remote_addr, g.length}}, true);
            if (!st.ok()) return st;
          } else {
            Status st = cma::move(pid_, {{tmp.data(), g.remote_addr, g.length}}, false);
            if (!st.ok()) return st;
            cu::check(cudaMemcpyAsync(g.local, tmp.data(), g.length, cudaMemcpyDefault, s), "cudaMemcpyAsync");
            cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
          }
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
      if (!spans.empty()) {
        Status st = cma::move(pid_, spans, write);
        if (!st.ok()) return st;
      }
      for (int k = 0; k < nstreams; ++k) {
        if (!used[k]) continue;
        cudaEvent_t e = take_event(device);
        f->events.push_back(e);
        cu::check(cudaEventRecord(e, stream_at(k)), "cudaEventRecord");
      }
      return Status::Ok();
    } catch (const Error& e) {
      return e.status();
    }
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
    finish_all(f, st);
  }

  void finish_all(Inflight& f, const Status& st) {
    for (int i = 0; i < std::max(f.lanes, 1); ++i) finish(f, st);
  }

  // A lane finished (or failed): imm after the last lane of a write_with_imm, then complete.
  void finish(Inflight& f, const Status& st) {
    pending_.touch();
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
          if (device < 0) cudaGetDevice(&device);
          RemoteView rv = view(h.offset, device);
          if (rv.host) {
            st = cma::move(pid_, {{claim.dest, h.region, n}}, /*write=*/false);
          } else {
            cu::check(cudaSetDevice(device), "cudaSetDevice");
            cu::check(cudaMemcpy(claim.dest, rv.ptr + (h.region - rv.addr), n, cudaMemcpyDefault), "cudaMemcpy");
          }
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
    if (notify) events_->on_failure(why);
  }

  EndpointEvents* events_;
  std::string peer_host_;
  uint16_t peer_port_;
  std::chrono::milliseconds timeout_;
  pid_t pid_ = 0;
  bool same_process_ = false;
  uint64_t sm_copy_max_ = 0;
  int nstreams_ = 1;
  uint64_t split_min_ = 8ull << 20;
  uint64_t inline_max_ = 64ull << 10;
  bool poll_waiters_ = false;
  std::unique_ptr<StreamChannel> control_;
  PendingOps pending_;
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
  std::unordered_map<uint64_t, uint32_t> lease_slots_;  // peer region id -> its lease slot
  std::unordered_map<uint64_t, nlohmann::json> exports_;  // peer region id -> export desc
  std::unordered_map<uint64_t, uint64_t> region_addr_;
  std::unordered_map<uint64_t, bool> region_host_;
  std::unordered_map<uint64_t, std::shared_ptr<cu::Import>> imports_;  // peer allocation base -> mapping
  std::unordered_map<uint64_t, RemoteView> views_;
  std::unordered_map<uint64_t, std::pair<int, uint64_t>> memfds_;  // peer host region id -> (fd, length)
  std::unordered_map<uint64_t, std::shared_ptr<HostMapping>> host_maps_;
};

class NvlinkTransport final : public Transport {
 public:
  explicit NvlinkTransport(const EngineContext& ctx) : host_id_(ctx.host_id), registry_(ctx.registry) {}
  std::string name() const override { return "nvlink"; }
  int priority() const override { return 30; }
  bool supports(const Location& loc) const override { return loc.is_host() || loc.kind == Location::Kind::kCuda; }
  nlohmann::json local_address() const override {
    nlohmann::json regions = nlohmann::json::array();
    for (const auto& e : registry_->entries()) {
      if (e->location.is_host()) continue;
      try {
        auto d = cu::export_region(e->base, e->length);
        d["id"] = e->id;
        d["addr"] = reinterpret_cast<uint64_t>(e->base);
        regions.push_back(std::move(d));
      } catch (const Error& err) {
        // Engines of this same process can still use the address directly.
        SLUICE_LOG(kInfo, "nvlink: region " << e->id << " is not shareable: " << err.what());
        auto addr = reinterpret_cast<uint64_t>(e->base);
        regions.push_back({{"id", e->id}, {"addr", addr}, {"base", addr}, {"offset", 0}, {"base_size", e->length},
                           {"device", e->location.device}, {"kind", "none"}, {"why", err.what()}});
      }
    }
    return {{"pid", static_cast<int>(::getpid())}, {"devices", cu::device_count()}, {"regions", regions}};
  }
  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    const auto& a = peer.transports.at("nvlink");
    if (a.value("devices", 0) <= 0) {
      *why = "the peer has no CUDA device";
      return false;
    }
    return true;
  }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    return std::make_shared<NvlinkEndpoint>(setup);
  }

 private:
  std::string host_id_;
  const Registry* registry_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(nvlink, "nvlink", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  if (std::getenv("SLUICE_NVLINK_DISABLE")) {
    *why = "disabled by SLUICE_NVLINK_DISABLE";
    return nullptr;
  }
  if (cu::device_count(why) == 0) return nullptr;
  return std::make_unique<NvlinkTransport>(ctx);
});

}  // namespace sluice::detail
