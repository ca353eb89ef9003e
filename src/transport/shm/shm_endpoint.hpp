// One shm endpoint: the control channel is a Unix-domain socket whose other end the kernel
// names (SO_PEERCRED), so every copy targets the process that proved itself, never a pid a
// message claimed. Who copies what:
// - reads: this side copies out of the peer's region (its mapped memfd, else process_vm_readv)
//   at the address the peer described over the authenticated socket, inside the peer's lease,
//   and keeps the bytes only if the lease still holds afterwards;
// - writes into a peer's memfd region (once described and mapped): this side copies into the
//   mapping, inside the lease; after the owner frees it those pages are the mapping's alone;
// - every other write is a PULL_WRITE: the owner copies the bytes into its own region with
//   process_vm_readv, so no peer ever writes into memory by address.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/lease_table.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_endpoints.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::shm {

using same_host::kMaxPullPieces;
using same_host::PullPiece;
using same_host::RtsSource;

// What endpoints need from their transport (it outlives them).
class Host {
 public:
  virtual ~Host() = default;
  virtual const Registry& registry() const = 0;
  virtual const std::string& engine_id() const = 0;
  virtual int lease_fd() const = 0;  // this engine's lease table (shared with peers), or -1
  virtual void forget(uint64_t token) = 0;
};

// A peer's memfd region mapped into this process.
struct Mapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  ~Mapping();
};

// One of the peer's regions as the peer described it over the authenticated socket.
struct RemoteRegion {
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t slot = kNoLease;
  std::shared_ptr<Mapping> map;  // null: moved with process_vm_readv
};

// Lanes of one op this side executes itself (reads, writes into mapped regions).
struct OpTrack {
  std::atomic<int> lanes_left{0};
  std::atomic<bool> failed{false};
};

class ShmEndpoint final : public TransportEndpoint, public StreamChannel::Handler, public same_host::ProvenEndpoint {
 public:
  ShmEndpoint(const EndpointSetup& s, Host& host, std::string peer_socket);
  ~ShmEndpoint() override;

  void connect(const ChannelOpener& open) override;
  nlohmann::json attach(int index, const nlohmann::json& hello) override;
  bool adopt(int index, net::Socket sock) override;
  void submit(std::shared_ptr<TransferOp> op) override;
  void send(std::shared_ptr<MessageOp> op) override;
  size_t pending() const override { return pending_.size(); }
  std::chrono::steady_clock::time_point last_progress() const override { return pending_.last_progress(); }
  // Per-operation deadlines (PendingOps::expire). An op past its own deadline is spared while
  // this endpoint keeps completing work of ours (lanes, answers to our requests): it waits in
  // our own queue behind a moving backlog. Frames the peer sends of its own accord (requests,
  // imms, chatter) keep nothing alive.
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override;
  void close(const Status& why) override;

  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override;
  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

  // Called by the transport's socket service.
  bool active() const { return active_; }
  // Passive side: the peer proved itself on our socket; takes the socket as control channel.
  void authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string& engine) override;
  // Answers the authenticated peer's question about one of our regions (*fd_out: its memfd).
  nlohmann::json describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const override;

 private:
  struct Job {
    enum Kind { kLane, kServe, kDescribe } kind = kLane;
    std::shared_ptr<TransferOp> op;
    uint64_t token = 0;
    size_t lane = 0;
    std::shared_ptr<OpTrack> track;
    // kServe: a peer's PULL_WRITE
    FrameHeader hdr{};
    std::vector<PullPiece> pull;
    uint64_t region = 0;  // kDescribe
  };

  void install(net::Socket sock);
  void enqueue(Job job);
  void work();
  Status run_lane(const TransferOp& op, const Lane& lane);
  Status run_read(const TransferOp& op, const Lane& lane);
  Status run_mapped_write(const TransferOp& op, const Lane& lane);
  void post_pull(const std::shared_ptr<TransferOp>& op, uint64_t token);
  void serve_pull(const Job& job);
  Status serve_rts(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload);
  Status take_pull(const FrameHeader& h, PayloadReader& payload);
  Status take_ack(const FrameHeader& h, PayloadReader& payload);
  // The peer's region `id` as it described it (asks it over its socket the first time).
  Status remote(uint64_t id, RemoteRegion* out);
  bool mapped_locked(uint64_t id) const;
  void fail(const Status& why, bool notify);

  Host& host_;
  EndpointEvents* events_;
  const bool active_;
  const uint64_t token_;
  const int nworkers_;
  const std::string peer_socket_;
  const std::chrono::milliseconds timeout_;
  std::atomic<pid_t> pid_{0};  // set once the peer proved itself
  std::atomic<bool> authenticated_{false};
  std::mutex ctl_mu_;  // guards control_ being installed (a service thread) against fail()/close()
  std::unique_ptr<StreamChannel> control_;
  PendingOps pending_;
  std::atomic<std::chrono::steady_clock::rep> moving_{0};  // when work of ours last completed
  void moved() { moving_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  std::atomic<bool> failed_{false};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::vector<std::thread> workers_;

  mutable std::mutex map_mu_;
  PeerLeases leases_;
  std::unordered_map<uint64_t, RemoteRegion> regions_;  // peer region id -> description
  std::unordered_set<uint64_t> describing_;             // descriptions being fetched

  std::mutex imm_mu_;
  std::unordered_map<uint64_t, std::pair<uint32_t, bool>> imm_;  // owner side: lanes seen, failed
  // PULL_WRITE ops in flight on this side: frames still unanswered per lane (a lane of more
  // than kMaxPullPieces pieces goes as several frames) and staged copies of cuda pieces.
  struct PullTrack {
    std::vector<std::pair<uint32_t, Status>> lanes;  // frames left, first error
    std::vector<std::shared_ptr<uint8_t>> staged;
  };
  std::mutex track_mu_;
  std::unordered_map<uint64_t, PullTrack> pulls_;
  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace sluice::detail::shm
