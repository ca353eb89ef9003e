// The one internal interface every transport implements. A transport lives in its own folder
// under src/transport/<name>/ and registers itself with SLUICE_REGISTER_TRANSPORT; the core
// never names a transport.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "bootstrap/socket.hpp"
#include "core/batch_plan.hpp"
#include "core/engine_info.hpp"
#include "core/future_state.hpp"
#include "core/inline_vec.hpp"
#include "core/message_matcher.hpp"
#include "core/registry.hpp"
#include "sluice/config.hpp"

namespace sluice::detail {

class PostTracker;

// A validated read / write / write_with_imm, already split into one lane per channel.
// Ops of the thin post path are TransferOps too where a transport finds that convenient:
// they carry `post` instead of a future (see PendingOps).
struct TransferOp {
  OpKind kind = OpKind::kWrite;
  uint32_t imm = 0;
  OpOptions options;  // validated against the transport's capabilities before submit
  std::vector<Lane> lanes;
  std::shared_ptr<FutureState> future;  // parts = number of non-empty lanes
  InlineVec<RegionPin, 1> pins;         // local regions, held until completion
  uint64_t bytes = 0;
  // Thin post path only (future is null): completion is reported to `post`; a signal
  // (post_signal) is one piece of 8 bytes whose value to add is `signal_add`.
  PostTracker* post = nullptr;
  uint64_t post_epoch = 0;
  bool signal = false;
  uint64_t signal_add = 0;
  Status post_error;  // PendingOps::note_error on a post
  // Channel failover (tcp): bit c set once lane c's frames were handed to channel c, and
  // once lane c finished (PendingOps::lane_done with a lane). A lane posted and not done when
  // its channel is replaced is retried or failed (PendingOps::open_on).
  std::atomic<uint64_t> posted_lanes{0};
  uint64_t done_lanes = 0;  // under PendingOps' lock
  // tcp, kRead: a read of the rest of a striped message the peer is sending (SEND_PULL
  // frames; a piece's remote_id is the message's sequence, remote_offset the offset in it),
  // not of a region.
  bool message_pull = false;
};

// The thin post path (Capabilities::rma_post): what a proxy posts, one request per call.
// The core has checked handles, bounds and capabilities, and pinned the local region.
struct PostWrite {
  RegionPin pin;            // the local region, held until the write completed
  const uint8_t* src = nullptr;
  Piece dst;                // dst.local == src; remote id, offset, addr and length
};
struct PostSignal {
  uint64_t remote_id = 0;
  uint64_t remote_offset = 0;  // 8-byte aligned, offset + 8 within the region
  uint64_t remote_addr = 0;    // the peer's virtual address of remote_offset
  uint64_t add = 0;
  Location location;           // where the peer's counter lives
};
// One request of a batch (post_batch): a write or a signal.
struct PostItem {
  bool signal = false;
  PostWrite write;     // !signal
  PostSignal sig;      // signal
};

// What a transport endpoint reports up to the core endpoint that owns it.
class EndpointEvents {
 public:
  virtual ~EndpointEvents() = default;
  virtual const Registry& registry() const = 0;  // target side: validate incoming requests
  virtual MessageMatcher& matcher() = 0;         // incoming sends and imms
  // The transport lost its peer (or found it hostile); the core fails everything pending.
  virtual void on_failure(const Status& why) = 0;
};

// Opens channel `index` to the peer's listener for this endpoint; sends `hello` (merged with
// the routing fields) and returns the socket with the peer's reply.
using ChannelOpener = std::function<std::pair<net::Socket, nlohmann::json>(int index, const nlohmann::json& hello)>;

struct EndpointSetup {
  bool active = true;      // we connected (true) or the peer did (false)
  uint64_t token = 0;      // identifies the endpoint on both sides
  int channels = 1;
  EngineInfo peer;
  EndpointEvents* events = nullptr;  // outlives the transport endpoint
  EngineConfig config;
};

class TransportEndpoint {
 public:
  virtual ~TransportEndpoint() = default;
  // Active side: open every channel (blocking, bounded by the connect timeout); throws Error.
  virtual void connect(const ChannelOpener& open) = 0;
  // Passive side, in two steps, because the engine (not the transport) answers the peer:
  // 1. attach(): channel `index` arrived through the listener with `hello`. Check it, claim
  //    the channel and return the body of the reply; throw Error to refuse (the engine sends
  //    the refusal). The socket is not the transport's yet, so nothing it does can race the
  //    reply's bytes on it.
  // 2. adopt(): the engine sent the reply; the transport takes the socket (or drops it) and
  //    returns true once every channel is attached. Not called when the reply could not be
  //    sent: the engine's watchdog then drops the half-open endpoint.
  virtual nlohmann::json attach(int index, const nlohmann::json& hello) = 0;
  virtual bool adopt(int index, net::Socket sock) = 0;
  virtual void submit(std::shared_ptr<TransferOp> op) = 0;
  virtual void send(std::shared_ptr<MessageOp> op) = 0;
  // The thin post path (transports with Capabilities::rma_post; the defaults refuse). The
  // contract, shared by every transport (tests/transport/post_test.cpp checks it):
  // - The core calls these from one thread at a time per endpoint (it serialises posters).
  // - post_write() returns once the write is accepted; with post.depth posts outstanding it
  //   first waits for one to finish, at most `timeout` (then kTimeout, nothing posted).
  // - post_signal() raises the peer's 64-bit counter by `add` once every byte of every
  //   earlier post_write of this endpoint is visible at the peer; it never blocks for that
  //   (the transport sequences it). A waiter on the counter that sees the new value and
  //   then reads the data sees the data.
  // - flush() returns once every earlier post finished, with the first error any of them met
  //   since the last flush (then forgotten), or kTimeout after `timeout` (posts stay
  //   outstanding). After the endpoint failed every call returns its failure.
  // - No allocation and no FutureState per post in the steady state.
  virtual Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) {
    return {ErrorCode::kUnsupported, "this transport has no thin post path"};
  }
  virtual Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) {
    return {ErrorCode::kUnsupported, "this transport has no thin post path"};
  }
  virtual Status flush(std::chrono::milliseconds timeout) {
    return {ErrorCode::kUnsupported, "this transport has no thin post path"};
  }
  // The items in order, exactly as post_write / post_signal one by one (same contract, same
  // ordering, `timeout` for each wait on post.depth); returns how many were posted. It stops
  // at the first item that fails: *error is its status and no item after it is posted. A
  // transport overrides it to turn a run of small posts into fewer operations (nvlink: one
  // kernel); this default is the loop, so every transport with a post path has the call.
  virtual size_t post_batch(std::span<PostItem> items, std::chrono::milliseconds timeout, Status* error) {
    for (size_t i = 0; i < items.size(); ++i) {
      Status st = items[i].signal ? post_signal(items[i].sig, timeout) : post_write(std::move(items[i].write), timeout);
      if (!st.ok()) {
        *error = std::move(st);
        return i;
      }
    }
    return items.size();
  }
  // The peer's info changed (hello reply, refresh_remote_regions): new regions, new keys.
  virtual void peer_updated(const EngineInfo& peer) {}
  // What a waiter on this endpoint's futures may poll instead of sleeping (nullptr: nothing,
  // completions arrive from the transport's own threads).
  virtual std::shared_ptr<ProgressSource> progress_source() { return nullptr; }
  // Operations submitted and not yet completed.
  virtual size_t pending() const = 0;
  // Whether attach() takes a CHANNEL with "replace" (tcp channel failover); the engine refuses
  // one for endpoints whose transport says no.
  virtual bool replaces_channels() const { return false; }
  // Channel failover (EndpointMetrics): channels replaced, operations sent again.
  virtual std::pair<uint64_t, uint64_t> failover_counts() const { return {0, 0}; }
  // When the peer last showed progress (for the engine's watchdog).
  virtual std::chrono::steady_clock::time_point last_progress() const = 0;
  // Watchdog: fail (kTimeout) what is overdue at `now` and return how many problems were found
  // (0: none); *what describes them. The core then declares the peer lost. Transports whose
  // ops live in PendingOps override this with per-operation deadlines (PendingOps::expire:
  // an op is overdue when it saw no progress of its own for `timeout`); this default keeps
  // the old endpoint-level rule (anything pending and no progress at all for `timeout`).
  virtual size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                            std::string* what) {
    if (pending() == 0) return 0;
    auto idle = now - last_progress();
    if (idle < timeout) return 0;
    if (what)
      *what = "no progress from peer for " +
              std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(idle).count()) + " ms (op timeout " +
              std::to_string(timeout.count()) + " ms)";
    return pending();
  }
  // Fail everything pending with `why` and stop; idempotent; joins the transport's threads.
  virtual void close(const Status& why) = 0;
};

// True on a transport's own threads (they deliver completions and may run user callbacks
// that close the endpoint): such a thread must never wait for a close that joins it.
inline thread_local bool tls_transport_thread = false;

// What a transport may use from its engine.
struct EngineContext {
  const EngineConfig* config = nullptr;
  const Registry* registry = nullptr;
  std::string host_id;
  std::string engine_id;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // Higher is preferred when several transports reach a peer.
  virtual int priority() const = 0;
  virtual bool supports(const Location& location) const = 0;
  // What this transport can do. The core checks each op's options against it before submit
  // (an op never reaches a transport that cannot honour its options); code above the engine
  // reads it through Endpoint::capabilities() instead of comparing names.
  virtual Capabilities capabilities() const = 0;
  // This transport's part of the engine info blob.
  virtual nlohmann::json local_address() const = 0;
  // Whether this transport can reach `peer`; otherwise *why says why not.
  virtual bool can_reach(const EngineInfo& peer, std::string* why) = 0;
  virtual std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) = 0;
  // Region lifecycle (NIXL's registerMem / getPublicData / deregisterMem). region_added():
  // the engine registered `e`; it is published only after every transport returned. The
  // result is what peers need to reach the region through this transport (rdma: its rkey on
  // every rail), published with the region in the info blob; null: nothing.
  virtual nlohmann::json region_added(const RegionEntry& e) { return nullptr; }
  // The region is unregistered and no local operation pins it any more: return once no peer
  // can reach it through this transport (rdma: peers acknowledged GONE, MRs deregistered).
  virtual void region_removed(const RegionEntry& e) {}
};

struct TransportFactory {
  std::string name;
  // Returns nullptr (with *why) when the transport cannot run on this host.
  std::function<std::unique_ptr<Transport>(const EngineContext&, std::string* why)> make;
};

// Transports register at load time; creation happens only when an Engine is built.
std::vector<TransportFactory>& transport_factories();
bool register_transport(TransportFactory factory);

}  // namespace sluice::detail

#define SLUICE_REGISTER_TRANSPORT(ident, name, fn) \
  static const bool sluice_transport_registered_##ident = ::sluice::detail::register_transport({name, fn})
