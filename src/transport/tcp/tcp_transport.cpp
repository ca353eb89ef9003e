// tcp: N persistent connections per endpoint. Requests and responses are frames (see
// transport/common/frame.hpp); payloads move between the socket and registered memory with
// no intermediate copy. Both sides of an endpoint may issue operations on the same sockets.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/log.hpp"
#include "core/params.hpp"
#include "cuda/staging.hpp"
#include "transport/common/control_frames.hpp"
#include "transport/common/endpoint_base.hpp"
#include "transport/common/signal_target.hpp"
#include "transport/common/staging_endpoint.hpp"
#include "transport/common/stream_channel.hpp"
#include "transport/common/redialer.hpp"
#include "transport/transport.hpp"
#include "transport/tcp/stall_rule.hpp"

namespace sluice::detail {
namespace {

#ifndef TCP_RTO_MAX_MS
#define TCP_RTO_MAX_MS 44  // Linux >= 6.15 (include/uapi/linux/tcp.h)
#endif

// -1 = auto (below); 0 = the kernel's default; else 1000..120000 ms (the kernel's floor is 1 s).
Parser<int> rto_max_ms() {
  return [](const std::string& where, const std::string& text) {
    int v = int_in(-1, 120000)(where, text);
    if (v > 0 && v < 1000) param_error(where, text, "must be -1 (auto), 0 or 1000..120000 (the kernel's range)");
    return v;
  };
}

// Why: during an outage TCP backs its retransmission timeout off (200, 400, 800, 1600 ms, ...)
// and nothing retransmits when the link comes back, so a surviving connection resumes only
// at its next retransmission, up to one (doubled) interval after link-up. Capping the
// interval bounds that wait (docs/cluster.md, "Measured recovery").
const Param<int> kRtoMaxMs{"tcp.rto_max_ms", "SLUICE_TCP_RTO_MAX_MS", -1, rto_max_ms(),
                           "cap on a channel's TCP retransmission back-off (TCP_RTO_MAX_MS, Linux >= 6.15): after "
                           "an outage the next retransmission comes at most this long after the link is back. "
                           "-1 = auto: the smallest cap >= 1000 ms with which the kernel still gives a stalled "
                           "connection 1.5 x op_timeout; 0 = the kernel's (net.ipv4.tcp_rto_max_ms, 120 s)"};

// Channel failover (docs/cluster.md, "Channel failover"). Why 300 ms: a healthy LAN peer
// answers in well under a millisecond, and even a loaded one (2 shared cores, sanitizers)
// rarely stays silent 300 ms with answers owed; after a link flap the replacement is dialed
// at once and its SYN leaves every connect.retry_ms (200 ms), so recovery is bounded by
// about that SYN interval plus a round trip, not by the kernel's backed-off retransmission
// (up to 1 s with tcp.rto_max_ms at its floor).
const Param<int> kFailoverMs{"tcp.failover_ms", "SLUICE_TCP_FAILOVER_MS", 300, int_in(0, 600000),
                             "a tcp channel that owes answers to our requests and has moved no byte for this long "
                             "(when an op on it may not be retried: and whose socket is retransmitting, or silent for "
                             "op_timeout / 2) is replaced "
                             "by a fresh connection, dialed by the side that connected; 0 = never"};
// Why 0: fixed 8 MiB buffers (set, they switch the kernel's autotuning off) measured 10-25 %
// slower than autotuned ones for lone 16-64 MiB operations and large batches on loopback,
// the bytes in flight outgrowing the cache between the two copies (docs/performance.md).
const Param<int> kSocketBuffer{"tcp.socket_buffer", "SLUICE_TCP_SOCKET_BUFFER", 0, int_in(0, 1 << 30),
                               "SO_SNDBUF and SO_RCVBUF of each tcp channel, bytes; 0 = the kernel's autotuning "
                               "(net.ipv4.tcp_wmem / tcp_rmem; raise their maxima for long fat links)"};
const Param<bool> kRetryRma{"tcp.retry_rma", "SLUICE_TCP_RETRY_RMA", true, boolean(),
                            "reads and writes caught on a replaced tcp channel are sent again on the new one "
                            "(counted as retries); off: they fail. send, write_with_imm and post_signal never are"};

// Why: a pair's SENDs keep their order on channel 0, one TCP stream, which moved 4.1 GB/s on
// the 2-core loopback host where two streams moved 5.9 (docs/peers.md, "What is left").
const Param<uint64_t> kSendStripeMin{"tcp.send_stripe_min", "SLUICE_TCP_SEND_STRIPE_MIN", 1 << 20,
                                     size_in(0, 1ull << 40),
                                     "a SEND of at least this many bytes, on an endpoint of 2 or more channels, is "
                                     "striped: its first 1/channels goes with its header on channel 0 (which keeps "
                                     "messages in order) and the receiver reads the rest from the sender's message "
                                     "over the other channels (SEND_PULL); 0 = every SEND whole on channel 0"};

const Param<int> kTestMuteChannel{"tcp.test_mute_channel", "SLUICE_TCP_TEST_MUTE_CHANNEL", -1, int_in(-1, 63),
                                  "test only: on accepted endpoints, the first connection of this channel reads the "
                                  "peer's requests and never answers them (a stall without a link to break); -1 = off",
                                  ParamScope::kTest};

// A positive number in a /proc/sys file, else `fallback`. read(2) and strtol, not iostreams:
// the torch backend links the engine's objects into a module that torch's process loads, and
// there `std::ifstream >> int` crashed (SIGSEGV in the locale's number parsing) on the H100
// machine's image, in every tcp connect.
int sysctl_int(const char* path, int fallback) {
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fallback;
  char buf[32] = {};
  ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return fallback;
  char* end = nullptr;
  long v = std::strtol(buf, &end, 10);
  return end != buf && v > 0 && v <= INT32_MAX ? static_cast<int>(v) : fallback;
}

// How long the kernel lets data stay unacknowledged before it drops the connection, without
// the cap: tcp_retries2 retransmissions backing off from 200 ms to net.ipv4.tcp_rto_max_ms,
// as the kernel models it (tcp_model_timeout; about 924.6 s with the defaults, 15 and 120 s).
// The model uses the socket's own cap, so the cap alone would cut this to about 14 s (a 20 s
// outage dropped the connection 14.8 s in, "Connection timed out"); TCP_USER_TIMEOUT set to
// it keeps the kernel's give-up time what it was. op_timeout is the engine's own limit.
// tcp_model_timeout: `retries` retransmissions (or window probes) backing off from 200 ms up
// to `cap` ms, in ms.
int64_t model_ms(int64_t retries, int64_t cap) {
  constexpr int64_t kRtoMin = 200;
  int64_t thresh = 0;
  while ((kRtoMin << (thresh + 1)) <= cap) ++thresh;  // ilog2(cap / kRtoMin)
  return retries <= thresh ? ((int64_t{2} << retries) - 1) * kRtoMin
                           : ((int64_t{2} << thresh) - 1) * kRtoMin + (retries - thresh) * cap;
}

// tcp.rto_max_ms -1. TCP_USER_TIMEOUT (below) lengthens the give-up time of retransmissions,
// not of window probes (tcp_probe_timer stops after tcp_retries2 of them whatever the user
// timeout), and probes back off under the same cap: about 14 s with a 1 s cap. A 20 s
// outage with op_timeout 60 s and a 1 s cap reset 2 of 7 connections, most likely so (the
// peer whose link was down had probed; not verified). So the cap is the smallest that
// leaves tcp_retries2 back-offs 1.5 x op_timeout:
// 1000 ms up to op_timeout 9.6 s, 3600 ms for the default 30 s, 7800 ms for 60 s.
int auto_rto_max_ms(std::chrono::milliseconds op_timeout) {
  if (op_timeout.count() <= 0) return 0;
  const int64_t retries = sysctl_int("/proc/sys/net/ipv4/tcp_retries2", 15);
  const int64_t want = op_timeout.count() * 3 / 2;
  for (int64_t cap = 1000; cap < 120000; cap += 100)
    if (model_ms(retries, cap) >= want) return static_cast<int>(cap);
  return 0;
}

int uncapped_give_up_ms() {
  const int64_t retries = sysctl_int("/proc/sys/net/ipv4/tcp_retries2", 15);
  const int64_t ms = model_ms(retries, sysctl_int("/proc/sys/net/ipv4/tcp_rto_max_ms", 120000));
  return static_cast<int>(std::min<int64_t>(ms, INT32_MAX));
}

struct ReadPiece {
  uint64_t token;
  uint8_t* dest;
  uint64_t length;
  bool lane_end;
  uint64_t remote_id;      // what to ask again when the channel is replaced
  uint64_t remote_offset;
  bool pull;               // a SEND_PULL (remote_id: the message's sequence), not a READ_REQ
};

struct ImmProgress {
  uint32_t lanes_seen = 0;
  bool failed = false;
};

constexpr size_t kMaxImmInProgress = 1 << 16;
// An unexpected message's buffer grows by at most this much ahead of the bytes that arrived.
constexpr uint64_t kStashChunk = 1 << 20;
// Ops of the thin post path kept for reuse per endpoint (a post in flight holds one; more
// than this many in flight at once allocate, and those are dropped when done).
constexpr size_t kPostOpPool = 4096;

// A TransferOp of the thin post path. `busy` is cleared (release) by the completion handler
// once it no longer touches the op, so a poster that sees it clear (acquire) may refill it.
struct PostOp : TransferOp {
  std::atomic<bool> busy{false};
};

// Read responses at least this large stamp their op's progress before their payload lands
// (smaller ones complete or stamp right after it).
constexpr uint64_t kStampBytes = 64 << 10;

// Channels of one endpoint a waiter borrows at most (its poll set; the rest stay with the
// reactors, whose completions then interrupt the waiter).
constexpr int kMaxLent = WaiterReceive::kMaxLent;

// The channels this thread submitted on since its last wait, per endpoint (the last one it
// used): the ones a waiter borrows (see TcpEndpoint::drive). Only a hint: a completion on
// another channel still reaches the waiter, through interrupt().
struct SubmitHint {
  const void* endpoint = nullptr;
  uint64_t channels = 0;
};
thread_local SubmitHint tls_hint;

class TcpEndpoint final : public EndpointBase,
                          public StreamChannel::Handler,
                          public ProgressSource,
                          public std::enable_shared_from_this<TcpEndpoint> {
 public:
  using Clock = std::chrono::steady_clock;
  TcpEndpoint(const EndpointSetup& s, std::shared_ptr<Redialer> redialer)
      : EndpointBase(s),
        waiter_(busy_wait_of(s.config)),
        redialer_(std::move(redialer)),
        active_(s.active),
        peer_id_(s.peer.engine_id),
        op_timeout_(s.config.op_timeout),
        failover_(kFailoverMs.get(s.config)),
        retry_rma_(kRetryRma.get(s.config)),
        mute_index_(s.active ? -1 : kTestMuteChannel.read()),
        replacing_(new std::atomic<bool>[s.channels]),
        replaced_at_(s.channels),
        nchan_(s.channels),
        max_queued_(static_cast<size_t>(std::max(1, s.config.max_queued_responses))),
        answered_(new std::atomic<Clock::rep>[s.channels]),
        channels_(s.channels),
        reads_(s.channels),
        lane_mu_(s.channels),
        rto_max_ms_(kRtoMaxMs.get(s.config) < 0 ? auto_rto_max_ms(s.config.op_timeout) : kRtoMaxMs.get(s.config)),
        socket_buffer_(kSocketBuffer.get(s.config)),
        stripe_min_(kSendStripeMin.get(s.config)),
        give_up_ms_(rto_max_ms_ ? uncapped_give_up_ms() : 0) {
    pending_.set_post_handler([this](const std::shared_ptr<TransferOp>& op, const Status& st) { post_finished(op, st); });
    for (int c = 0; c < nchan_; ++c) replacing_[c] = false;
  }
  ~TcpEndpoint() override { close({ErrorCode::kCancelled, "endpoint destroyed"}); }

  // ProgressSource: a thread that waits for one of our futures receives on the channels it
  // submitted on itself (StreamChannel::lend), sleeping in poll() on their sockets: the
  // answer is read and its op completed on the waiter's own thread, with no reactor wake-up
  // and no reactor-to-waiter hand-off on the way. A completion that happens elsewhere (a
  // channel it could not borrow, a failure, the watchdog) interrupts the poll.
  std::shared_ptr<ProgressSource> progress_source() override { return shared_from_this(); }
  bool progress() override { return false; }
  std::chrono::microseconds poll_budget() const override { return {}; }
  bool blocking() const override { return true; }
  void interrupt() override { waiter_.interrupt(); }
  bool drive(const std::atomic<bool>& done, Clock::time_point deadline) override;

  void connect(const ChannelOpener& open) override {
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      opener_ = open;  // replacement channels are dialed with it (redial)
    }
    for (int i = 0; i < nchan_; ++i) {
      // Channel 0's hello says that we take striped SENDs; the reply, that the peer does.
      nlohmann::json hello = nlohmann::json::object();
      if (i == 0) hello["send_pull"] = 1;
      auto [sock, reply] = open(i, hello);
      if (i == 0 && reply.is_object() && reply.value("send_pull", 0) == 1) peer_pulls_ = true;
      std::lock_guard<std::mutex> lk(attach_mu_);
      install(i, std::move(sock));
    }
  }

  nlohmann::json attach(int index, const nlohmann::json& hello) override {
    if (hello.is_object() && hello.value("replace", false)) return attach_replacement(index);
    std::lock_guard<std::mutex> lk(attach_mu_);
    if (claimed_[index]) throw Error(ErrorCode::kProtocol, "channel " + std::to_string(index) + " attached twice");
    claimed_[index] = true;
    nlohmann::json reply = nlohmann::json::object();
    if (index == 0 && hello.is_object() && hello.value("send_pull", 0) == 1) {
      peer_pulls_ = true;  // a peer that says so takes striped SENDs
      reply["send_pull"] = 1;  // and so do we
    }
    return reply;
  }

  bool adopt(int index, net::Socket sock) override {
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      if (attached_ < nchan_) {
        install(index, std::move(sock));
        return ++attached_ == nchan_;
      }
    }
    // Every channel was attached: this is a replacement (attach_replacement said yes).
    replace_channel(index, std::move(sock));
    return false;
  }

  void submit(std::shared_ptr<TransferOp> op) override {
    auto keep = op;
    uint64_t token = pending_.add(std::move(op));
    if (!token) return;
    uint64_t used = 0;
    for (size_t c = 0; c < keep->lanes.size() && c < kMaxLent; ++c)
      if (!keep->lanes[c].pieces.empty()) used |= uint64_t{1} << c;
    note_submit(used);
    const bool is_read = keep->kind == OpKind::kRead;
    // Host memory only: our own cuda pieces were staged by StagingEndpoint.
    uint32_t nlanes = 0;
    for (auto& lane : keep->lanes) nlanes += lane.pieces.empty() ? 0 : 1;
    for (size_t c = 0; c < keep->lanes.size(); ++c) {
      auto& pieces = keep->lanes[c].pieces;
      if (pieces.empty()) continue;
      // Held until the lane is posted: responses come back in request order per channel, so
      // concurrent submitters must not reorder requests against reads_; and a replacement
      // (replace_channel) swaps the channel under it, so a lane goes wholly to the old channel
      // (marked posted: the replacement retries or fails it) or wholly to the new one.
      std::lock_guard<std::mutex> lane_lk(lane_mu_[c]);
      StreamChannel* ch = channels_[c].get();
      if (is_read)
        for (size_t i = 0; i < pieces.size(); ++i)
          reads_[c].push_back({token, pieces[i].local, pieces[i].length, i + 1 == pieces.size(),
                               pieces[i].remote_id, pieces[i].remote_offset, keep->message_pull});
      keep->posted_lanes.fetch_or(uint64_t{1} << c, std::memory_order_release);
      post_lane(*ch, token, *keep, c, nlanes);
    }
  }

  // The frames of lane `c` of a read / write / write_with_imm (the caller holds lane_mu_[c]
  // and queued a read's pieces in reads_[c]).
  static void post_lane(StreamChannel& ch, uint64_t token, const TransferOp& op, size_t c, uint32_t nlanes) {
    const bool is_read = op.kind == OpKind::kRead;
    const auto& pieces = op.lanes[c].pieces;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const Piece& p = pieces[i];
      const bool last = i + 1 == pieces.size();
      uint8_t flags = last ? kLaneEnd : 0;
      if (last && op.kind == OpKind::kWriteImm) flags |= kImmPart;
      OutFrame f;
      if (is_read) {
        // A request has no payload; the wanted length rides in imm (low) and aux (high).
        f.hdr = make_frame(op.message_pull ? FrameType::kSendPull : FrameType::kReadReq, token, p.remote_id,
                           p.remote_offset, 0, flags, static_cast<uint32_t>(p.length),
                           static_cast<uint32_t>(p.length >> 32));
      } else {
        const bool imm = op.kind == OpKind::kWriteImm;
        f.hdr = make_frame(FrameType::kWrite, token, p.remote_id, p.remote_offset, p.length, flags,
                           imm ? op.imm : 0, imm ? nlanes : 0);
        f.data = p.local;
      }
      ch.post(std::move(f));
    }
  }

  void send(std::shared_ptr<MessageOp> op) override {
    if (!pending_.add_send(op)) return;
    OutFrame f;
    // Striped (tcp.send_stripe_min): the first 1/channels with the header, in order on
    // channel 0; the receiver reads the rest from op->ptr with SEND_PULL frames on the other
    // channels while we wait for its SEND_ACK (serve_send_pull). Only a SEND that finds no
    // other of ours in flight: behind others, channel 0's stream already keeps both sides
    // busy, and striping measured 0.92x for 1 MiB SENDs 64 x 8, against 1.04-1.22x for lone
    // ones of 1-64 MiB (docs/performance.md).
    const uint64_t head = pending_.sends() > 1 ? op->length : stripe_head(op->length);
    if (head < op->length)
      f.hdr = make_frame(FrameType::kSend, op->seq, 0, 0, head, kPullRest, static_cast<uint32_t>(op->length),
                         static_cast<uint32_t>(op->length >> 32));
    else
      f.hdr = make_frame(FrameType::kSend, op->seq, 0, 0, op->length);
    f.data = op->ptr;  // host memory (StagingEndpoint staged a cuda message)
    note_submit(1);
    std::lock_guard<std::mutex> lane_lk(lane_mu_[0]);  // see submit(): a replacement swaps channels under it
    channels_[0]->post(std::move(f));  // one channel keeps messages in order
  }

  // The thin post path (contract above TransportEndpoint::post_write). Every post goes on
  // channel 0 as one lane; a signal is sent once the writes posted before it were acked
  // (SignalSequencer), so a waiter that sees the counter sees their bytes. The core
  // serialises posters; completions arrive on channel 0's fiber (or fail_all / expire).
  Status post_write(PostWrite&& w, std::chrono::milliseconds timeout) override {
    Status st = posts_.admit(timeout);
    if (!st.ok()) return st;
    auto op = take_post_op();
    op->signal = false;
    op->bytes = w.dst.length;
    op->pins.push_back(std::move(w.pin));
    op->lanes[0].pieces.push_back(w.dst);
    op->lanes[0].bytes = w.dst.length;
    op->post_epoch = sequencer_.write_posted();
    issue_post(std::move(op));
    return Status::Ok();
  }

  Status post_signal(const PostSignal& s, std::chrono::milliseconds timeout) override {
    Status st = posts_.admit(timeout);
    if (!st.ok()) return st;
    if (sequencer_.signal(s)) issue_signal(s);  // else a write_done() hands it out later
    return Status::Ok();
  }

  std::chrono::steady_clock::time_point last_progress() const override {
    auto t = pending_.last_progress();
    std::lock_guard<std::mutex> lk(attach_mu_);
    for (const auto& ch : channels_)
      if (ch) t = std::max(t, ch->last_io());
    return t;
  }

  // Per-operation deadlines (PendingOps::expire), and channels whose writer is stalled: a
  // peer that stops reading keeps frames queued (read responses pin our regions); after
  // op_timeout with no byte accepted the endpoint fails and close() drops them.
  size_t expire_ops(std::chrono::steady_clock::time_point now, std::chrono::milliseconds timeout,
                    std::string* what) override {
    // Counted, not failed here: the endpoint then fails and close() stops the channel
    // threads (which may be landing a read response in an op's memory) before failing ops.
    // An op past its own deadline is spared while a channel it uses keeps answering our
    // requests: answers come in order per channel, so a backlog ahead of it is progress (a
    // peer's own requests, e.g. zero-length writes, are not answers and keep nobody alive).
    auto alive = [&](const TransferOp* op) {
      for (int c = 0; c < nchan_; ++c) {
        bool uses = op ? c < static_cast<int>(op->lanes.size()) && !op->lanes[c].pieces.empty() : c == 0;
        if (uses && now - Clock::time_point(Clock::duration(answered_[c].load(std::memory_order_relaxed))) < timeout)
          return true;
      }
      return false;
    };
    size_t n = pending_.expire(now, timeout, what, /*fail=*/false, alive);
    if (active_ && failover_.count() > 0 && pending_.size() > 0 && !failed() && !closing_.load())
      find_stalls(now);
    std::lock_guard<std::mutex> lk(attach_mu_);
    for (const auto& ch : channels_) {
      if (!ch) continue;
      auto stall = ch->write_stall(now);
      if (stall < timeout) continue;
      if (what && n == 0)
        *what = "tcp channel " + std::to_string(ch->index()) + ": the peer accepted no bytes for " +
                std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(stall).count()) +
                " ms with frames queued (it stopped reading; op_timeout " + std::to_string(timeout.count()) + " ms)";
      ++n;
    }
    return n;
  }

  // Safe from any thread and concurrently (StreamChannel::join serialises joiners and skips
  // the caller's own thread). Operations fail only after the channel threads stopped, so no
  // read response lands in an op's memory after its future completed.
  // closing_ (not the base's failure latch) is set first: the latch would fail the ops at
  // once, and they may fail only after the join. A channel that goes down meanwhile leaves
  // the failing to us (on_channel_down).
  void close(const Status& why) override {
    const bool first = !closing_.exchange(true);
    std::vector<StreamChannel*> chans;  // channels_ slots are filled under attach_mu_
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      for (auto& ch : channels_)
        if (ch) {
          if (first) ch->shutdown();
          chans.push_back(ch.get());
        }
    }
    for (auto* ch : chans) ch->join();
    // A replacement under way finishes (or sees closing_) before the ops fail: it may be
    // re-posting them, and it must not touch events_ after we return.
    std::lock_guard<std::recursive_mutex> rl(replace_mu_);
    if (first) fail(why, /*notify=*/false);
  }

  bool replaces_channels() const override { return true; }
  std::pair<uint64_t, uint64_t> failover_counts() const override { return {replaced_.load(), retried_.load()}; }

  // StreamChannel::Handler
  Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) override {
    if (&ch == muted_) [[unlikely]] {  // tcp.test_mute_channel: requests vanish (payload discarded)
      switch (static_cast<FrameType>(h.type)) {
        case FrameType::kWrite:
        case FrameType::kReadReq:
        case FrameType::kSignal:
        case FrameType::kSendPull:
        case FrameType::kSend: return Status::Ok();
        default: break;
      }
    }
    pending_.touch();
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kReadResp:
      case FrameType::kAck:
      case FrameType::kNack:
      case FrameType::kSendAck: answered(ch); break;
      default: break;
    }
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kWrite: return serve_write(ch, h, payload);
      case FrameType::kReadReq: return serve_read(ch, h);
      case FrameType::kReadResp: return take_read(ch, h, payload, Status::Ok());
      case FrameType::kAck:
        if (!(h.flags & kLaneEnd) || !pending_.lane_done(h.op_id, Status::Ok(), ch.index()))
          return {ErrorCode::kProtocol, "ack for an unknown operation"};
        return Status::Ok();
      case FrameType::kNack: return take_nack(ch, h, payload);
      case FrameType::kSignal: return serve_signal(ch, h);
      case FrameType::kSend: return serve_send(ch, h, payload);
      case FrameType::kSendPull: return serve_send_pull(ch, h);
      case FrameType::kSendAck: return complete_send_ack(pending_, h, payload);
      case FrameType::kError: return peer_error(payload);
      default: return {ErrorCode::kProtocol, "unexpected frame type " + std::to_string(h.type) + " on a tcp channel"};
    }
  }

  // A channel being replaced, or retired by a replacement, going down is expected.
  void on_channel_down(StreamChannel& ch, const Status& why) override {
    if (closing_.load()) return;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      const int c = ch.index();
      if (channels_[c].get() != &ch || replacing_[c].load()) return;
    }
    fail(why, /*notify=*/true);
  }

  // Bytes of our own request frames left: progress of their op (not of the peer's ops that
  // our responses answer: those tokens are the peer's).
  void on_frame_sent(StreamChannel& ch, const FrameHeader& h) override {
    switch (static_cast<FrameType>(h.type)) {
      case FrameType::kWrite:
      case FrameType::kSignal:
      case FrameType::kReadReq:
      case FrameType::kSendPull: pending_.progress(h.op_id); break;
      case FrameType::kSend: pending_.progress_send(h.op_id); break;
      default: return;
    }
    answered(ch);
  }

 private:
  // Remember, for this thread's next wait, the channels an op went out on.
  void note_submit(uint64_t channels) {
    if (tls_hint.endpoint != this) tls_hint = {this, 0};
    tls_hint.channels |= channels;
  }

  // Channel `ch` moved our requests forward (an answer arrived, or request bytes left).
  void answered(StreamChannel& ch) {
    answered_[ch.index()].store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }

  // ---- Channel failover (docs/cluster.md, "Channel failover") ----

  // Watchdog (dialing side): a channel that owes answers to our requests and moved no byte
  // for failover_ is replaced (the rule, and why an unretryable op needs more: stall_rule.hpp).
  // A channel is replaced at most once per op_timeout, so a peer that stops reading cannot
  // keep its ops alive by making us replace channels; its stall then fails the endpoint as before.
  void find_stalls(Clock::time_point now) {
    for (int c = 0; c < nchan_; ++c) {
      if (replacing_[c].load()) continue;
      int fd = -1;
      ChannelClocks clocks;
      {
        std::lock_guard<std::mutex> lk(attach_mu_);
        if (!channels_[c]) continue;
        if (replaced_at_[c] != Clock::time_point{} && now - replaced_at_[c] < op_timeout_) continue;
        clocks.last_io = channels_[c]->last_io();
        clocks.answered = Clock::time_point(Clock::duration(answered_[c].load(std::memory_order_relaxed)));
        fd = channels_[c]->fd();
      }
      if (now - std::max(clocks.last_io, clocks.answered) < failover_) continue;  // the cheap test first
      clocks.owed_since = pending_.owed_since(c);
      if (clocks.owed_since == Clock::time_point::max()) continue;  // owes nothing
      auto open = pending_.open_on(c);
      const bool sends = c == 0 && pending_.sends() > 0;
      bool all_retry = !sends;
      for (const auto& [token, op] : open) all_retry = all_retry && retryable(*op);
      if (!should_replace(now, clocks, all_retry, failover_, op_timeout_, [fd] { return retransmitting(fd); }))
        continue;
      start_replacement(c, now, std::chrono::duration_cast<std::chrono::milliseconds>(silence(now, clocks)));
    }
  }

  bool retryable(const TransferOp& op) const {
    if (!retry_rma_) return false;
    if (!op.future) return !op.signal;  // a post: writes yes, signals (additions) no
    return op.kind == OpKind::kRead || op.kind == OpKind::kWrite;
  }

  // Our data on the socket is unacknowledged and the kernel is retransmitting it.
  static bool retransmitting(int fd) {
    struct tcp_info ti{};
    socklen_t len = sizeof(ti);
    if (fd < 0 || ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) return false;
    return ti.tcpi_unacked > 0 && (ti.tcpi_retransmits > 0 || ti.tcpi_backoff > 0);
  }

  void start_replacement(int c, Clock::time_point now, std::chrono::milliseconds silent) {
    ChannelOpener open;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      if (!opener_ || !redialer_ || replacing_[c].exchange(true)) return;
      open = opener_;
    }
    SLUICE_LOG(kInfo, "tcp: channel " << c << " to " << peer_id_ << " owes answers and moved nothing for "
                                      << silent.count() << " ms: dialing a replacement");
    // The stall began `silent` ago; past op_timeout from then the watchdog fails the endpoint anyway.
    const auto give_up = now - silent + op_timeout_;
    std::weak_ptr<TcpEndpoint> weak = weak_from_this();
    redialer_->post([weak, c, give_up, open = std::move(open)] {
      if (auto self = weak.lock()) self->redial(c, give_up, open);
    });
  }

  // Redialer thread: dial the peer's listener until the replacement is in, the endpoint
  // ends, or give_up. Each dial is bounded by the connect timeout and sends a SYN every
  // connect.retry_ms (net::connect_tcp), so after a link flap one gets through at once.
  void redial(int c, Clock::time_point give_up, const ChannelOpener& open) {
    Status last;
    while (!failed() && !closing_.load()) {
      try {
        auto [sock, reply] = open(c, nlohmann::json{{"replace", true}});
        replace_channel(c, std::move(sock));
        return;
      } catch (const Error& e) {
        last = e.status();
        SLUICE_LOG(kDebug, "tcp: replacement for channel " << c << " to " << peer_id_ << " failed: " << e.what());
      }
      if (Clock::now() >= give_up) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a refusal comes back at once
    }
    // Given up: the old channel goes on as it can. If it went down meanwhile (on_channel_down
    // ignored it), the endpoint fails now.
    bool down = false;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      replacing_[c] = false;
      down = channels_[c] && channels_[c]->down();
    }
    // Under replace_mu_, which close() takes after setting closing_: once close() returned,
    // nothing here touches events_.
    std::lock_guard<std::recursive_mutex> rl(replace_mu_);
    if (down && !closing_.load())
      fail({ErrorCode::kPeerLost, "tcp channel " + std::to_string(c) + " lost and not replaced: " + last.message},
           /*notify=*/true);
  }

  // Listener thread (accepting side): the peer replaces channel `index`. The endpoint is the
  // live one the engine found by its token (a secret of 64 random bits); the old channel is
  // stopped before the reply leaves, so nothing of it lands after the peer resends.
  nlohmann::json attach_replacement(int index) {
    StreamChannel* old = nullptr;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      if (active_) throw Error(ErrorCode::kProtocol, "channel replace: this side dialed the endpoint");
      if (attached_ < nchan_) throw Error(ErrorCode::kProtocol, "channel replace: the endpoint's channels are not all attached");
      if (failed() || closing_.load()) throw Error(ErrorCode::kPeerLost, "channel replace: the endpoint is closed");
      replacing_[index] = true;
      old = channels_[index].get();
    }
    old->shutdown();
    old->join();
    return nlohmann::json::object();
  }

  // Both sides, once the new socket is connected and the handshake done: stop the old
  // channel (shutdown + join: none of its bytes lands anywhere after this), install the new
  // one, and deal with our ops that had a lane on the old one: reads and writes (and post
  // writes) are sent again when tcp.retry_rma allows; the rest fail, since the peer may have
  // applied them in part. A send still unacknowledged on channel 0 fails the endpoint (its
  // recv may have been caught mid-message).
  void replace_channel(int c, net::Socket sock) {
    // One replacement at a time, held across the join; close() does not take this one (a
    // close() on a reactor thread must not wait for a join that needs that reactor).
    std::lock_guard<std::mutex> serial(replace_serial_mu_);
    StreamChannel* old = nullptr;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      if (failed() || closing_.load()) return;
      old = channels_[c].get();
    }
    old->shutdown();
    old->join();
    cap_rto(sock.fd());
    // From here on nothing waits for a reactor; close() waits for this part (see close()).
    std::lock_guard<std::recursive_mutex> rl(replace_mu_);
    std::vector<uint64_t> failing;
    std::string failing_why;
    bool send_caught = false;
    size_t retried = 0;
    {
      std::lock_guard<std::mutex> lk(attach_mu_);
      std::lock_guard<std::mutex> lane_lk(lane_mu_[c]);
      if (failed() || closing_.load()) return;
      retired_.push_back(std::move(channels_[c]));  // a submitter may still hold a pointer
      channels_[c] = std::make_unique<StreamChannel>(std::move(sock), this, c, socket_buffer_);
      StreamChannel& ch = *channels_[c];
      std::deque<ReadPiece> old_reads;
      old_reads.swap(reads_[c]);
      std::unordered_map<uint64_t, std::shared_ptr<TransferOp>> open;
      for (auto& [token, op] : pending_.open_on(c)) open.emplace(token, std::move(op));
      send_caught = c == 0 && pending_.sends() > 0;
      for (auto& [token, op] : open) {
        if (retryable(*op)) {
          ++retried;
        } else {
          failing.push_back(token);
          if (failing_why.empty()) failing_why = std::string(op->future ? to_string(op->kind) : op->signal ? "post_signal" : "post_write");
        }
      }
      // Counted before anything is sent again: a retried op may complete (and its waiter read
      // the metrics) before this function returns.
      replaced_.fetch_add(1);
      retried_.fetch_add(retried);
      ch.start();
      answered(ch);
      // Reads first, in their old order: responses come back in request order.
      for (const ReadPiece& rp : old_reads) {
        auto it = open.find(rp.token);
        if (it == open.end() || !retryable(*it->second)) continue;
        reads_[c].push_back(rp);
        OutFrame f;
        f.hdr = make_frame(rp.pull ? FrameType::kSendPull : FrameType::kReadReq, rp.token, rp.remote_id,
                           rp.remote_offset, 0, rp.lane_end ? kLaneEnd : 0, static_cast<uint32_t>(rp.length),
                           static_cast<uint32_t>(rp.length >> 32));
        ch.post(std::move(f));
      }
      for (auto& [token, op] : open) {
        if (!retryable(*op)) continue;                // failed below
        if (op->kind == OpKind::kRead) continue;  // posted above
        if (!op->future) {
          // Copied: the post may be acked (and its op cleared for reuse) before its last frame is queued.
          const Piece p = op->lanes[0].pieces[0];
          post_post_frames(ch, token, p, false, 0);
        } else {
          uint32_t nlanes = 0;
          for (auto& lane : op->lanes) nlanes += lane.pieces.empty() ? 0 : 1;
          post_lane(ch, token, *op, c, nlanes);
        }
      }
      replacing_[c] = false;
      replaced_at_[c] = Clock::now();
    }
    SLUICE_LOG(kInfo, "tcp: channel " << c << " to " << peer_id_ << " replaced by a fresh connection; " << retried
                                      << " op(s) sent again, " << failing.size() << " failed"
                                      << (send_caught ? ", a send was caught: the endpoint fails" : ""));
    const std::string where = "tcp channel " + std::to_string(c) + " to peer " + peer_id_ + " stalled and was replaced: ";
    for (uint64_t token : failing) {
      auto op = pending_.find(token);
      std::string what = op ? (op->future ? std::string(to_string(op->kind)) : op->signal ? "post_signal" : "post_write") : failing_why;
      Status st{ErrorCode::kPeerLost, where + what +
                                          (retry_rma_ || what == "write_with_imm" || what == "post_signal"
                                               ? " not retried: may have been partly delivered"
                                               : " not retried (tcp.retry_rma is off)")};
      pending_.lane_done(token, st, c);
    }
    if (send_caught)
      fail({ErrorCode::kPeerLost, where + "a send was unacknowledged on it: not retried: may have been partly delivered"},
           /*notify=*/false);
  }

  // Callers hold attach_mu_, which also guards fail()'s walk over channels_.
  void install(int index, net::Socket sock) {
    cap_rto(sock.fd());
    channels_[index] = std::make_unique<StreamChannel>(std::move(sock), this, index, socket_buffer_);
    if (index == mute_index_) muted_ = channels_[index].get();  // before start(): its fiber reads it
    channels_[index]->start();
    // fail() or close() ran before this channel existed
    if (failed() || closing_.load()) channels_[index]->shutdown();
  }

  void cap_rto(int fd) const {
    if (rto_max_ms_ == 0) return;
    int v = rto_max_ms_;
    if (::setsockopt(fd, IPPROTO_TCP, TCP_RTO_MAX_MS, &v, sizeof(v)) != 0) {
      SLUICE_LOG(kDebug, "tcp: TCP_RTO_MAX_MS " << v << " not set (" << net::errno_text(errno)
                                                << "; kernel older than 6.15?): retransmissions back off to its default cap");
      return;
    }
    unsigned int give_up = static_cast<unsigned int>(give_up_ms_);  // see uncapped_give_up_ms()
    if (::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &give_up, sizeof(give_up)) != 0)
      SLUICE_LOG(kWarn, "tcp: TCP_USER_TIMEOUT " << give_up << " not set (" << net::errno_text(errno)
                                                 << "): the kernel may drop a connection after about 14 s of outage");
  }

  // EndpointBase::fail: shut the channels down (never join: fail() may run on a channel's
  // own fiber); the base then fails every op and post.
  void stop_io() override {
    std::lock_guard<std::mutex> lk(attach_mu_);
    for (auto& ch : channels_)
      if (ch) ch->shutdown();
  }

  // A free post op (see PostOp), its lane and pins empty, `busy` set.
  std::shared_ptr<PostOp> take_post_op() {
    {
      std::lock_guard<std::mutex> lk(pool_mu_);
      // Posts finish in order on channel 0: the op after the last one taken is the likeliest free.
      for (size_t n = 0; n < pool_.size(); ++n) {
        auto& op = pool_[pool_next_];
        pool_next_ = (pool_next_ + 1) % pool_.size();
        if (!op->busy.load(std::memory_order_acquire) && op.use_count() == 1) {
          op->busy.store(true, std::memory_order_relaxed);
          op->post_error = Status::Ok();
          op->posted_lanes.store(0, std::memory_order_relaxed);
          op->done_lanes = 0;
          return op;
        }
      }
    }
    auto op = std::make_shared<PostOp>();
    op->kind = OpKind::kWrite;  // a nack then completes it like a write lane (take_nack)
    op->post = &posts_;
    op->lanes.resize(1);
    op->busy.store(true, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lk(pool_mu_);
    if (pool_.size() < kPostOpPool) pool_.push_back(op);
    return op;
  }

  void issue_signal(const PostSignal& s) {
    auto op = take_post_op();
    op->signal = true;
    op->signal_add = s.add;
    op->bytes = 0;
    op->lanes[0].pieces.push_back(Piece{nullptr, s.remote_id, s.remote_offset, s.remote_addr, 8});
    op->lanes[0].bytes = 0;
    issue_post(std::move(op));
  }

  // One lane on channel 0: a write (cut at the frame limit; only its last frame asks for an
  // ack) or a signal (the value to add in imm, low half, and aux, high half).
  void issue_post(std::shared_ptr<PostOp> op) {
    // Copied first: once added, the op may complete (and be cleared for reuse) at any time.
    const Piece p = op->lanes[0].pieces[0];
    const bool signal = op->signal;
    const uint64_t add = op->signal_add;
    TransferOp* raw = op.get();  // alive while in the table; posted_lanes is atomic
    uint64_t token = pending_.add(std::move(op));
    if (!token) return;  // the endpoint failed: add() completed the post through post_finished
    std::lock_guard<std::mutex> lane_lk(lane_mu_[0]);  // see submit()
    raw->posted_lanes.fetch_or(1, std::memory_order_release);
    post_post_frames(*channels_[0], token, p, signal, add);
  }

  // The frames of a post (caller holds lane_mu_[0]).
  static void post_post_frames(StreamChannel& ch, uint64_t token, const Piece& p, bool signal, uint64_t add) {
    if (signal) {
      OutFrame f;
      f.hdr = make_frame(FrameType::kSignal, token, p.remote_id, p.remote_offset, 0, kLaneEnd,
                         static_cast<uint32_t>(add), static_cast<uint32_t>(add >> 32));
      ch.post(std::move(f));
      return;
    }
    for (uint64_t off = 0; off < p.length;) {
      uint64_t n = std::min(p.length - off, kMaxFramePayload);
      OutFrame f;
      f.hdr = make_frame(FrameType::kWrite, token, p.remote_id, p.remote_offset + off, n,
                         off + n == p.length ? kLaneEnd : 0);
      f.data = p.local + off;
      ch.post(std::move(f));
      off += n;
    }
  }

  // PendingOps' post handler: a post ended (acked, refused, timed out or failed with the
  // endpoint). A write may release signals queued behind it; they go out from here.
  void post_finished(const std::shared_ptr<TransferOp>& op, const Status& st) {
    const bool write = !op->signal;
    const uint64_t epoch = op->post_epoch;
    op->pins.clear();  // the local region is not held by an idle pooled op
    op->lanes[0].pieces.clear();
    static_cast<PostOp*>(op.get())->busy.store(false, std::memory_order_release);
    posts_.done(st);
    if (!write) return;
    // A scratch vector per thread keeps its capacity: no allocation per completion. Swapped
    // out while in use, so a nested completion (issue_signal on a failed endpoint) is safe.
    thread_local std::vector<PostSignal> scratch;
    std::vector<PostSignal> ready;
    ready.swap(scratch);
    ready.clear();
    sequencer_.write_done(epoch, &ready);
    for (const auto& s : ready) issue_signal(s);
    ready.clear();
    scratch.swap(ready);
  }

  // A peer's post_signal: checked like any target access (apply_signal); refused with a NACK
  // that changes nothing. A signal frame carries no payload.
  Status serve_signal(StreamChannel& ch, const FrameHeader& h) {
    if (h.length != 0 || !(h.flags & kLaneEnd) || (h.flags & kImmPart))
      return {ErrorCode::kProtocol, "malformed signal frame"};
    Status room = response_room(ch);
    if (!room.ok()) return room;
    Status st = apply_signal(events_->registry(), h.region, h.offset, uint64_t(h.aux) << 32 | h.imm);
    if (!st.ok()) SLUICE_LOG(kDebug, "tcp: refused a signal: " << st.message);
    post_status(ch, st.ok() ? FrameType::kAck : FrameType::kNack, h.op_id, kLaneEnd, st);
    return Status::Ok();
  }

  // A peer that sends requests and never reads the responses: bounded per channel.
  Status response_room(StreamChannel& ch) const {
    if (ch.responses_queued() < max_queued_) return Status::Ok();
    return {ErrorCode::kProtocol, "peer left " + std::to_string(ch.responses_queued()) +
                                      " responses unread on tcp channel " + std::to_string(ch.index()) +
                                      " (max_queued_responses " + std::to_string(max_queued_) + ")"};
  }

  Status serve_write(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
    if (h.flags & kLaneEnd) {
      Status room = response_room(ch);
      if (!room.ok()) return room;
    }
    Status st;
    {
      RegionPin pin = events_->registry().pin(h.region, h.offset, h.length, &st, "target");
      if (st.ok() && staging::is_device(pin.get()->location)) {
        bool got = false;
        try {
          got = staging::receive(pin.get()->base + h.offset, h.length,
                                 [&](void* b, uint64_t k) { return payload.read(b, k); });
        } catch (const Error& e) {
          st = e.status();
        }
        if (st.ok() && !got) return {ErrorCode::kPeerLost, "connection lost mid-write"};
      } else if (st.ok()) {
        if (!payload.read(pin.get()->base + h.offset, h.length)) return {ErrorCode::kPeerLost, "connection lost mid-write"};
      } else {
        SLUICE_LOG(kDebug, "tcp: refused a write: " << st.message);
      }
    }
    if (h.flags & kImmPart) {
      if (!note_imm_lane(h, st.ok())) return {ErrorCode::kProtocol, "too many write_with_imm batches in progress"};
    } else if (!st.ok() && h.aux) {
      imm_failed(h.op_id);
    }
    if (!st.ok())
      post_status(ch, FrameType::kNack, h.op_id, h.flags & kLaneEnd, st);
    else if (h.flags & kLaneEnd)
      post_status(ch, FrameType::kAck, h.op_id, kLaneEnd, st);
    return Status::Ok();
  }

  // Deliver the imm once every lane of the batch has landed and none failed.
  bool note_imm_lane(const FrameHeader& h, bool ok) {
    bool deliver = false;
    {
      std::lock_guard<std::mutex> lk(imm_mu_);
      auto& p = imm_[h.op_id];
      if (imm_.size() > kMaxImmInProgress) return false;
      p.lanes_seen++;
      p.failed |= !ok;
      if (p.lanes_seen >= h.aux) {
        deliver = !p.failed;
        imm_.erase(h.op_id);
      }
    }
    if (deliver) events_->matcher().push_imm(h.imm);
    return true;
  }

  void imm_failed(uint64_t token) {
    std::lock_guard<std::mutex> lk(imm_mu_);
    if (imm_.size() <= kMaxImmInProgress) imm_[token].failed = true;
  }

  Status serve_read(StreamChannel& ch, const FrameHeader& h) {
    uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
    Status room = response_room(ch);
    if (!room.ok()) return room;
    Status st;
    RegionPin pin = events_->registry().pin(h.region, h.offset, length, &st, "target");
    if (st.ok() && length > kMaxFramePayload) st = {ErrorCode::kInvalidArgument, "read piece too large"};
    std::shared_ptr<uint8_t> staged;
    if (st.ok() && staging::is_device(pin.get()->location)) {
      try {
        staged = staging::download_copy(pin.get()->base + h.offset, length);
      } catch (const Error& e) {
        st = e.status();
      }
    }
    if (!st.ok()) {
      post_status(ch, FrameType::kNack, h.op_id, h.flags & kLaneEnd, st);
      return Status::Ok();
    }
    OutFrame f;
    f.hdr = make_frame(FrameType::kReadResp, h.op_id, 0, 0, length, h.flags & kLaneEnd);
    f.response = true;
    f.data = pin.get()->base + h.offset;
    f.keep = std::make_shared<RegionPin>(std::move(pin));
    if (staged) {
      f.data = staged.get();
      f.keep = staged;
    }
    ch.post(std::move(f));
    return Status::Ok();
  }

  // A READ_RESP or a NACK for the oldest outstanding read on this channel.
  Status take_read(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload, const Status& refused) {
    ReadPiece rp;
    {
      std::lock_guard<std::mutex> lk(lane_mu_[ch.index()]);
      auto& q = reads_[ch.index()];
      if (q.empty() || q.front().token != h.op_id) return {ErrorCode::kProtocol, "read response out of order"};
      rp = q.front();
      q.pop_front();
    }
    if (rp.lane_end != bool(h.flags & kLaneEnd)) return {ErrorCode::kProtocol, "read response lane mismatch"};
    if (rp.length >= kStampBytes) pending_.progress(rp.token);  // a long response is arriving
    if (refused.ok()) {
      if (h.length != rp.length) return {ErrorCode::kProtocol, "read response of the wrong length"};
      if (!payload.read(rp.dest, rp.length)) {
        // Asked again if the channel is being replaced (replace_channel takes reads_ after
        // this fiber ended); otherwise the endpoint fails.
        std::lock_guard<std::mutex> lk(lane_mu_[ch.index()]);
        reads_[ch.index()].push_front(rp);
        return {ErrorCode::kPeerLost, "connection lost mid-read"};
      }
      if (!rp.lane_end) pending_.progress(rp.token);
    }
    if (rp.lane_end)
      pending_.lane_done(rp.token, refused, ch.index());
    else if (!refused.ok())
      pending_.note_error(rp.token, refused);
    return Status::Ok();
  }

  Status take_nack(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
    Status st = frame_status(h, payload);
    if (st.ok()) st = {ErrorCode::kRemoteError, "peer refused the request"};
    auto op = pending_.find(h.op_id);
    if (!op) return {ErrorCode::kProtocol, "nack for an unknown operation"};
    if (op->kind == OpKind::kRead) return take_read(ch, h, payload, st);
    if (h.flags & kLaneEnd) pending_.lane_done(h.op_id, st, ch.index());
    else pending_.note_error(h.op_id, st);
    return Status::Ok();
  }

  // How many bytes of a `length`-byte SEND go with its header on channel 0; `length` unless it
  // is striped (tcp.send_stripe_min, a peer that takes it, 2 or more channels).
  uint64_t stripe_head(uint64_t length) const {
    if (stripe_min_ == 0 || length < stripe_min_ || nchan_ < 2 || !peer_pulls_.load(std::memory_order_relaxed))
      return length;
    return std::max<uint64_t>((length / nchan_ + 4095) & ~uint64_t(4095), 1);
  }

  Status serve_send(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) {
    Status room = response_room(ch);
    if (!room.ok()) return room;
    // A striped message (kPullRest): `h.length` of its bytes follow, the rest we read with
    // SEND_PULL. Only on channel 0, and only from a peer we told that we take them.
    const bool striped = h.flags & kPullRest;
    const uint64_t length = striped ? (uint64_t(h.aux) << 32) | h.imm : h.length;
    if (striped && (ch.index() != 0 || h.length >= length || h.length == 0))
      return {ErrorCode::kProtocol, "striped SEND of " + std::to_string(length) + " bytes with " +
                                        std::to_string(h.length) + " in its frame on channel " +
                                        std::to_string(ch.index())};
    auto claim = events_->matcher().claim(h.op_id, length, /*lazy=*/true);
    if (claim.error.code == ErrorCode::kProtocol) return claim.error;
    Status st = claim.error;
    uint8_t* dest = nullptr;  // where the pulled rest lands: [h.length, want)
    uint64_t want = 0;
    if (claim.stash) {
      // No recv yet: the buffer grows as the bytes arrive, so a header that announces a huge
      // message and then stalls costs nothing.
      for (uint64_t off = 0; off < h.length;) {
        uint64_t k = std::min(kStashChunk, h.length - off);
        uint8_t* buf = MessageMatcher::stash_room(claim, off + k);
        if (!payload.read(buf + off, k)) {
          Status lost{ErrorCode::kPeerLost, "connection lost mid-message"};
          events_->matcher().deliver(claim, lost);
          return lost;
        }
        off += k;
      }
      // The rest of a striped message is read from the sender's memory into a buffer of its
      // announced size (within the unexpected-message budget claim() charged it to).
      if (striped) dest = MessageMatcher::stash_room(claim, length), want = length;
    } else if (claim.dest) {
      const uint64_t n = std::min(length, claim.capacity);
      const bool device = staging::available() && staging::is_device_ptr(claim.dest);
      uint8_t* const d = claim.dest;
      // The first k bytes from this frame: kPeerLost if the stream broke, a CUDA error's status.
      auto read_head = [&](uint64_t k) -> Status {
        bool got = true;
        if (!device) {
          got = payload.read(d, k);
        } else {
          try {
            got = staging::receive(d, k, [&](void* b, uint64_t m) { return payload.read(b, m); });
          } catch (const Error& e) {
            return e.status();
          }
        }
        return got ? Status::Ok() : Status{ErrorCode::kPeerLost, "connection lost mid-message"};
      };
      if (striped && n > h.length) {
        // The rest (truncated: what fits) is asked for before the head is read, so that both
        // stream at once; the head is one more part of the pull's completion.
        auto pull = start_pull(std::move(claim), h.op_id, d, h.length, n, /*head=*/true, device);
        Status head = read_head(h.length);
        pull->done(head);
        return head.code == ErrorCode::kPeerLost ? head : Status::Ok();  // the pull answers the sender
      }
      Status got = read_head(n);
      if (got.code == ErrorCode::kPeerLost) {
        // Complete the matched recv (or its stash) instead of dropping the claim.
        events_->matcher().deliver(claim, got);
        return got;
      }
      st = got;
    }
    if (dest && want > h.length) {
      start_pull(std::move(claim), h.op_id, dest, h.length, want);
      return Status::Ok();  // the pull's completion answers the sender
    }
    st = events_->matcher().deliver(claim, st);
    post_status(ch, FrameType::kSendAck, h.op_id, 0, st);
    return Status::Ok();
  }

  // The end of a striped message's receipt: its pull (an internal read op) and, when the
  // caller reads the frame's bytes meanwhile, that head. Not parts of the read op's future: a
  // future completed by anything but its lanes would leave the op pending (and time it out).
  struct PullJoin {
    std::atomic<int> left;
    std::mutex mu;
    Status st;  // the first failure
    std::function<void(const Status&)> finish;
    explicit PullJoin(int n) : left(n) {}
    void done(const Status& part) {
      if (!part.ok()) {
        std::lock_guard<std::mutex> lk(mu);
        if (st.ok()) st = part;
      }
      if (left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      Status out;
      {
        std::lock_guard<std::mutex> lk(mu);
        out = st;
      }
      finish(out);
    }
  };

  // Reads bytes [from, to) of the peer's message `seq` into dest + from, over channels 1..N-1
  // (SEND_PULL frames, answered and retried like READ_REQs), then acks the sender on channel
  // 0 and completes the claim. `head`: the caller reads the frame's bytes meanwhile and calls
  // done() on the returned join with how that went. `device`: dest is CUDA memory; the bytes
  // land in a pinned buffer and are uploaded before the claim completes.
  std::shared_ptr<PullJoin> start_pull(MessageMatcher::Claim&& claim, uint64_t seq, uint8_t* dest, uint64_t from,
                                       uint64_t to, bool head = false, bool device = false) {
    auto op = std::make_shared<TransferOp>();
    op->kind = OpKind::kRead;
    op->message_pull = true;
    op->lanes.resize(static_cast<size_t>(nchan_));
    std::shared_ptr<uint8_t> bounce;
    Status early;
    if (device) {
      try {
        bounce = staging::pinned(to - from);
      } catch (const Error& e) {
        early = e.status();
      }
    }
    const int first = nchan_ > 1 ? 1 : 0;  // a peer that stripes to a one-channel endpoint: channel 0
    const int others = nchan_ - first;
    const uint64_t step = ((to - from) / others + 4095) & ~uint64_t(4095);
    int lanes = 0;
    for (int c = first; early.ok() && c < nchan_; ++c) {
      const uint64_t a = std::min(to, from + step * (c - first));
      const uint64_t b = c + 1 == nchan_ ? to : std::min(to, a + step);
      auto& lane = op->lanes[static_cast<size_t>(c)];
      // Pieces of at most 4 MiB: progress is seen piece by piece, as for a read.
      for (uint64_t off = a; off < b;) {
        const uint64_t k = std::min<uint64_t>(4 << 20, b - off);
        lane.pieces.push_back(Piece{bounce ? bounce.get() + (off - from) : dest + off, seq, off, 0, k});
        lane.bytes += k;
        off += k;
      }
      if (!lane.pieces.empty()) ++lanes;
    }
    op->bytes = to - from;
    auto join = std::make_shared<PullJoin>(head ? 2 : 1);
    auto held = std::make_shared<MessageMatcher::Claim>(std::move(claim));
    std::weak_ptr<TcpEndpoint> self = weak_from_this();
    join->finish = [self, held, seq, bounce, dest, from, to](const Status& pulled) {
      auto me = self.lock();
      if (!me) return;
      Status st = pulled;
      if (st.ok() && bounce) {
        try {
          staging::upload(dest + from, bounce.get(), to - from);
        } catch (const Error& e) {
          st = e.status();
        }
      }
      const Status ack = MessageMatcher::sender_status(*held, st);
      {
        std::lock_guard<std::mutex> lane_lk(me->lane_mu_[0]);  // a replacement swaps channels under it
        post_status(*me->channels_[0], FrameType::kSendAck, seq, 0, ack);
      }
      me->events_->matcher().deliver(*held, st);
    };
    if (!early.ok()) {
      join->done(early);
      return join;
    }
    op->future = std::make_shared<FutureState>(OpKind::kRead, lanes);
    op->future->on_complete([join](const Status& st) { join->done(st); });
    submit(std::move(op));
    return join;
  }

  // SEND_PULL: bytes of our message `h.region` (a sequence) that the receiver reads while the
  // send waits for its SEND_ACK; only a send in flight, only within it.
  Status serve_send_pull(StreamChannel& ch, const FrameHeader& h) {
    const uint64_t length = (uint64_t(h.aux) << 32) | h.imm;
    Status room = response_room(ch);
    if (!room.ok()) return room;
    Status st;
    auto op = pending_.find_send(h.region);
    if (!op)
      st = {ErrorCode::kInvalidArgument, "SEND_PULL for message " + std::to_string(h.region) + ", which is not in flight"};
    else if (length == 0 || length > kMaxFramePayload || h.offset > op->length || length > op->length - h.offset)
      st = {ErrorCode::kInvalidArgument, "SEND_PULL of bytes [" + std::to_string(h.offset) + ", +" +
                                             std::to_string(length) + ") of a " + std::to_string(op->length) +
                                             "-byte message"};
    if (!st.ok()) {
      post_status(ch, FrameType::kNack, h.op_id, h.flags & kLaneEnd, st);
      return Status::Ok();
    }
    pending_.progress_send(h.region);
    OutFrame f;
    f.hdr = make_frame(FrameType::kReadResp, h.op_id, 0, 0, length, h.flags & kLaneEnd);
    f.response = true;
    f.data = op->ptr + h.offset;
    f.keep = op;  // its pin too, until the bytes left
    ch.post(std::move(f));
    return Status::Ok();
  }

  WaiterReceive waiter_;  // drive() and interrupt()

  // Channel failover (find_stalls, replace_channel).
  const std::shared_ptr<Redialer> redialer_;  // the transport's; null in tests without one
  const bool active_;                         // we dialed: we dial replacements
  const std::string peer_id_;
  const std::chrono::milliseconds op_timeout_;
  const std::chrono::milliseconds failover_;  // tcp.failover_ms
  const bool retry_rma_;                      // tcp.retry_rma
  const int mute_index_;                      // tcp.test_mute_channel (accepted endpoints), -1 = off
  const StreamChannel* muted_ = nullptr;      // set before that channel starts
  std::unique_ptr<std::atomic<bool>[]> replacing_;  // per channel: a replacement is under way
  std::vector<Clock::time_point> replaced_at_;     // under attach_mu_
  std::vector<std::unique_ptr<StreamChannel>> retired_;  // under attach_mu_; kept for stale pointers
  ChannelOpener opener_;                                 // under attach_mu_ (connect())
  std::mutex replace_serial_mu_;      // one replace_channel() at a time
  std::recursive_mutex replace_mu_;   // its install part; close() waits for it (recursive:
                                      // a failed op's callback there may close the endpoint)
  std::atomic<uint64_t> replaced_{0}, retried_{0};

  const int nchan_;
  const size_t max_queued_;
  std::unique_ptr<std::atomic<Clock::rep>[]> answered_;  // per channel, see answered()
  std::vector<std::unique_ptr<StreamChannel>> channels_;
  std::vector<std::deque<ReadPiece>> reads_;
  // Per channel: guards reads_[c], posting a lane on channel c and swapping channels_[c]
  // (replace_channel). Order: attach_mu_, then lane_mu_[c].
  std::vector<std::mutex> lane_mu_;
  mutable std::mutex attach_mu_;
  std::vector<bool> claimed_ = std::vector<bool>(static_cast<size_t>(nchan_));  // attach() said yes
  int attached_ = 0;
  std::mutex pool_mu_;
  std::vector<std::shared_ptr<PostOp>> pool_;  // see take_post_op()
  size_t pool_next_ = 0;
  std::atomic<bool> closing_{false};  // close() began: it fails the ops after the join
  std::mutex imm_mu_;
  std::unordered_map<uint64_t, ImmProgress> imm_;
  const int rto_max_ms_;  // tcp.rto_max_ms resolved (auto_rto_max_ms), 0 = kernel default
  const int socket_buffer_;  // tcp.socket_buffer
  const uint64_t stripe_min_;  // tcp.send_stripe_min
  std::atomic<bool> peer_pulls_{false};  // the peer takes striped SENDs (channel 0's hello)
  const int give_up_ms_;  // TCP_USER_TIMEOUT with the cap (uncapped_give_up_ms), else 0
};

bool TcpEndpoint::drive(const std::atomic<bool>& done, Clock::time_point deadline) {
  auto lend = [&](StreamChannel** lent, int max) {
    if (failed() || closing_.load()) return 0;
    uint64_t want = tls_hint.endpoint == this && tls_hint.channels ? tls_hint.channels : ~uint64_t{0};
    tls_hint.channels = 0;
    int n = 0;
    std::lock_guard<std::mutex> lk(attach_mu_);
    for (int c = 0; c < nchan_ && c < max; ++c)
      if ((want >> c & 1) && channels_[c] && channels_[c]->lend()) lent[n++] = channels_[c].get();
    return n;
  };
  return waiter_.drive(lend, done, deadline, "tcp");
}

class TcpTransport final : public Transport {
 public:
  std::string name() const override { return "tcp"; }
  int priority() const override { return 10; }
  // cuda memory is staged through pinned host buffers (CUDA builds with a GPU).
  bool supports(const Location& loc) const override { return loc.is_host() || staging::available(); }
  // Bytes move on socket threads, not on a CUDA stream: no stream order.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cuda_memory = staging::available();
    c.imm = true;
    c.signal = true;
    c.rma_post = true;
    return c;
  }
  nlohmann::json local_address() const override { return nlohmann::json::object(); }  // the listener itself
  bool can_reach(const EngineInfo&, std::string*) override { return true; }

 private:
  // Dials replacement channels of this engine's tcp endpoints (one thread, started on first use).
  std::shared_ptr<Redialer> redialer_ = std::make_shared<Redialer>();

 public:
  // Our own cuda pieces are staged by the adapter; without staging no cuda region reaches
  // us (supports()), so the adapter's indirection is left out.
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto ep = std::make_shared<TcpEndpoint>(setup, redialer_);
    if (!staging::available()) return ep;
    return std::make_shared<StagingEndpoint>(std::move(ep), cuda_stager());
  }
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(tcp, "tcp", [](const EngineContext&, std::string*) -> std::unique_ptr<Transport> {
  return std::make_unique<TcpTransport>();
});

}  // namespace sluice::detail
