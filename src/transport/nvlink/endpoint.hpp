// nvlink endpoint: one proven same-host peer, CUDA and host memory (the transport and its
// design are in nvlink_transport.cpp). The endpoint is split by concern:
//   endpoint.cpp    set-up (prove / authenticate / attach), describing our regions, close, failure
//   peer_view.cpp   the peer's regions as their owner describes them: cuda imports, host mappings
//   data_path.cpp   submit: resolve and lease the peer's regions, streams and events, the copies
//   completion.cpp  completion: CUDA events, the poller thread, PULL_WRITE answers, lanes
//   control.cpp     control frames: imm, SEND rendezvous, serving the peer's PULL_WRITEs and signals
//   post_path.cpp   the thin post path: post_write, post_signal, flush (records in post_path.hpp)
#pragma once

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "transport/common/lease_table.hpp"
#include "cuda/cuda_util.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/common/endpoint_base.hpp"
#include "transport/common/pending_ops.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_endpoints.hpp"
#include "transport/common/same_host_wire.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/nvlink/post_path.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::nvlink {

namespace cu = sluice::detail::cuda;

struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// Leases on the peer regions an op touches (see transport/common/lease_table.hpp): the peer cannot finish
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
  std::vector<cudaEvent_t> events;
  int device = 0;
  int lanes = 0;
  std::shared_ptr<LeaseHold> leases;  // released when the op's copies are done
  std::shared_ptr<PullState> pull;    // the op's writes the owner executes, if any
  // Mappings the op's asynchronous copies read or write (pinned HostMappings): kept mapped
  // until its events fired, even if the peer withdraws the region meanwhile.
  std::vector<std::shared_ptr<void>> keep;
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

// A read of the peer's unmapped host memory (at its address `remote`) into local GPU memory.
struct StagedRead {
  uint8_t* local;
  uint64_t remote;
  uint64_t length;
};

// A copy after merging the op's pieces.
struct Seg {
  uint8_t* local;
  uint64_t remote_id;
  uint64_t remote_offset;
  uint64_t length;
};

struct CopyPlan;  // one enqueue() call (data_path.cpp)
struct HostMapping;

// A peer region as its owner described it over the authenticated socket, and where its bytes
// are as seen from this process.
struct RemoteView {
  uint8_t* ptr = nullptr;  // byte 0 as addressable here (cuda regions, mapped memfd host regions)
  bool host = false;       // a host region: mapped (ptr) or else moved with CMA at `addr`
  uint64_t addr = 0;       // the owner's virtual address of byte 0
  uint64_t length = 0;     // every offset is checked against this
  uint32_t slot = kNoLease;
  int owner_device = -1;   // cuda regions: the device the memory is on, as numbered here (-1: unknown)
  std::shared_ptr<void> keep;  // the import or mapping `ptr` points into
  HostMapping* mapping = nullptr;  // mapped host regions: the mapping (kept alive by `keep`)
};

// Peer access from device `from` to device `to` where the hardware allows it (peer_view.cpp).
void enable_peer_access(int from, int to);

// A peer's engine-allocated (memfd) host region mapped here, as shm does.
// A peer's memfd host region mapped here. Copies between it and our GPU run at the copy
// engine's full speed, and asynchronously, only from page-locked memory: pin() registers the
// mapping with CUDA once, on its first such copy (nvlink.pin_host_mappings), and it is
// unregistered before the unmap. An op whose async copy uses it holds it (Inflight::keep).
struct HostMapping {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  // Registers the mapping with CUDA on the first call; true if it is page-locked. Only a
  // mapping whose pages are all in memory is locked (locking faults every page in, and a
  // peer must not make us commit memory it never touched); a failure is logged once and the
  // copies stay pageable, as without the parameter.
  bool pin();
  ~HostMapping();

 private:
  std::once_flag pin_once_;
  bool pinned_ = false;
};

// One of the peer's cuda allocations mapped here, and the regions that use it: the mapping is
// reused for a new region only while one of them is still registered (else the owner may have
// freed the allocation and made a new one at the same address).
struct ImportRec {
  std::shared_ptr<cu::Import> imp;
  uint64_t buffer_id = 0;  // the owner's driver id of the allocation imported
  std::vector<std::pair<uint32_t, uint64_t>> users;  // (lease slot, region id)
};

// Fields of the owner's description of a region (peer_view.cpp); the transport reads the
// peer's info with string_field too.
uint64_t unsigned_field(const nlohmann::json& j, const char* key, const char* what);
std::string string_field(const nlohmann::json& j, const char* key);

// What endpoints need from their transport (it outlives them).
class NvlinkHost {
 public:
  virtual ~NvlinkHost() = default;
  virtual const Registry& registry() const = 0;
  virtual const std::string& engine_id() const = 0;
  virtual int lease_fd() const = 0;
  virtual void forget(uint64_t token) = 0;
  // Page-locks our engine-allocated host region `e` once (LocalPins); true if it is locked.
  virtual bool pin_local(const RegionEntry& e) = 0;
};

class NvlinkEndpoint final : public EndpointBase,
                             public StreamChannel::Handler,
                             public same_host::ProvenEndpoint,
                             public ProgressSource,
                             public std::enable_shared_from_this<NvlinkEndpoint> {
 public:
  // endpoint.cpp
  NvlinkEndpoint(const EndpointSetup& s, NvlinkHost& host, std::string peer_socket);
  ~NvlinkEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  // ProgressSource (completion.cpp): a thread waiting for one of our futures queries the
  // events of the ops in flight itself and completes those that finished, instead of
  // waiting for the poller thread to wake (7-10 us: half of a lone 1 MiB copy). Only where
  // waiters may poll (spare cores: engine busy_wait) and nvlink.waiters_poll is on; otherwise
  // the poller completes alone.
  std::shared_ptr<ProgressSource> progress_source() override {
    return waiters_complete_ ? std::shared_ptr<ProgressSource>(shared_from_this()) : nullptr;
  }
  bool progress() override { return reap(false); }
  void end_polling(bool satisfied) override;
  std::chrono::microseconds poll_budget() const override { return std::chrono::microseconds(2000); }

  void connect(const ChannelOpener& open) override;
  nlohmann::json attach(int index, const nlohmann::json&) override;
  // The listener's socket carried only the handshake; the same-host socket is the channel.
  // The peer is proven by now: its regions are described in the background (peer_view.cpp).
  bool adopt(int, net::Socket) override;

  // Called by the transport's socket service.
  bool active() const { return active_; }

  void authenticate(net::Socket& sock, const same_host::PeerCred& cred, int lease_fd, const std::string& engine) override;
  nlohmann::json describe_local(uint64_t id, const same_host::PeerCred& cred, int* fd_out) const override;

  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override;

  void close(const Status& why) override;

  // peer_view.cpp
  void peer_updated(const EngineInfo& peer) override;

  // data_path.cpp
  void submit(std::shared_ptr<TransferOp> op) override;

  // post_path.cpp
  Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) override;
  Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) override;
  Status flush(std::chrono::milliseconds timeout) override;
  // post_batch.cpp: runs of small writes and their signals as one batch kernel.
  size_t post_batch(std::span<PostItem> items, std::chrono::milliseconds timeout, Status* error) override;

  // control.cpp
  void send(std::shared_ptr<MessageOp> op) override;
  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override;
  void on_channel_down(StreamChannel&, const Status& why) override { fail(why, true); }

 private:
  // endpoint.cpp
  void proven(pid_t pid);
  void install(net::Socket sock);
  void stop_io() override;

  // peer_view.cpp
  void forget_region(uint64_t id, const Status& why);
  RemoteView view(uint64_t id, int device);
  bool cached_view(uint64_t id, RemoteView* out, Status* why);
  void resolve_known();
  uint8_t* map_cuda(uint64_t id, const nlohmann::json& r, int fd, int device, RemoteView& rv);

  // data_path.cpp
  void start(const std::shared_ptr<TransferOp>& op, uint64_t token, bool background);
  int op_device(const TransferOp& op);
  Status resolve(const TransferOp& op, int* device, std::unordered_map<uint64_t, RemoteView>* out, bool may_block,
                 bool* missing);
  Status hold_leases(const std::unordered_map<uint64_t, RemoteView>& views, LeaseHold& h);
  cudaStream_t stream(int device, size_t lane);
  cudaEvent_t take_event(int device);
  void give_event(int device, cudaEvent_t e);
  static int local_device(const TransferOp& op, const uint8_t* p);
  Status enqueue(const TransferOp& op, cudaStream_t user, Inflight* f,
                 const std::unordered_map<uint64_t, RemoteView>& views);
  cudaStream_t stream_at(const CopyPlan& c, int k);
  void copy_mapped_host(CopyPlan& c, const Seg& g, const RemoteView& rv);
  Status copy_unmapped_host(CopyPlan& c, const Seg& g, const RemoteView& rv, Inflight& f);
  void copy_cuda(CopyPlan& c, const Seg& g, const RemoteView& rv);
  void post_pulls(Inflight* f, const std::vector<same_host::PullPiece>& pulls,
                  std::vector<std::shared_ptr<std::vector<uint8_t>>> staged);

  // completion.cpp
  void settle(Inflight& f, Status st);
  Status take_pull_ack(const FrameHeader& h, PayloadReader& payload);
  static cudaError_t events_done(const Inflight& f);
  void complete(Inflight& f, cudaError_t e);
  // Moves the submitted ops into running_ and completes those whose events fired (outside the
  // lock); the poller blocks for the lock, a waiter only tries it. True if any completed.
  bool reap(bool block);
  void wake_poller();
  void drain_active();
  void finish_all(Inflight& f, const Status& st);
  void send_imm(uint64_t token, const std::shared_ptr<TransferOp>& op) override;
  void poll();
  void run_background();

  // control.cpp
  Status serve_rts(StreamChannel& ch, const FrameHeader& h);
  Status serve_pull(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload);
  Status serve_signal(StreamChannel& ch, const FrameHeader& h);

  // post_path.cpp
  Status post_view(uint64_t id, RemoteView* rv);
  Status post_failure();
  std::shared_ptr<PostOp> take_post();
  void post_finished(const std::shared_ptr<TransferOp>& op, const Status& st);
  PostStream* post_stream(int device);
  void peer_access_locked(int from, int to);
  void mark_locked(PostStream& ps);
  cudaError_t seq_mark_state(PostStream& ps, const PostStream::Mark& m);
  void mark_all_locked();
  Status enqueue_post_locked(PostOp& op, uint64_t token, const uint8_t* src, uint8_t* dst, uint64_t n);
  Status launch_signal_locked(PostOp& op, uint64_t token, bool mark_now);
  Status wait_other_streams_locked(PostStream& ps);
  Status check_write(const PostWrite& w, RemoteView* rv);
  Status check_signal(const PostSignal& s, RemoteView* rv);

  // post_batch.cpp
  // In the run; posted (or failed) by the single call; or: launch the run, then try again.
  enum class Batched { kAdded, kSingle, kLaunchFirst };
  Batched batch_write(PostWrite& w, const RemoteView& rv, std::chrono::milliseconds timeout, size_t index, Status* st);
  Batched batch_signal(const PostSignal& s, const RemoteView& rv, std::chrono::milliseconds timeout, size_t index,
                       Status* st);
  Status batch_admit(std::chrono::milliseconds timeout, size_t index);
  Batched batch_enter(const RemoteView& rv, uint64_t id, std::chrono::milliseconds timeout, size_t index, Status* st);
  Status batch_start_locked(PostStream* ps, size_t index, bool copy);
  Status launch_group(size_t* failed_at, bool mark_now);
  Status launch_group_locked(uint64_t token, bool mark_now);
  void group_join_locked(PostStream* ps, size_t index);
  void batch_leave(uint32_t slot, const Status& st);
  bool sm_reach_locked(int from, int to);
  void launch_deferred_signal(uint64_t token);
  void send_signal_frame(uint64_t token, uint64_t region, uint64_t offset, uint64_t add);
  Status owner_post_done(uint64_t token, const Status& st);
  bool poll_posts();
  void stop_posts();


  NvlinkHost& host_;
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
  std::chrono::microseconds poller_spin_{200};  // nvlink.poller_spin_us
  bool pin_host_ = true;  // nvlink.pin_host_mappings
  bool poll_waiters_ = false;
  bool waiters_complete_ = false;  // poll_waiters_ and nvlink.waiters_poll: we are a ProgressSource
  std::unique_ptr<StreamChannel> control_;
  std::atomic<std::chrono::steady_clock::rep> moving_{0};  // when work of ours last completed
  void moved() { moving_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed); }

  std::mutex mu_;
  std::condition_variable cv_;
  PeerLeases leases_;  // declared before inflight_: destroyed after the ops holding leases
  std::deque<Inflight> inflight_;
  // Ops whose copies are in flight, polled by the poller and by waiting threads (reap()).
  // Lock order: act_mu_, then mu_.
  std::mutex act_mu_;
  std::deque<Inflight> running_;
  std::atomic<size_t> running_n_{0};
  std::atomic<int> reaping_{0};  // threads completing ops they took out of active_
  // Work the poller does off the submitting threads (peer_view.cpp, data_path.cpp): ops whose
  // peer regions are not described yet, and describing the peer's regions after accept.
  std::deque<std::pair<std::shared_ptr<TransferOp>, uint64_t>> deferred_;
  bool resolve_wanted_ = false;
  bool stop_ = false;
  std::atomic<bool> stop_flag_{false};
  std::atomic<bool> has_work_{false};
  std::thread poller_;

  std::mutex res_mu_;
  std::map<std::pair<int, size_t>, cudaStream_t> streams_;
  std::map<int, std::vector<cudaEvent_t>> event_pool_;

  std::mutex map_mu_;
  std::unordered_map<uint64_t, RemoteView> views_;   // peer region id -> its owner's description
  std::unordered_map<uint64_t, Status> view_errors_;  // why describing a peer region failed last
  std::vector<uint64_t> known_;                       // the peer's regions in its latest info
  std::unordered_map<uint64_t, ImportRec> imports_;  // peer allocation base -> its mapping here

  std::mutex pull_mu_;
  std::unordered_map<uint64_t, std::shared_ptr<PullState>> pulls_;  // op token -> its PULL_WRITEs

  // The thin post path (post_path.cpp). post_mu_ guards the post streams; the poller and
  // the thread that issues a deferred signal take it too. Lock order: post_mu_, mu_, res_mu_.
  std::mutex post_mu_;
  std::vector<std::unique_ptr<PostStream>> post_streams_;
  size_t mark_every_ = 16;
  size_t unmarked_total_ = 0;  // posts on every post stream that no mark covers yet
  PostStream* last_post_stream_ = nullptr;  // where the last stream copy went: a signal kernel follows it
  bool posts_stopped_ = false;              // stop_posts() ran: nothing more is enqueued
  std::atomic<size_t> post_marks_{0};       // marks the poller has to watch
  std::atomic<int> flushing_{0};            // flushes waiting: every post is marked at once
  uint64_t peer_enabled_[64] = {};          // bit `to` of [from]: enable_peer_access ran (post_mu_)
  uint64_t peer_reach_[64] = {};            // bit `to` of [from]: a kernel on `from` reaches `to` (post_mu_)
  uint64_t peer_known_[64] = {};            // bit `to` of [from]: peer_reach_ says (post_mu_)
  bool post_batching_ = true;               // nvlink.post_batch
  uint64_t post_sm_copy_max_ = 64 << 10;    // nvlink.post_sm_copy_max
  PostGroup group_;                         // post_batch's run being collected (the poster's)
  // Writes the owner executes (PULL_WRITE) counted for signal kernels, which must not run
  // before the owner answered them (sequencer_, the base's, counts our stream copies for
  // signals sent as frames, which must not leave before those copies are done).
  SignalSequencer owner_seq_;
  std::vector<std::pair<PostStream::Entry, cudaError_t>> done_entries_;  // poller only
  std::vector<PostSignal> ready_frames_;         // poller only: signals now due, as frames
  std::vector<PostSignal> ready_kernels_;        // control channel only: signal kernels now due
  std::mutex free_mu_;
  std::vector<std::shared_ptr<PostOp>> free_posts_;

  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace sluice::detail::nvlink
