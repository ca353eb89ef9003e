// The core side of an endpoint: validation, planning, message matching, failure handling.
// The bytes are moved by the TransportEndpoint it owns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "core/endpoint_counters.hpp"
#include "core/engine_info.hpp"
#include "core/message_matcher.hpp"
#include "sluice/endpoint.hpp"
#include "sluice/engine.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {

class EngineImpl;

class EndpointImpl final : public EndpointEvents, public std::enable_shared_from_this<EndpointImpl> {
 public:
  // `counters`: those of the endpoint this one replaces (reconnection), else fresh ones.
  EndpointImpl(std::shared_ptr<EngineImpl> engine, const Transport* kind, EngineInfo peer, uint64_t token, int channels,
               std::shared_ptr<EndpointCounters> counters = nullptr);
  ~EndpointImpl() override;

  void set_transport(std::shared_ptr<TransportEndpoint> t) {
    transport_ = std::move(t);
    progress_ = transport_ ? transport_->progress_source() : nullptr;
  }
  TransportEndpoint& transport() { return *transport_; }

  Future transfer(OpKind kind, const Batch& batch, uint32_t imm, const OpOptions& options = {});
  Future send(MemoryHandle h, uint64_t offset, uint64_t length, const OpOptions& options = {});
  Future recv(MemoryHandle h, uint64_t offset, uint64_t length, const OpOptions& options = {});
  Future imm_recv();
  // The thin post path (Endpoint::post_write etc.): throw Error, like the public calls.
  void post_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                  uint64_t length);
  void post_signal(RemoteHandle remote, uint64_t offset, uint64_t add);
  PostBatchResult post_batch(std::span<const PostRequest> requests);
  void flush(std::chrono::milliseconds timeout);

  std::optional<RemoteHandle> remote_region(const std::string& name) const;
  std::vector<RegionInfo> remote_regions() const;
  void set_peer(EngineInfo peer);
  RemoteHandle import_region(const std::string& descriptor);
  // Asks the engine's directory for the peer's current info (on the caller's thread: the
  // application asked for it) and hands it to the transport through peer_updated(). Throws
  // kPeerLost if the target now names another engine; with `fail_if_moved` this endpoint
  // fails with it first (its peer no longer answers to the target: a reconnecting endpoint
  // then moves to the new engine).
  void refresh(bool fail_if_moved = false);
  // What refresh() asks the directory for: the target this side connected to (for the
  // listener directory the "host:port" it dialed, never the "listen" address a peer's info
  // names: a hostile peer could name a third party).
  std::string peer_ref() const {
    std::lock_guard<std::mutex> lk(peer_mu_);
    return peer_ref_;
  }
  void set_peer_ref(std::string ref) {
    std::lock_guard<std::mutex> lk(peer_mu_);
    peer_ref_ = std::move(ref);
  }
  // The peer dialed this endpoint (no ref of ours): the side a channel replace may name.
  bool accepted() const {
    std::lock_guard<std::mutex> lk(peer_mu_);
    return peer_ref_.empty();
  }

  // Reconnection (ConnectOptions::reconnect; endpoint_reconnect.cpp). The Endpoint handle
  // holds the endpoint connect() returned, its "head"; after a failure the head connects
  // again and keeps the new endpoint as its successor, to which the handle's calls go from
  // then on. Set by EngineImpl::connect before the endpoint is handed out.
  void enable_reconnect(const ConnectOptions& options) {
    reconnect_options_ = options;
    reconnect_options_.reconnect = false;  // a successor does not chain its own
    reconnect_ = true;
  }
  // The endpoint the handle's calls go to: this one, or its successor (kept alive by `hold`).
  // With `connect_again`, a current endpoint that failed with a reconnectable error is first
  // replaced by a new connection (on this thread, within the connect timeout), or Error is
  // thrown naming both failures.
  EndpointImpl& live(std::shared_ptr<EndpointImpl>& hold, bool connect_again) {
    if (!has_successor_.load(std::memory_order_acquire) &&
        (!reconnect_ || failed_code_.load(std::memory_order_acquire) == 0))
      return *this;
    return live_slow(hold, connect_again);
  }
  // The thin post path reports a failure through flush(): posts made since the last flush
  // block reconnection until flush() has thrown it (so that it is never lost).
  void note_posts() { unflushed_posts_.store(true, std::memory_order_relaxed); }
  void note_flushed() { unflushed_posts_.store(false, std::memory_order_relaxed); }
  bool reconnects() const { return reconnect_; }

  const std::string& transport_name() const { return transport_name_; }
  Capabilities capabilities() const { return kind_->capabilities(); }
  int channels() const { return channels_; }
  uint64_t token() const { return token_; }
  std::string peer_engine_id() const;
  bool connected() const { return failed_code_.load() == 0; }
  EndpointMetrics metrics() const;
  // Idempotent and safe from any thread, concurrently with the watchdog, a peer failure and
  // Engine::close(): the transport is closed exactly once (see close_transport()).
  void close(const Status& why);
  void engine_forget();
  // Endpoint::close(): this endpoint and its successor, and no reconnection after it.
  void close_chain(const Status& why);
  // Watchdog: per-operation deadlines (an op with no progress of its own for `timeout` fails
  // and the peer is declared lost), receive deadlines (recv_timeout) and stalled writers.
  void check_progress(std::chrono::milliseconds timeout);

  // EndpointEvents
  const Registry& registry() const override;
  MessageMatcher& matcher() override { return matcher_; }
  void on_failure(const Status& why) override;

 private:
  EndpointImpl& live_slow(std::shared_ptr<EndpointImpl>& hold, bool connect_again);
  void check_usable() const;
  // Throws (kInvalidArgument, kUnsupported) unless this transport can honour `options` on an
  // op of `kind`; the message names the transport and the missing capability.
  void check_options(const OpOptions& options, OpKind kind, const char* what) const;
  // Closes the transport once. A second caller waits until the first has finished (it never
  // joins the transport's threads itself); a transport thread does not wait (the first
  // closer may be joining it).
  void close_transport(const Status& why);
  // `count`: the op is one of this endpoint's operations (EndpointMetrics), set before any
  // thread can complete it.
  void prepare(FutureState& f, bool count = true) const;
  void check_post(const char* what) const;
  // A post_write / post_signal checked and resolved as the single calls do (throw Error).
  PostWrite make_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                       uint64_t length);
  PostSignal make_signal(RemoteHandle remote, uint64_t offset, uint64_t add);
  // The peer's region `remote`, checked for [offset, offset + length); call under peer_mu_.
  const RegionInfo& remote_locked(RemoteHandle remote, uint64_t offset, uint64_t length, const char* what) const;
  // `index`: the assignment's index in its batch, named in errors (-1: none).
  RegionPin pin_local(MemoryHandle h, uint64_t offset, uint64_t length, const char* what, long index) const;

  std::shared_ptr<EngineImpl> engine_;
  const Transport* kind_ = nullptr;
  const std::string transport_name_;
  const uint64_t token_;
  const int channels_;
  std::shared_ptr<TransportEndpoint> transport_;
  std::weak_ptr<ProgressSource> progress_;
  MessageMatcher matcher_;
  std::shared_ptr<EndpointCounters> counters_;

  mutable std::mutex peer_mu_;
  EngineInfo peer_;
  std::unordered_map<uint64_t, PeerRegion> remote_;
  std::unordered_map<std::string, uint64_t> remote_names_;  // name -> id, kept with remote_
  std::unordered_map<uint64_t, PeerRegion> imported_;  // import_region(), kept across set_peer
  std::string peer_ref_;  // empty: an accepted endpoint, refresh() asks for the peer's own ref

  std::chrono::microseconds busy_wait_{0};
  std::mutex post_mu_;  // one poster at a time (the transports' post contract)
  std::vector<PostItem> batch_items_;  // post_batch's items, reused (post_mu_)
  std::mutex send_mu_;  // orders sequence numbering with hand-over to the transport
  std::atomic<uint64_t> send_seq_{0};
  std::atomic<unsigned> rotate_{0};
  std::atomic<int> failed_code_{0};
  mutable std::mutex fail_mu_;
  Status failure_;
  std::mutex close_mu_;
  std::condition_variable close_cv_;
  enum class CloseState { kOpen, kClosing, kClosed } close_state_ = CloseState::kOpen;
  std::thread::id closer_;  // the thread running transport_->close()

  // Reconnection state, on the head only (see enable_reconnect()).
  bool reconnect_ = false;
  ConnectOptions reconnect_options_;
  std::atomic<bool> has_successor_{false};
  std::atomic<bool> unflushed_posts_{false};
  std::mutex reconnect_mu_;  // guards what follows; held while connecting again
  std::shared_ptr<EndpointImpl> successor_;
  std::chrono::steady_clock::time_point last_attempt_{};
  std::chrono::steady_clock::duration last_attempt_took_{};
  std::string last_attempt_error_;  // empty: the last attempt succeeded (or none was made)
  bool user_closed_ = false;
};

}  // namespace sluice::detail
