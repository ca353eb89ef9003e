// One framed, bidirectional byte stream (a connected socket), served by the engine-wide
// progress pool (progress_pool.hpp) rather than threads of its own. Callers post frames;
// frames go out on the caller's thread when the channel is idle (no hand-off), otherwise the
// channel's reactor drains the queue with non-blocking writev on EPOLLOUT. Received frames go
// to a Handler on the channel's receive fiber (on a reactor thread), which pulls the payload
// straight into its destination; a read that would block yields to the reactor.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bootstrap/socket.hpp"
#include "sluice/error.hpp"
#include "transport/common/frame.hpp"
#include "transport/common/progress_pool.hpp"

namespace sluice::detail {

struct OutFrame {
  FrameHeader hdr;
  const uint8_t* data = nullptr;  // payload (hdr.length bytes), or
  std::string text;               // an owned payload (messages)
  std::shared_ptr<void> keep;     // held until the frame is on the wire
  uint64_t sent = 0;              // bytes of header + payload already written
  bool response = false;          // answers a peer's request (counted: responses_queued())
  // `data` is valid only during post(): what the socket does not take then is copied into
  // `text` before post() returns (an eager SEND's caller may reuse its buffer at once, and
  // one the socket takes whole costs no copy).
  bool copy_unsent = false;
};

class StreamChannel;

// Pulls the current frame's payload; whatever the handler leaves is discarded.
class PayloadReader {
 public:
  uint64_t remaining() const { return remaining_; }
  // Read n (<= remaining) bytes into dest. False if the stream broke.
  bool read(void* dest, uint64_t n);
  bool discard(uint64_t n);
  std::string read_text(uint64_t max);

 private:
  friend class StreamChannel;
  explicit PayloadReader(StreamChannel& ch, uint64_t n) : ch_(ch), remaining_(n) {}
  StreamChannel& ch_;
  uint64_t remaining_;
};

class StreamChannel : private ReactorSource {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    // Called on the channel's receive fiber for every well-formed frame. Return a non-ok status to
    // declare the peer broken (the channel then stops).
    virtual Status on_frame(StreamChannel& ch, const FrameHeader& h, PayloadReader& payload) = 0;
    // The stream ended or broke (called once, on the receive fiber).
    virtual void on_channel_down(StreamChannel& ch, const Status& why) = 0;
    // Bytes of frame `h` (one of ours) were accepted by the socket: per-op progress. Called
    // on whichever thread writes, at most once per frame per write call.
    virtual void on_frame_sent(StreamChannel& ch, const FrameHeader& h) {}
  };

  // buffer_bytes: the socket's SO_SNDBUF/SO_RCVBUF, 0 = the kernel's (autotuned for TCP).
  StreamChannel(net::Socket sock, Handler* handler, int index, int buffer_bytes = 8 << 20);
  ~StreamChannel();
  void start();
  // Queue a frame; never blocks on the network. Dropped once the channel is down: false when
  // it was dropped now (the channel had stopped, or the write tried at once failed), true when
  // the socket took it or it waits in the queue.
  bool post(OutFrame frame);
  // Stop the channel (the handler hears on_channel_down); join() waits until the reactor holds
  // no reference to it any more. shutdown() is the local close: only after it does the
  // receive side report kCancelled. join() is safe from any thread and concurrently; from the
  // channel's own fiber it returns at once (no self-join), and from another fiber it waits by
  // yielding, so that the reactor it may share goes on serving.
  void shutdown();
  void join();
  // Waits until every frame posted so far has been taken by the socket (true), the channel
  // went down, or `deadline` passed (false). For a local close that must not drop frames whose
  // operations already completed (shm's eager SENDs). Not from a reactor thread: it sleeps.
  bool flush(std::chrono::steady_clock::time_point deadline);
  // Whether the caller runs on this channel's receive fiber, or is its reactor draining it.
  bool on_own_thread() const;
  // Responses (frames posted with `response`) waiting in the queue, not yet taken by a write.
  size_t responses_queued() const { return responses_queued_.load(std::memory_order_relaxed); }
  // How long frames have been waiting with no byte accepted by the socket (0 when nothing
  // waits): a peer that stops reading stalls the writer with frames (and pins) queued.
  std::chrono::steady_clock::duration write_stall(std::chrono::steady_clock::time_point now);
  int index() const { return index_; }
  // When bytes last moved on this socket, either way. A peer that is still accepting a long
  // write is not silent even though it has nothing to answer yet.
  std::chrono::steady_clock::time_point last_io() const {
    return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(last_io_.load(std::memory_order_relaxed)));
  }
  bool down() const { return down_.load(std::memory_order_acquire); }

  // Receiving on a waiting thread (WaiterReceive below: tcp's and shm's ProgressSource). A
  // thread that waits for a future borrows the receive fiber while it is parked on input,
  // sleeps in poll() on the socket itself and runs the fiber on its own thread when input
  // comes: the reply then costs no reactor wake-up and no hand-off from the reactor to the
  // waiter (the per-thread design had neither: its reader thread blocked in recv). While lent
  // the reactor does not watch for input (no second wake-up per message) and skips the
  // fiber's wake-ups; give_back() replays any it skipped.
  // Borrow the receive side: false unless the fiber is parked on input with no deadline.
  bool lend();
  // Borrower: run the fiber on this thread until it waits again or ends. revents: what
  // poll() reported for the socket (0: the fiber's deadline passed).
  void run_lent(short revents);
  // Borrower: when the parked fiber wants to run even without input ({}: only on input).
  std::chrono::steady_clock::time_point lent_until() const { return park_until_; }
  // Borrower: the fiber parked between two frames after a turn of work (worked()), with no
  // callback on its stack: it may be handed back to the reactor, which goes on with the next
  // frame, so a waiter whose future completed returns to its caller instead of serving the
  // rest of a long backlog.
  bool lent_between_frames() const { return between_frames_; }
  // Receive fiber (a frame handler): `bytes` of work this frame made the fiber do besides
  // reading it, such as a copy; counted with the bytes read towards the next fairness yield,
  // taken once the frame is done.
  void worked(uint64_t bytes) { worked_since_yield_ += bytes; }
  bool finished() const { return fiber_->finished(); }
  // Borrower: the reactor drives the receive side again (and detaches a finished fiber).
  void give_back();
  int fd() const { return sock_.fd(); }

 private:
  friend class PayloadReader;
  void reader_loop();
  // ReactorSource: readiness and wake-ups, on the reactor thread.
  void on_events(uint32_t events) override;
  void on_deadline() override;
  // Reactor thread: resume the fiber if it waits; after_resume() detaches a finished one.
  // `events`: the readiness that woke it, 0 for a timer or a posted wake-up.
  void wake_fiber(uint32_t events = 0);
  void after_resume(bool finished);  // finished: what parked() returned
  // Callers hold mu_: a write failed, the peer is gone.
  void write_failed(int err);
  // Reactor thread: write queued frames until the socket is full (EPOLLOUT resumes).
  void drain();
  // Ask the reactor to drain (a frame was queued while nobody writes).
  void kick();
  // Callers hold mu_: watch the socket for room (a write found it full) or stop watching.
  void want_output(bool on);
  // Receive fiber: one non-blocking read of up to n bytes (recv's result); a short one on a
  // clean wake sets drained_.
  ssize_t read_some(uint8_t* dest, size_t n);
  // Receive fiber: wait for input (or a wake-up, or `until`).
  void wait_input(std::chrono::steady_clock::time_point until = {});
  // Receive fiber: count bytes read; yield to the reactor every so often (fairness).
  void took(uint64_t bytes);
  // Write frames of `frames` without blocking, starting at their `sent` offsets; *fully_sent:
  // frames now wholly on the wire. Returns false on error. `progress`: report on_frame_sent.
  bool write_frames(std::vector<OutFrame>& frames, bool progress, size_t* fully_sent);
  // Buffer at least min_bytes; reads at most max_read more than that (exact header reads
  // keep large payloads out of the buffer so they land in place with one copy).
  bool fill(size_t min_bytes, size_t max_read);
  bool read_payload(uint8_t* dest, uint64_t n);

  net::Socket sock_;
  Handler* handler_;
  const int index_;
  std::shared_ptr<ProgressPool> pool_;  // keeps the reactors alive while we use them
  Reactor* reactor_ = nullptr;          // set by start(), read-only afterwards
  std::unique_ptr<Fiber> fiber_;        // the receive side (reader_loop)
  bool started_ = false;
  // Who runs the fiber: the reactor, or a thread that borrowed it (lend()).
  std::mutex recv_mu_;
  bool parked_ = false;       // under recv_mu_: the fiber waits in wait_input() (set by its resumer)
  bool lent_ = false;         // under recv_mu_: a borrower drives the fiber
  bool missed_wake_ = false;  // under recv_mu_: the reactor skipped a wake-up while lent
  // Fiber side, published by parking: wait_input's deadline ({}: none).
  std::chrono::steady_clock::time_point park_until_{};
  // Resumer: after fiber_->resume() returned, note whether it parked; true if it ended.
  bool parked();
  // A small message would otherwise cost a second read that only says EAGAIN. A stream
  // socket's read shorter than asked emptied the receive queue, but for urgent / out-of-band
  // data (which epoll reports as EPOLLPRI for as long as it is pending) and, on a unix
  // socket, a message carrying descriptors (which the kernel drops for us, flagging
  // MSG_CTRUNC). Under edge-triggered epoll every arrival after the report that woke the fiber
  // raises a new one, so after such a short read the fiber may wait without reading again;
  // not when the report carried more than plain input (a FIN, an error, urgent data: states
  // that raise no further edge) or the wake was no report at all (a timer, a posted wake-up).
  bool unix_ = false;         // set by start(): reads use recvmsg to see MSG_CTRUNC
  bool clean_wake_ = false;   // reactor thread: the fiber's last wake was a plain input report
  bool drained_ = false;      // receive fiber: a read since that wake left the socket empty
  uint64_t read_since_yield_ = 0;       // receive fiber only
  uint64_t worked_since_yield_ = 0;     // receive fiber only (worked())
  bool between_frames_ = false;         // receive fiber (and its borrower, on the same thread)
  bool finishing_ = false;              // under mu_: the fiber ended, the reactor's removal is queued
  bool detached_ = false;               // under mu_: the reactor dropped us (join() may return)
  std::condition_variable detached_cv_;
  std::atomic<bool> down_{false};
  std::atomic<std::chrono::steady_clock::rep> last_io_{std::chrono::steady_clock::now().time_since_epoch().count()};
  void touch_io() { last_io_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed); }
  std::atomic<std::chrono::steady_clock::rep> write_progress_{0};  // see write_stall()
  void touch_write() {
    write_progress_.store(std::chrono::steady_clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }

  // Guards every write into a payload's destination (an op's registered memory). shutdown()
  // sets dest_closed_ under it, so once shutdown() returns no byte lands in a destination any
  // more: the transport may then fail the ops and their owners may free the memory (without
  // this a fiber could still be copying buffered bytes of a read response into a buffer whose
  // future had already failed). Held only around non-blocking copies, never across a yield.
  std::mutex dest_mu_;
  bool dest_closed_ = false;

  std::mutex mu_;
  std::deque<OutFrame> queue_;
  bool writing_ = false;  // a thread (caller or reactor) owns the socket's send side
  bool out_armed_ = false;  // the reactor watches the socket for room (see want_output)
  bool input_off_ = false;  // the reactor does not watch for input (the receive side is lent)
  bool stop_ = false;     // the channel is going down (any reason)
  bool closing_ = false;  // shutdown() was called: a local close, not a peer failure
  int write_errno_ = 0;   // why a write failed (the peer is gone), 0 if none did
  std::atomic<size_t> responses_queued_{0};

  // Not zero-filled: an idle channel's buffer pages are never touched, so cost no memory.
  std::unique_ptr<uint8_t[]> rbuf_;
  size_t rpos_ = 0, rend_ = 0;
  bool exact_header_ = false;  // the last payload was large: read the next header alone
};

// The waiting-thread side of StreamChannel::lend, shared by the endpoints built on channels
// (tcp, shm): their ProgressSource::drive() and interrupt() forward here. The waiter borrows
// the channels the endpoint picks, sleeps in ppoll() on their sockets and an eventfd, and
// runs each channel's receive fiber on its own thread when input comes, so the reply that
// completes its future is read and completed right there (no reactor wake-up, no hand-off).
// A completion made on another thread (a copy worker, a channel it did not borrow, the
// watchdog, a failure) calls interrupt(), which ends the sleep.
class WaiterReceive {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kMaxLent = 64;  // channels one waiter borrows at most (its poll set)

  // `spin`: how long the waiter polls its sockets without sleeping, after it starts and after
  // each input (busy_wait_of(config); 0: it sleeps in ppoll at once). A peer that answers
  // within it costs no wake-up on either side: the sleeping waiter's wake-up is most of a
  // small message's round trip (shm send, 8 B: 23 us asleep).
  explicit WaiterReceive(std::chrono::microseconds spin = {});  // throws Error(kSystem) without an eventfd
  ~WaiterReceive();
  WaiterReceive(const WaiterReceive&) = delete;
  WaiterReceive& operator=(const WaiterReceive&) = delete;

  // End a driving waiter's sleep (any thread; harmless when nobody drives).
  void interrupt();

  // ProgressSource::drive(): `lend(StreamChannel** out, int max)` borrows channels with
  // StreamChannel::lend() and returns how many (0: the endpoint cannot be driven now: it
  // failed, closes, or its fibers are busy). It runs with the one-driver lock held. False if
  // this thread may not drive (it delivers completions itself: a reactor, a fiber, a
  // borrower; or another thread drives) or nothing was lent: the waiter then sleeps until
  // someone else completes its future. `who` names the transport in log lines.
  template <class Lend>
  bool drive(Lend&& lend, const std::atomic<bool>& done, Clock::time_point deadline, const char* who) {
    if (!may_drive_here()) return false;
    std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
    if (!lk.owns_lock()) return false;
    StreamChannel* lent[kMaxLent];
    int n = lend(lent, kMaxLent);
    if (n <= 0) return false;
    run(lent, n, done, deadline, who);
    return true;
  }

 private:
  static bool may_drive_here();
  // Poll the borrowed channels until `done` (and no fiber is mid-work) or the deadline; gives
  // every channel back.
  void run(StreamChannel** lent, int n, const std::atomic<bool>& done, Clock::time_point deadline, const char* who);

  std::mutex mu_;  // one driver at a time (it borrows the channels)
  int wakefd_ = -1;
  const std::chrono::microseconds spin_;
};

}  // namespace sluice::detail
