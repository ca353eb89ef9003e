// Region descriptions without waiting: a lane that reads a peer region this side has not had
// described is parked, and the question goes to the peer's same-host socket on a progress
// reactor (one connection per question, as the peer's service expects). The answer, a
// failure or the deadline (connect_timeout) re-queues the parked lanes on the copy pool, so a
// stalled or dead peer holds up its own lanes only, never a pool thread.
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>

#include "core/log.hpp"
#include "transport/common/progress_pool.hpp"
#include "transport/shm/shm_endpoint.hpp"
#include "transport/shm/shm_test_describe.hpp"

namespace sluice::detail::shm {
namespace {

// Test only (hold_test_describes): the serving side keeps describe questions unanswered.
std::mutex g_hold_mu;
std::condition_variable g_hold_cv;
bool g_hold = false;

// One question in flight. Lives on its reactor (registered there) until it finished; holds
// its endpoint weakly, so an endpoint closed meanwhile is simply not told.
class DescribeAsk final : public ReactorSource, public std::enable_shared_from_this<DescribeAsk> {
 public:
  DescribeAsk(std::weak_ptr<ShmEndpoint> ep, std::shared_ptr<HostGate> gate, uint64_t id,
              std::shared_ptr<ProgressPool> pool, Reactor& r, same_host::Clock::time_point deadline)
      : ep_(std::move(ep)), gate_(std::move(gate)), id_(id), pool_(std::move(pool)), reactor_(r), deadline_(deadline) {}
  ~DescribeAsk() override {
    if (fd_ >= 0) ::close(fd_);
  }

  // Reactor thread: connect (a Unix connect never waits), send, then wait for the answer.
  void begin(const std::string& name, pid_t pid, const nlohmann::json& req) {
    try {
      sock_ = same_host::ask_start(name, pid, req);
      reactor_.add(sock_.fd(), this);
      registered_ = true;
      self_ = shared_from_this();  // the reactor knows us by address until remove() is done
      reactor_.wake_at(this, deadline_);
      on_events(EPOLLIN);  // the answer may be in already
    } catch (const Error& e) {
      finish(e.status());
    }
  }
  void on_events(uint32_t) override {
    if (done_) return;
    try {
      if (same_host::recv_some(sock_.fd(), buf_, &fd_)) finish(Status::Ok());
    } catch (const Error& e) {
      finish(e.status());
    }
  }
  void on_deadline() override {
    finish({ErrorCode::kTimeout, "shm: the peer did not describe its region " + std::to_string(id_) +
                                     " in time (connect_timeout)"});
  }

 private:
  void finish(Status st) {
    if (done_) return;
    done_ = true;
    nlohmann::json reply;
    if (st.ok()) {
      try {
        reply = same_host::parse_message(buf_);
      } catch (const Error& e) {
        st = e.status();
      }
    }
    if (auto ep = ep_.lock()) {
      gate_->run([&] {
        ep->described(id_, st, reply, std::exchange(fd_, -1));
        // Not released here: the last reference dropped on a reactor thread would close the
        // endpoint there (close() waits for channels that this thread serves).
        ep->host().copy_pool().drop(std::move(ep));
      });
      // Past the gate the transport is gone, and its engine closed the endpoint before it:
      // releasing a closed endpoint here closes nothing.
    }
    if (registered_) reactor_.remove(sock_.fd(), this, [self = std::move(self_)] {});
  }

  std::weak_ptr<ShmEndpoint> ep_;
  const std::shared_ptr<HostGate> gate_;
  const uint64_t id_;
  std::shared_ptr<ProgressPool> pool_;  // keeps reactor_
  Reactor& reactor_;
  const same_host::Clock::time_point deadline_;
  net::Socket sock_;
  std::string buf_;
  int fd_ = -1;
  bool registered_ = false;
  bool done_ = false;
  std::shared_ptr<DescribeAsk> self_;
};

}  // namespace

void hold_test_describes(bool on) {
  {
    std::lock_guard<std::mutex> lk(g_hold_mu);
    g_hold = on;
  }
  g_hold_cv.notify_all();
}

void wait_while_test_describes_held() {
  std::unique_lock<std::mutex> lk(g_hold_mu);
  // Bounded: a test that forgets to let go must not hang the engine for good.
  g_hold_cv.wait_for(lk, std::chrono::seconds(60), [] { return !g_hold; });
}

void ShmEndpoint::start_describe(uint64_t id) {
  auto pool = ProgressPool::shared();
  Reactor& r = pool->pick();
  auto ask = std::make_shared<DescribeAsk>(weak_from_this(), host_.gate(), id, pool, r, same_host::Clock::now() + timeout_);
  // Everything on the reactor thread (wake_at is reactor-only), so the caller (a user's
  // submit, a pool thread) does not even pay for the connect.
  r.post([ask, name = peer_socket_, pid = pid_.load(),
          req = nlohmann::json{{"op", "describe"}, {"token", token_}, {"to_passive", active_}, {"region", id}}] {
    ask->begin(name, pid, req);
  });
}

void ShmEndpoint::described(uint64_t id, const Status& answer, const nlohmann::json& r, int fd) {
  struct FdGuard {
    int fd;
    ~FdGuard() {
      if (fd >= 0) ::close(fd);
    }
  } guard{fd};
  Status st = answer;
  RemoteRegion rr;
  if (id == kEagerRingId) {
    // The peer's eager ring (asked for by take_credit), never one of its regions: a lane that
    // names this id (no region has it) fails below as an unknown region.
    ring_described(st, r, fd);
    st = {ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + ": no such region"};
  } else if (st.ok() && r.contains("error")) {
    st = {ErrorCode::kUnknownHandle, "peer region " + std::to_string(id) + ": " +
                                         (r["error"].is_string() ? r["error"].get<std::string>() : r["error"].dump())};
  } else if (st.ok() && (!r.contains("addr") || !r.contains("length") || !r.contains("slot") ||
                         !r["addr"].is_number_unsigned() || !r["length"].is_number_unsigned() ||
                         !r["slot"].is_number_unsigned())) {
    st = {ErrorCode::kProtocol, "shm: malformed region description from the peer"};
  } else if (st.ok()) {
    rr.addr = r["addr"].get<uint64_t>();
    rr.length = r["length"].get<uint64_t>();
    uint64_t slot = r["slot"].get<uint64_t>();
    rr.slot = slot > kNoLease ? kNoLease : static_cast<uint32_t>(slot);
    if (fd >= 0 && same_host::is_memfd(fd, rr.length) && rr.length > 0) {
      void* p = ::mmap(nullptr, rr.length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        rr.map = std::make_shared<Mapping>();
        rr.map->base = static_cast<uint8_t*>(p);
        rr.map->length = rr.length;
      }
    }
  }
  if (!st.ok()) SLUICE_LOG(kDebug, "shm: region " << id << " not described: " << st.message);
  std::vector<Job> parked;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (st.ok()) regions_.emplace(id, rr);
    describing_.erase(id);
    auto it = parked_.find(id);
    if (it != parked_.end()) {
      parked = std::move(it->second);
      parked_.erase(it);
    }
  }
  for (Job& j : parked) {
    if (!st.ok()) j.error = st;
    enqueue(std::move(j));
  }
  // Prefaulted behind the parked lanes, a chunk a job, so that a close waits for one chunk at
  // most and other endpoints' jobs take turns with these (shm.map_populate_max).
  if (st.ok() && rr.map && rr.length <= populate_max_) {
    constexpr uint64_t kChunk = 64ull << 20;
    for (uint64_t off = 0; off < rr.length; off += kChunk) {
      Job j;
      j.kind = Job::kPopulate;
      j.map = rr.map;
      j.src = off;
      j.len = std::min(kChunk, rr.length - off);
      enqueue(std::move(j));
    }
  }
}

bool ShmEndpoint::park_if_undescribed(Job& job) {
  uint64_t missing = 0;
  bool ask = false;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    bool found = false;
    for (const Piece& p : job.op->lanes[job.lane].pieces)
      if (!regions_.count(p.remote_id)) {
        missing = p.remote_id;
        found = true;
        break;
      }
    if (!found) return false;
    ask = describing_.insert(missing).second;
    parked_[missing].push_back(std::move(job));
  }
  if (ask) start_describe(missing);
  return true;
}

}  // namespace sluice::detail::shm
