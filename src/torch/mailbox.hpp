// Tagged point-to-point messages between the ranks of one group, over engine endpoints (two
// per peer). The engine matches the k-th send of an endpoint with the k-th recv posted on the
// other side; torch wants matching by (source, tag) and receives from any source. So each
// message starts with a 48-byte header (tag, length, kind, and three fields the device path
// uses) on the peer's control endpoint,
// and the mailbox's progress tasks (progress_queue.hpp) keep a header recv posted on every
// control endpoint.
//
// Two protocols, chosen by the message's size:
// - eager (below rndv_bytes): the payload follows its header on the control endpoint and is
//   steered into the first matching posted recv or into an unexpected-message buffer. Up to
//   `inline_bytes` it travels inside the header's own engine message (EAGER_INLINE: the
//   header recv is posted that much larger, and the receiver copies the bytes out), so a
//   small message is one engine message, not two.
// - rendezvous (rndv_bytes and up): the header alone goes first (RTS). Once a recv matches
//   it, the receiver posts the engine recv straight into the destination on the peer's data
//   endpoint and only then sends a clear-to-send (CTS) header back; the sender then sends
//   the payload on the data endpoint. The payload therefore always finds its recv already
//   posted: the engine never stashes it (no extra copy, no fresh buffer per message; from
//   32 MiB each such buffer was a fresh mmap, page faults and zeroing).
//   Why a CTS rather than a one-sided READ of the sender's host tensor: host payloads are
//   registered per message, so each read would need the region's descriptor in-band first
//   (Engine::region_descriptor) and its description by the owner on shm; two-sided messages
//   behave the same on shm and tcp. CUDA payloads, whose registrations the backend keeps, are
//   read (below). The data endpoint
//   is separate because the control endpoint always has a header recv posted: a payload
//   sent there after a CTS would match that header recv, not the tensor's. On the data
//   endpoint both sides post in CTS order (the receiver posts its recv, then sends the CTS;
//   the sender handles CTSs in arrival order), so the k-th payload meets the k-th recv.
//   CUDA payloads (the device path, docs/torch.md) use a third endpoint per peer, over the
//   nvlink transport, two ways:
//   - a CUDA payload (registered by the caller, kept registered) is read by the receiver: its
//     RTS (kind RTS_READ) names the sender's region and offset; the first RTS_READ naming a
//     region carries the region's descriptor (Engine::region_descriptor, `aux` bytes after the
//     header), which the receiver imports on the device endpoint. The receiver reads the
//     payload into its recv with one copy as soon as a recv matches, then answers FIN (with
//     the read's status), upon which the send completes. Two control trips instead of four.
//     A sender that gets no FIN within the group timeout fails the pair: the peer might still
//     read memory the caller has reused by then.
//   - a host payload for a CUDA recv goes as before, by CTS, on the device endpoint (the CTS
//     says which endpoint; the device endpoint keeps the data endpoint's order rule).
//   CUDA memory never goes eager (a CUDA recv that an eager message matches fails instead
//   of being written through a host path).
//   A length mismatch answers the RTS with a NACK (both sides fail with kTruncated); a CTS
//   for a send that already timed out gets a 1-byte payload, so the data endpoint's order
//   holds and the receiver fails with an error naming the peer.
// - ready-to-receive (RTR, `recv_ready`): a recv of rndv_bytes or more of host memory from one
//   rank, posted while nothing from that rank could match it yet, posts its engine recv on the
//   data endpoint at once and tells the sender so, in advance (an RTR header: tag, length, id,
//   and `region` = how many message headers we had from that rank then). The sender's first
//   message with that tag numbered from there on, if it is host memory of exactly that length,
//   goes straight onto the data endpoint with an RTR_DATA header naming the RTR: no RTS / CTS
//   round trip, which a send/recv ping-pong otherwise pays every message. If that message
//   already left as an RTS (the RTR crossed it; the sender keeps the tags of its last
//   kRtrHistory messages per peer), the RTR carries its payload all the same, and the
//   receiver, whose recv the RTS matched, waits for that payload instead of sending a CTS.
//   Any other message of that tag (eager, another length, CUDA memory), or a later
//   data-endpoint send that must not overtake the RTR (the data endpoint's order), voids it:
//   a 0-byte payload, which writes nothing, after which the recv goes on as before (a CTS
//   for a crossed RTS). An RTR recv reports only once
//   its engine recv ended (the payload, the void, or the endpoint's failure), so the engine
//   never writes into a buffer the caller got back. Its message is matched by the RTR's id,
//   not by searching the posted recvs. The payload and its header travel on two endpoints,
//   in either order. A recv that times out from a rank we hold RTRs with fails the pair: its
//   engine recv can end only by closing the data endpoint (as for a CTS'd recv), and the
//   messages the RTRs were numbered against would shift onto the wrong recvs.
//
// Unexpected eager messages are stashed in buffers of our own, sized by the length in the
// peer's header. A header must not decide an unbounded allocation: a peer that sends faster
// than we post recvs (or a corrupt length) would grow the process until the kernel kills it,
// or throw bad_alloc in a progress task. So the bytes stashed at once, from all peers
// together, are bounded by `max_unexpected_bytes` (SLUICE_TORCH_MAX_UNEXPECTED_BYTES):
// counted when a stash is allocated, released when its message is delivered or dropped. A
// header that would pass the bound (or whose buffer cannot be allocated) fails that peer at
// once with an error naming the peer, the bytes and the bound: its stashed messages are
// dropped, its pending and later ops fail with that error, and its control endpoint is
// closed, so that the peer's own ops with us fail too instead of piling up in the engine.
// Torch-free: buffers are raw host pointers, completions are callbacks.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "progress_queue.hpp"
#include "sluice/engine.hpp"
#include "trace.hpp"

namespace sluice::torch_backend {

class Mailbox {
 public:
  // status, the rank the message came from (recv) or went to (send), payload bytes.
  using Done = std::function<void(const Status&, int peer, uint64_t bytes)>;
  static constexpr int kAnySource = -1;
  static constexpr uint64_t kDefaultMaxUnexpectedBytes = uint64_t(1) << 30;

  // `peers[r]` is the control endpoint to rank r (invalid for `rank` itself), `data[r]` its
  // data endpoint (the rendezvous payloads); without data endpoints every message is eager.
  // `dev[r]`, where valid, is the device endpoint to rank r (CUDA payloads, above).
  // `timeout` bounds every operation: a recv no message matches and a send its peer does not
  // take in that time fail with kTimeout naming the peer. Messages of `rndv_bytes` and more
  // go by rendezvous. At most `max_unexpected_bytes` of unexpected eager payloads are held at
  // once (above).
  static constexpr uint64_t kDefaultInlineBytes = 4096 - 48;  // a header and its payload in 4 KiB
  static constexpr uint64_t kMaxInlineBytes = 64 << 10;
  Mailbox(Engine& engine, std::vector<Endpoint> peers, std::vector<Endpoint> data, int rank,
          std::chrono::milliseconds timeout, uint64_t rndv_bytes,
          uint64_t max_unexpected_bytes = kDefaultMaxUnexpectedBytes, std::vector<Endpoint> dev = {},
          uint64_t inline_bytes = kDefaultInlineBytes, bool recv_ready = true, bool callers_run = true,
          bool quiet_bookkeeping = true, Trace* trace = nullptr,
          std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // A message's memory: host memory the mailbox registers for the transfer (handle.id 0), or
  // memory the caller registered and keeps registered (`handle`, `ptr` at `offset` in it).
  // `device`: CUDA memory; it moves only by rendezvous on the peer's device endpoint, so the
  // caller sends or receives it this way only when has_device(peer) and n >= rndv_bytes().
  struct Buffer {
    void* ptr = nullptr;
    uint64_t n = 0;
    MemoryHandle handle{};
    uint64_t offset = 0;
    bool device = false;
  };
  // [ptr, ptr+n) must stay valid until `done` ran. `done` runs wherever the mailbox's tasks
  // run (progress_queue.hpp): the mailbox thread, a thread driving the queue, or the caller
  // inside this very call; it must not block, nor call close(), nor be called with a lock
  // held that `done` takes.
  void send(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done);
  void send(int dst, uint64_t tag, const Buffer& b, Done done);
  // The message must be exactly `n` bytes (a different length fails the recv with
  // kTruncated, and the message is consumed).
  void recv(int src, uint64_t tag, void* ptr, uint64_t n, Done done);
  void recv(int src, uint64_t tag, const Buffer& b, Done done);
  // Whether CUDA memory can move to / from `peer` directly (a device endpoint to it).
  bool has_device(int peer) const {
    return peer >= 0 && peer < static_cast<int>(peers_.size()) && peers_[peer].dev.valid();
  }
  uint64_t rndv_bytes() const { return rndv_bytes_; }
  // Ready-to-receive counts (above), for tests and benchmarks: RTRs this rank offered as a
  // receiver; RTRs it used as a sender (a payload with no RTS / CTS) and voided.
  struct RtrStats {
    uint64_t offered = 0, used = 0, voided = 0;
  };
  RtrStats rtr_stats() const {
    return {rtr_offered_.load(std::memory_order_relaxed), rtr_used_.load(std::memory_order_relaxed),
            rtr_voided_.load(std::memory_order_relaxed)};
  }
  // Fails everything pending with kCancelled and stops the progress work. Idempotent.
  void close();
  // The queue its tasks run on: a thread waiting for a send or recv of this mailbox drives it
  // (ProgressQueue::drive_until) so that the completion needs no hop through another thread.
  std::shared_ptr<ProgressQueue> progress() const { return q_; }
  void set_timeout(std::chrono::milliseconds t);

 private:
  using Clock = std::chrono::steady_clock;
  enum Kind : uint64_t {
    kEager = 0, kRts = 1, kCts = 2, kNack = 3, kRtsRead = 4, kFin = 5, kEagerInline = 6, kRtr = 7, kRtrData = 8
  };
  // RTRs a sender holds per peer (more are voided at once), and message tags it remembers
  // per peer to tell whether an RTR came after the message it was meant for.
  static constexpr size_t kMaxPendingRtr = 1024;
  static constexpr size_t kRtrHistory = 1024;
  struct Header {
    uint64_t tag;     // NACK: the length of the recv that refused the message; FIN: 0 or the read's error code
    uint64_t length;
    uint64_t kind_id;  // kind in the top byte; RTS / CTS / NACK / RTS_READ / FIN: the sender's message id;
                       // RTR / RTR_DATA: the receiver's RTR id
    uint64_t region;   // RTS_READ: the sender's region holding the payload; RTR: message headers
                       // the receiver had from the sender when it posted the recv
    uint64_t offset;   // RTS_READ: the payload's offset in it
    uint64_t aux;      // RTS_READ: bytes of the region's descriptor that follow (0: sent before)
  };
  static constexpr uint64_t kInbox = sizeof(Header) + kMaxInlineBytes;  // a header recv's buffer
  static constexpr uint64_t kMaxDescriptor = 64 << 10;
  // On a CTS: send the payload on the device endpoint (the receiver's buffer is CUDA memory).
  // Set on no other kind; id_of() masks it.
  static constexpr uint64_t kDevBit = uint64_t(1) << 55;
  static Kind kind_of(const Header& h) { return static_cast<Kind>(h.kind_id >> 56); }
  static uint64_t id_of(const Header& h) { return h.kind_id & (kDevBit - 1); }
  static bool dev_of(const Header& h) { return (h.kind_id & kDevBit) != 0; }
  static uint64_t make_kind(Kind k, uint64_t id, bool dev = false) {
    return (uint64_t(k) << 56) | (dev ? kDevBit : 0) | id;
  }
  struct PostedRecv {
    int src;
    uint64_t tag;
    void* ptr;
    uint64_t n;
    Done done;
    Clock::time_point deadline;
    MemoryHandle handle{};  // registered by the caller (Buffer::handle), else none
    uint64_t offset = 0;
    bool device = false;
    uint64_t rtr = 0;  // the RTR offered for it (its engine recv is posted), else 0
  };
  // A recv with an RTR out: its engine recv on the data endpoint, and how it ends. The user's
  // callback runs once both the engine recv ended (`data_done`) and the recv's outcome is
  // known (`have_result`: the payload landed, or another path or a failure ended the recv).
  struct RtrRecv {
    int src;
    uint64_t id;
    std::shared_ptr<PostedRecv> r;
    Done user;
    MemoryHandle handle;
    bool owned = true;         // `handle` was registered by the mailbox
    bool data_done = false;
    bool payload = false;      // the RTR's payload landed (an RTR_DATA header, or the RTS it
                               // stands for, comes too)
    bool header_seen = false;  // its RTR_DATA header came
    uint64_t rts = 0;          // the sender's RTS that matched the recv (the RTR crossed it):
                               // the payload (the sender used the RTR for it) or a void comes
    bool have_result = false;
    bool finished = false;     // `user` ran
    Status result;
    uint64_t result_bytes = 0;
    Clock::time_point deadline;
  };
  // An RTR a sender holds until its message comes (or voids it).
  struct PendingRtr {
    uint64_t id, tag, n;
  };
  // A message whose header arrived before any recv matched it.
  struct Unexpected {
    int src;
    uint64_t tag;
    uint64_t length;
    std::vector<uint8_t> data;
    uint64_t charged = 0;  // bytes counted in unexpected_bytes_ for `data`
    bool dropped = false;  // no longer in unexpected_: release its bytes once the payload landed
    MemoryHandle handle;
    uint64_t rndv_id = 0;  // non-zero: a rendezvous header (nothing to land)
    bool rndv_read = false;  // RTS_READ: read `length` bytes at (region, offset) of the sender
    uint64_t region = 0, offset = 0;
    bool arrived = false;
    Status status;
    std::shared_ptr<PostedRecv> waiter;  // a recv matched it while the payload was in flight
  };
  // A rendezvous send: registered, waiting for its CTS (then its payload goes).
  struct RndvSend {
    int dst;
    uint64_t tag;
    uint64_t n;
    MemoryHandle payload;
    Done done;
    Clock::time_point deadline;
    bool sending = false;  // the CTS came: the payload is on its way
    uint64_t offset = 0;   // of the payload in `payload`
    bool owned = true;     // `payload` was registered by the mailbox (unregistered after)
    bool device = false;   // CUDA memory
    bool read = false;     // sent as RTS_READ: the peer reads it and answers FIN
  };
  // A rendezvous recv whose engine recv is posted into the destination (CTS sent).
  struct Landing {
    int src;
    std::shared_ptr<PostedRecv> r;
    MemoryHandle handle;
    Clock::time_point deadline;
    Status why;  // set when the mailbox gave up on it (the report once the engine lets go)
    bool owned = true;  // `handle` was registered by the mailbox
  };
  struct Peer {
    Endpoint ep;
    Endpoint data;
    Endpoint dev;  // CUDA payloads (may be invalid)
    std::set<uint64_t> announced;  // our regions whose descriptor this peer got (sender side)
    std::set<uint64_t> imported;   // its regions imported on `dev` (receiver side)
    // Reads waiting for the descriptor of their region (it is still landing), by region.
    std::map<uint64_t, std::vector<std::function<void()>>> awaiting;
    MemoryHandle hdr_handle;
    // The header recv lands here (one outstanding per peer): a Header, then up to
    // inline_bytes of an EAGER_INLINE payload.
    std::unique_ptr<uint64_t[]> in;
    Status failed;  // non-ok once the endpoint failed: later ops to this peer fail at once
    // Ready-to-receive, receiver side: message headers had from this peer, and our RTR recvs
    // by id (until their engine recv ended and, after a payload, its header came).
    uint64_t headers_in = 0;
    std::map<uint64_t, std::shared_ptr<RtrRecv>> rtr_recvs;
    // Sender side: message headers sent to it, the tags of the last kRtrHistory of them, and
    // its RTRs not yet used or voided, in arrival order.
    uint64_t headers_out = 0;
    struct Sent {
      uint64_t tag;
      uint64_t rts = 0;  // a host RTS: its message id (an RTR may then carry its payload)
    };
    std::deque<Sent> history;
    std::deque<PendingRtr> rtr_pending;
  };

  // Queues a task from an engine completion (progress_queue.hpp); the public calls submit().
  // `wake` false: bookkeeping that nobody waits for (ProgressQueue::post).
  void post(std::function<void()> task, bool wake = true);
  void post_header_recv(int peer);
  void on_header(int peer, const Status& st, uint64_t bytes);
  void on_inline(int peer, const Header& h, std::shared_ptr<PostedRecv> match);
  // An eager message of n <= inline_bytes in one engine message; false: no slot free.
  bool send_inline(int dst, uint64_t tag, const void* ptr, uint64_t n, Done& done);
  void fail_peer(int peer, const Status& st);
  void deliver(Unexpected& u, PostedRecv& r);
  // Allocates the stash of an eager message of `length` bytes from `peer`, within the bound.
  // On failure, fails the peer (and drops what it had stashed) and returns false.
  bool stash(int peer, Unexpected& u, uint64_t length);
  void release(Unexpected& u);  // frees its stash and uncounts it (idempotent)
  // The peer broke the bound: drop its stashed messages and close its control endpoint.
  void refuse_peer(int peer, const Status& why);
  // Header-only message on the control endpoint; `finish` runs as a progress task. Without
  // `left`, `finish` matters only on failure, so a success wakes nobody; with it, `left`
  // counts the engine completions the op still awaits (this one included) and the last
  // one, or a failure, wakes a runner.
  void send_ctrl(int peer, Header h, std::function<void(const Status&)> finish,
                 std::shared_ptr<std::atomic<int>> left = {});
  void on_cts(int peer, uint64_t id, bool dev);
  // The payload of rendezvous send `id` goes on `ep` (after its CTS, or on an RTR).
  void send_payload(int peer, uint64_t id, Endpoint& ep);
  void on_fin(int peer, uint64_t id, uint64_t code);
  // A recv matched an RTS_READ: read the payload from the sender's region (once its
  // descriptor is imported), then answer FIN.
  void start_read(int src, uint64_t id, uint64_t length, uint64_t region, uint64_t offset,
                  std::shared_ptr<PostedRecv> r);
  // Takes the `aux`-byte descriptor that follows an RTS_READ header from `peer`.
  void take_descriptor(int peer, uint64_t region, uint64_t bytes);
  void send_rts_read(int dst, const std::shared_ptr<RndvSend>& s, uint64_t id);
  void on_nack(int peer, uint64_t id, uint64_t their_n);
  // A recv matched the RTS `id` from `src`: post the recv into it and clear the send.
  void start_rndv_recv(int src, uint64_t id, uint64_t length, std::shared_ptr<PostedRecv> r);
  void drop_payload(RndvSend& s);  // unregisters the payload if the mailbox registered it
  // A landing's engine op ended with `st`: drops it (and its registration, if ours) and says
  // how its recv ends (`what` prefixes the engine's message).
  Status landed(Landing& l, const Status& st, const std::string& what);
  Status eager_into_device(int peer, uint64_t n) const;
  void send_eager(int dst, uint64_t tag, const void* ptr, uint64_t n, Done done);
  // Ready-to-receive (above). Receiver: offers one for `r` if it may (true: done).
  bool offer_rtr(const std::shared_ptr<PostedRecv>& r);
  void on_rtr_landed(const std::shared_ptr<RtrRecv>& s, const Status& st, uint64_t bytes);
  void on_rtr_data(int peer, const Header& h);
  void rtr_result(RtrRecv& s, const Status& st, uint64_t bytes);
  void rtr_settle(RtrRecv& s);  // runs the user's callback and forgets the RTR when both ends came
  // Sender: an RTR came; a message header of `tag` goes to `dst` (counted, remembered).
  void on_rtr(int peer, const Header& h);
  void count_out(int dst, uint64_t tag);
  // A recv with an RTR out matched an RTS of the same length: the payload or a void follows.
  void park_rts(RtrRecv& s, uint64_t id);
  // The id of the RTR `dst` gave for `tag` if a message of `n` bytes may use it (`usable`),
  // else 0; voids that RTR if it is not used, and every RTR that came before it.
  uint64_t claim_rtr(int dst, uint64_t tag, uint64_t n, bool usable);
  void void_rtrs(int peer, size_t count);  // the first `count` pending RTRs
  void send_rtr_data(int dst, uint64_t tag, const Buffer& b, uint64_t id, Done done);
  Status truncated(int peer, uint64_t tag, uint64_t length, uint64_t n) const;
  void expire();
  MemoryHandle reg(const void* ptr, uint64_t n);
  void unreg(MemoryHandle h);
  std::string who(int peer) const;

  Engine& engine_;
  Trace* trace_;  // null, or where headers, reads and completions are recorded (trace.hpp); outlives us
  Done traced(Done done);   // `done`, recorded in trace_ first
  const int rank_;
  std::chrono::milliseconds timeout_;
  const uint64_t rndv_bytes_;
  const uint64_t max_unexpected_bytes_;
  uint64_t unexpected_bytes_ = 0;  // stashed eager payloads held now (progress tasks)
  std::vector<Peer> peers_;
  // Touched by progress tasks only (one runs at a time).
  std::list<std::shared_ptr<PostedRecv>> posted_;
  std::list<std::shared_ptr<Unexpected>> unexpected_;
  std::map<uint64_t, std::shared_ptr<RndvSend>> rndv_sends_;  // by message id
  std::list<std::shared_ptr<Landing>> landing_;
  uint64_t next_id_ = 1;
  // Registered header slots for outgoing messages (a header must outlive its send).
  std::vector<Header> send_hdrs_;
  MemoryHandle send_hdrs_handle_;
  const uint64_t inline_bytes_;
  const bool recv_ready_;
  const bool quiet_;  // bookkeeping completions wake nobody (post())
  bool destroying_ = false;  // close() runs the progress work now
  std::atomic<uint64_t> rtr_offered_{0}, rtr_used_{0}, rtr_voided_{0};
  size_t inline_slot_ = 0;  // bytes per slot: a Header and inline_bytes_, rounded to 8
  std::unique_ptr<uint64_t[]> inline_out_;  // slots for outgoing EAGER_INLINE messages
  MemoryHandle inline_out_handle_;
  std::vector<uint32_t> free_inline_;
  std::vector<uint32_t> free_hdrs_;

  std::atomic<bool> closed_{false};
  // Runs the tasks (every touch of the state above), one at a time, on the threads that wait
  // for them (progress_queue.hpp). Shared with the Works and collective steps that drive it.
  std::shared_ptr<ProgressQueue> q_;
};

}  // namespace sluice::torch_backend
