// shm: peers on the same host. Data moves in one copy: straight loads and stores into the
// peer's engine-allocated (memfd) memory when it has any, process_vm_readv/writev otherwise.
// A single control connection carries imm values, send rendezvous and acks.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <random>
#include <thread>
#include <unordered_map>

#include "bootstrap/messages.hpp"
#include "core/lease_table.hpp"
#include "core/log.hpp"
#include "cuda/staging.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/shm/cma.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

// Mapping of a peer's memfd region into this process.
struct Mapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  ~Mapping() {
    if (base) ::munmap(base, length);
  }
};

// Shared state of one write_with_imm / multi-lane op on this side.
struct OpTrack {
  std::atomic<int> lanes_left{0};
  std::atomic<bool> failed{false};
};

struct Job {
  std::shared_ptr<TransferOp> op;
  uint64_t token = 0;
  size_t lane = 0;
  std::shared_ptr<OpTrack> track;
};

class ShmEndpoint final : public TransportEndpoint, public StreamChannel::Handler {
 public:
  explicit ShmEndpoint(const EndpointSetup& s) : events_(s.events), nworkers_(s.channels) {
    pid_ = s.peer.transports.at("shm").value("pid", s.peer.pid);
    if (!leases_.map(pid_, s.peer.lease_memfd, s.peer.lease_slots))
      throw Error(ErrorCode::kUnsupported, "shm: cannot map the peer's lease table");
    peer_updated(s.peer);
    for (int i = 0; i < nworkers_; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ShmEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  void connect(const ChannelOpener& open) override {
    auto [sock, reply] = open(0, nlohmann::json::object());
    install(std::move(sock));
  }

  bool attach(int index, net::Socket sock, const nlohmann::json&) override {
    if (index != 0 || control_) throw Error(ErrorCode::kProtocol, "shm takes one control channel");
    bootstrap::send_msg(sock.fd(), bootstrap::MsgKind::kReply, nlohmann::json::object());
    install(std::move(sock));
    return true;
  }

  void submit(std::shared_ptr<TransferOp> op) override {
    uint64_t token = pending_.add(op);
    if (!token) return;
    auto track = std::make_shared<OpTrack>();
    std::vector<Job> jobs;
    for (size_t l = 0; l < op->lanes.size(); ++l)
      if (!op->lanes[l].pieces.empty()) jobs.push_back({op, token, l, track});
    track->lanes_left = static_cast<int>(jobs.size());
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& j : jobs) jobs_.push_back(std::move(j));
    }
    if (jobs.size() == 1) cv_.notify_one();
    else cv_.notify_all();
  }

  void send(std::shared_ptr<MessageOp> op) override {
    if (!pending_.add_send(op)) return;
    OutFrame f;
    f.hdr = make_frame(FrameType::kSendRts, op->seq, reinterpret_cast<uint64_t>(op->ptr), 0, 0, 0,
                       static_cast<uint32_t>(op->length), static_cast<uint32_t>(op->length >> 32));
    control_->post(std::move(f));
  }

  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }

  void close(const Status& why) override {
    fail(why, false);
    if (control_) control_->join();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
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
      default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on shm control"};
    }
  }

  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

 private:
  void install(net::Socket sock) {
    control_ = std::make_unique<StreamChannel>(std::move(sock), this, 0);
    control_->start();
  }

  void peer_updated(const EngineInfo& peer) override {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (const auto& r : peer.regions) {
      slots_[r.info.id] = r.lease_slot;
      if (r.info.shareable && r.memfd >= 0) memfds_[r.info.id] = {r.memfd, r.info.length};
    }
  }

  uint32_t lease_slot(uint64_t id) {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto it = slots_.find(id);
    return it == slots_.end() ? kNoLease : it->second;
  }

  // Holds leases on every peer region a lane touches, so the peer cannot unregister one
  // while we copy (and we never touch one it already unregistered).
  class LaneLeases {
   public:
    explicit LaneLeases(PeerLeases& l) : leases_(l) {}
    ~LaneLeases() {
      for (uint32_t s : held_) leases_.leave(s);
    }
    Status enter(uint32_t slot, uint64_t id) {
      for (size_t i = 0; i < ids_.size(); ++i)
        if (ids_[i] == id) return Status::Ok();
      if (slot == kNoLease || !leases_.enter(slot, id))
        return {ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + " is no longer registered"};
      held_.push_back(slot);
      ids_.push_back(id);
      return Status::Ok();
    }

   private:
    PeerLeases& leases_;
    std::vector<uint32_t> held_;
    std::vector<uint64_t> ids_;
  };

  // The peer's memfd region `id` mapped here, or nullptr (then CMA is used).
  uint8_t* mapped(uint64_t id) {
    std::lock_guard<std::mutex> lk(map_mu_);
    auto m = maps_.find(id);
    if (m != maps_.end()) return m->second ? m->second->base : nullptr;
    auto it = memfds_.find(id);
    std::shared_ptr<Mapping> mp;
    if (it != memfds_.end()) {
      std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(it->second.first);
      int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      struct stat st {};
      if (fd >= 0 && ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) >= it->second.second) {
        void* p = ::mmap(nullptr, it->second.second, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (p != MAP_FAILED) {
          mp = std::make_shared<Mapping>();
          mp->base = static_cast<uint8_t*>(p);
          mp->length = it->second.second;
        }
      }
      if (fd >= 0) ::close(fd);
      if (!mp) SLUICE_LOG(kInfo, "shm: cannot map peer region " << id << " (" << path << "); using process_vm_*");
    }
    maps_[id] = mp;
    return mp ? mp->base : nullptr;
  }

  Status run_lane(const TransferOp& op, const Lane& lane) {
    for (const auto& pin : op.pins)
      if (staging::is_device(pin.get()->location)) return run_lane_staged(op, lane);
    return run_lane_host(op, lane);
  }

  // cuda memory on this side moves through pinned host copies of its pieces (downloaded
  // before a write, uploaded after a read). The peer's cuda memory is out of shm's reach: the
  // copy into it fails (process_vm_*: address not mapped).
  Status run_lane_staged(const TransferOp& op, const Lane& lane) {
    const bool write = op.kind != OpKind::kRead;
    auto on_device = [&](const uint8_t* p) {
      for (const auto& pin : op.pins) {
        const RegionEntry* e = pin.get();
        if (p >= e->base && p < e->base + e->length) return staging::is_device(e->location);
      }
      return false;
    };
    Lane host = lane;
    std::vector<std::pair<size_t, std::shared_ptr<uint8_t>>> bufs;
    try {
      for (size_t i = 0; i < host.pieces.size(); ++i) {
        Piece& p = host.pieces[i];
        if (!on_device(p.local)) continue;
        auto b = write ? staging::download_copy(p.local, p.length) : staging::pinned(p.length);
        p.local = b.get();
        bufs.emplace_back(i, std::move(b));
      }
      Status st = run_lane_host(op, host);
      if (!st.ok() || write) return st;
      for (auto& [i, b] : bufs) staging::upload(lane.pieces[i].local, b.get(), lane.pieces[i].length);
      return Status::Ok();
    } catch (const Error& e) {
      return e.status();
    }
  }

  Status run_lane_host(const TransferOp& op, const Lane& lane) {
    const bool write = op.kind != OpKind::kRead;
    LaneLeases held(leases_);
    for (const Piece& p : lane.pieces) {
      Status st = held.enter(lease_slot(p.remote_id), p.remote_id);
      if (!st.ok()) return st;
    }
    std::vector<cma::Span> spans;
    for (const Piece& p : lane.pieces) {
      if (uint8_t* base = mapped(p.remote_id)) {
        uint8_t* remote = base + p.remote_offset;
        if (write) std::memcpy(remote, p.local, p.length);
        else std::memcpy(p.local, remote, p.length);
      } else {
        spans.push_back({p.local, p.remote_addr, p.length});
      }
    }
    if (spans.empty()) return Status::Ok();
    return cma::move(pid_, spans, write);
  }

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (stop_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      Status st = failed_.load() ? Status{ErrorCode::kCancelled, "endpoint closed"} : run_lane(*job.op, job.op->lanes[job.lane]);
      pending_.touch();
      if (!st.ok()) job.track->failed = true;
      if (st.code == ErrorCode::kPeerLost) {
        fail(st, true);
        continue;
      }
      if (job.track->lanes_left.fetch_sub(1) == 1 && job.op->kind == OpKind::kWriteImm && !job.track->failed) {
        // Every byte is in the peer's memory (the copies above returned); now the imm.
        OutFrame f;
        f.hdr = make_frame(FrameType::kImm, job.token, 0, 0, 0, 0, job.op->imm);
        control_->post(std::move(f));
      }
      pending_.lane_done(job.token, st);
    }
  }

  Status serve_rts(StreamChannel& ch, const FrameHeader& h) {
    uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
    auto claim = events_->matcher().claim(h.op_id, length);
    if (claim.error.code == ErrorCode::kProtocol) return claim.error;
    Status st = claim.error;
    if (claim.dest) {
      uint64_t n = std::min(length, claim.capacity);
      if (n) st = cma::move(pid_, {{claim.dest, h.region, n}}, /*write=*/false);
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
      jobs_.clear();
      cv_.notify_all();
    }
    pending_.fail_all(why);
    if (notify) events_->on_failure(why);
  }

  EndpointEvents* events_;
  const int nworkers_;
  pid_t pid_ = 0;
  std::unique_ptr<StreamChannel> control_;
  PendingOps pending_;
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;

  std::mutex map_mu_;
  std::unordered_map<uint64_t, std::pair<int, uint64_t>> memfds_;  // id -> (peer fd, length)
  std::unordered_map<uint64_t, uint32_t> slots_;                    // id -> peer lease slot
  PeerLeases leases_;
  std::unordered_map<uint64_t, std::shared_ptr<Mapping>> maps_;
};

// A word the peer reads to prove that cross-process access works between us.
alignas(64) volatile uint64_t g_probe_word = 0;

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const EngineContext& ctx) : host_id_(ctx.host_id) {
    if (g_probe_word == 0) g_probe_word = std::random_device{}() | 1;
  }
  std::string name() const override { return "shm"; }
  int priority() const override { return 20; }
  // cuda memory on this side is staged through pinned host buffers (CUDA builds with a GPU).
  bool supports(const Location& loc) const override { return loc.is_host() || staging::available(); }
  nlohmann::json local_address() const override {
    return {{"pid", static_cast<int>(::getpid())},
            {"probe_addr", reinterpret_cast<uint64_t>(&g_probe_word)},
            {"probe_value", static_cast<uint64_t>(g_probe_word)}};
  }
  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    const auto& a = peer.transports.at("shm");
    uint64_t value = 0;
    int err = 0;
    if (!a.contains("pid") || !a.contains("probe_addr") || !a.contains("probe_value")) {
      *why = "the peer's shm address is incomplete";
      return false;
    }
    if (!cma::probe(a["pid"].get<int>(), a["probe_addr"].get<uint64_t>(), &value, &err) ||
        value != a["probe_value"].get<uint64_t>()) {
      *why = std::string("the kernel denies cross-process access (process_vm_readv: ") +
             (err ? std::strerror(err) : "wrong probe value") + ")";
      SLUICE_LOG(kWarn, "shm: " << *why << "; falling back to the next transport");
      return false;
    }
    PeerLeases probe_leases;
    if (!probe_leases.map(a["pid"].get<int>(), peer.lease_memfd, peer.lease_slots)) {
      *why = "cannot map the peer's lease table (/proc/<pid>/fd)";
      SLUICE_LOG(kWarn, "shm: " << *why << "; falling back to the next transport");
      return false;
    }
    return true;
  }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    return std::make_shared<ShmEndpoint>(setup);
  }

 private:
  std::string host_id_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(shm, "shm", [](const EngineContext& ctx, std::string*) -> std::unique_ptr<Transport> {
  return std::make_unique<ShmTransport>(ctx);
});

}  // namespace sluice::detail
