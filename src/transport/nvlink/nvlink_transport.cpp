// nvlink: peers on the same host with CUDA memory. Each side exports its cuda regions in its
// info blob (cuMem* allocations as POSIX fds fetched with pidfd_getfd, cudaMalloc memory as
// cudaIpc handles, both with the region's offset inside its allocation); the other side maps
// them once and moves bytes with cudaMemcpyAsync on dedicated per-lane streams (the copy
// engine) or, for small pieces, an SM copy kernel. CUDA events signal completion to a poller
// thread. Host memory on both sides moves with process_vm_readv/writev; host <-> peer-host
// with a local cuda side stages through host memory. A control StreamChannel carries imm
// values and send rendezvous, as in shm.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "bootstrap/messages.hpp"
#include "core/log.hpp"
#include "cuda/copy_kernels.hpp"
#include "cuda/cuda_util.hpp"
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

struct Inflight {
  std::shared_ptr<TransferOp> op;
  uint64_t token = 0;
  std::shared_ptr<OpTrack> track;
  cudaEvent_t event = nullptr;
  int device = 0;
};

// Where a remote region's bytes are, as seen from this process.
struct RemoteView {
  uint8_t* ptr = nullptr;  // device-accessible address of the region's byte 0 (cuda regions)
  bool host = false;       // a host region: use CMA with its virtual address
  uint64_t addr = 0;       // the peer's virtual address of byte 0
};

class NvlinkEndpoint final : public TransportEndpoint, public StreamChannel::Handler {
 public:
  explicit NvlinkEndpoint(const EndpointSetup& s)
      : events_(s.events), peer_host_(s.peer.listen_host), peer_port_(s.peer.listen_port),
        timeout_(s.config.connect_timeout), lanes_(s.channels) {
    const auto& a = s.peer.transports.at("nvlink");
    pid_ = a.value("pid", s.peer.pid);
    same_process_ = pid_ == ::getpid();
    sm_copy_max_ = env_u64("SLUICE_NVLINK_SM_COPY_MAX", 0);
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
    auto track = std::make_shared<OpTrack>();
    int lanes = 0;
    for (auto& l : op->lanes) lanes += l.pieces.empty() ? 0 : 1;
    track->lanes_left = lanes;
    auto* user = static_cast<cudaStream_t>(cu::current_user_stream());
    for (size_t l = 0; l < op->lanes.size(); ++l) {
      const Lane& lane = op->lanes[l];
      if (lane.pieces.empty()) continue;
      Inflight f{op, token, track};
      Status st = failed_.load() ? Status{ErrorCode::kCancelled, "endpoint closed"} : enqueue(*op, lane, l, user, &f);
      if (!st.ok() || !f.event) {
        finish(f, st);
        continue;
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        inflight_.push_back(std::move(f));
      }
      cv_.notify_one();
    }
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
  }

  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override {
    pending_.touch();
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kImm:
        events_->matcher().push_imm(h.imm);
        return Status::Ok();
      case FrameType::kSendRts: return serve_rts(ch, h);
      case FrameType::kSendAck: {
        Status st = h.status ? Status{static_cast<ErrorCode>(std::min<int>(h.status, int(ErrorCode::kInternal))),
                                      "peer: " + payload.read_text(kMaxMessageText)}
                             : Status::Ok();
        auto op = pending_.take_send(h.op_id);
        if (!op) return {ErrorCode::kProtocol, "send ack for an unknown message"};
        op->future->complete(st);
        return Status::Ok();
      }
      case FrameType::kError:
        return {ErrorCode::kRemoteError, "peer closed the connection: " + payload.read_text(kMaxMessageText)};
      default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on nvlink control"};
    }
  }

  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

 private:
  void install(net::Socket sock) {
    control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
    control_->start();
  }

  void load_peer(const EngineInfo& peer) {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (const auto& r : peer.regions) {
      region_addr_[r.info.id] = r.info.addr;
      region_host_[r.info.id] = r.info.location.is_host();
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
          RemoteView rv{nullptr, true, region_addr_[id]};
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

  // Enqueue one lane's copies; sets f->event (nullptr when the lane already completed
  // synchronously).
  Status enqueue(const TransferOp& op, const Lane& lane, size_t index, cudaStream_t user, Inflight* f) {
    try {
      const bool write = op.kind != OpKind::kRead;
      int device = -1;
      for (const Piece& p : lane.pieces) {
        int d = cu::pointer_device(p.local);
        if (d >= 0) {
          device = d;
          break;
        }
      }
      bool local_cuda = device >= 0;
      if (device < 0) cudaGetDevice(&device);
      cu::check(cudaSetDevice(device), "cudaSetDevice");
      cudaStream_t s = user ? user : stream(device, index);
      bool async = false;
      std::vector<cma::Span> spans;
      for (const Piece& p : lane.pieces) {
        RemoteView rv = view(p.remote_id, device);
        if (rv.host) {
          if (!local_cuda) {
            spans.push_back({p.local, p.remote_addr, p.length});
            continue;
          }
          // Local GPU, remote host: stage through host memory.
          std::vector<uint8_t> tmp(p.length);
          if (write) {
            cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
            cu::check(cudaMemcpy(tmp.data(), p.local, p.length, cudaMemcpyDefault), "cudaMemcpy");
            Status st = cma::move(pid_, {{tmp.data(), p.remote_addr, p.length}}, true);
            if (!st.ok()) return st;
          } else {
            Status st = cma::move(pid_, {{tmp.data(), p.remote_addr, p.length}}, false);
            if (!st.ok()) return st;
            cu::check(cudaMemcpyAsync(p.local, tmp.data(), p.length, cudaMemcpyDefault, s), "cudaMemcpyAsync");
            cu::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
          }
          continue;
        }
        uint8_t* remote = rv.ptr + p.remote_offset;
        void* dst = write ? static_cast<void*>(remote) : static_cast<void*>(p.local);
        const void* src = write ? static_cast<const void*>(p.local) : static_cast<const void*>(remote);
        if (local_cuda && p.length <= sm_copy_max_)
          cu::check(cu::sm_copy(dst, src, p.length, s), "sm_copy");
        else
          cu::check(cudaMemcpyAsync(dst, src, p.length, cudaMemcpyDefault, s), "cudaMemcpyAsync");
        async = true;
      }
      if (!spans.empty()) {
        Status st = cma::move(pid_, spans, write);
        if (!st.ok()) return st;
      }
      if (async) {
        f->device = device;
        f->event = take_event(device);
        cu::check(cudaEventRecord(f->event, s), "cudaEventRecord");
      }
      return Status::Ok();
    } catch (const Error& e) {
      return e.status();
    }
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
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (mine.empty()) cv_.wait(lk, [&] { return stop_ || !inflight_.empty(); });
        if (stop_) break;
        while (!inflight_.empty()) {
          mine.push_back(std::move(inflight_.front()));
          inflight_.pop_front();
        }
      }
      bool progressed = false;
      for (auto it = mine.begin(); it != mine.end();) {
        cudaError_t e = cudaEventQuery(it->event);
        if (e == cudaErrorNotReady) {
          ++it;
          continue;
        }
        Status st = Status::Ok();
        if (e != cudaSuccess) {
          cudaGetLastError();
          st = {ErrorCode::kInternal, std::string("nvlink copy failed: ") + cudaGetErrorString(e)};
        }
        give_event(it->device, it->event);
        finish(*it, st);
        it = mine.erase(it);
        progressed = true;
      }
      if (!progressed && !mine.empty()) std::this_thread::yield();
    }
    // Closing: wait for the copies so that no engine thread touches memory after close().
    for (auto& f : mine) {
      cudaEventSynchronize(f.event);
      give_event(f.device, f.event);
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
    OutFrame f;
    f.text = st.message.substr(0, kMaxMessageText);
    f.hdr = make_frame(FrameType::kSendAck, h.op_id, 0, 0, f.text.size(), 0, 0, 0, static_cast<uint16_t>(st.code));
    ch.post(std::move(f));
    return Status::Ok();
  }

  void fail(const Status& why, bool notify) {
    if (failed_.exchange(true)) return;
    if (control_) control_->shutdown();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (poller_.joinable() && poller_.get_id() != std::this_thread::get_id()) poller_.join();
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& f : inflight_) {
        cudaEventSynchronize(f.event);
        give_event(f.device, f.event);
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
  const int lanes_;
  pid_t pid_ = 0;
  bool same_process_ = false;
  uint64_t sm_copy_max_ = 0;
  std::unique_ptr<StreamChannel> control_;
  PendingOps pending_;
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Inflight> inflight_;
  bool stop_ = false;
  std::thread poller_;

  std::mutex res_mu_;
  std::map<std::pair<int, size_t>, cudaStream_t> streams_;
  std::map<int, std::vector<cudaEvent_t>> event_pool_;

  std::mutex map_mu_;
  std::unordered_map<uint64_t, nlohmann::json> exports_;  // peer region id -> export desc
  std::unordered_map<uint64_t, uint64_t> region_addr_;
  std::unordered_map<uint64_t, bool> region_host_;
  std::unordered_map<uint64_t, std::shared_ptr<cu::Import>> imports_;  // peer allocation base -> mapping
  std::unordered_map<uint64_t, RemoteView> views_;
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
        SLUICE_LOG(kInfo, "nvlink: region " << e->id << " is not shareable: " << err.what());
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
