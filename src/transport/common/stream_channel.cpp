#include "transport/common/stream_channel.hpp"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "core/log.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {
constexpr size_t kReadBuffer = 256 << 10;
constexpr size_t kDirectRead = 32 << 10;  // payload reads this large bypass the buffer
constexpr size_t kMaxIov = 512;
constexpr size_t kMaxFramesPerWrite = kMaxIov / 2;
}  // namespace

bool PayloadReader::read(void* dest, uint64_t n) {
  if (n > remaining_) return false;
  remaining_ -= n;
  return ch_.read_payload(static_cast<uint8_t*>(dest), n);
}

bool PayloadReader::discard(uint64_t n) {
  uint8_t scratch[16384];
  while (n > 0) {
    uint64_t k = std::min<uint64_t>(n, sizeof(scratch));
    if (!read(scratch, k)) return false;
    n -= k;
  }
  return true;
}

std::string PayloadReader::read_text(uint64_t max) {
  uint64_t n = std::min(remaining_, max);
  std::string s(n, '\0');
  if (n && !read(s.data(), n)) return {};
  return s;
}

namespace {
// The channel whose fiber (or whose drain) runs on this thread now.
thread_local StreamChannel* tls_current = nullptr;
struct CurrentScope {
  StreamChannel* saved;
  explicit CurrentScope(StreamChannel* c) : saved(std::exchange(tls_current, c)) {}
  ~CurrentScope() { tls_current = saved; }
};
// Bytes one drain may write before it lets the reactor serve other channels.
constexpr size_t kDrainBytes = 16 << 20;
// Bytes the receive fiber reads before it yields to the reactor once.
constexpr uint64_t kYieldBytes = 1 << 20;
}  // namespace

StreamChannel::StreamChannel(net::Socket sock, Handler* handler, int index, int buffer_bytes)
    : sock_(std::move(sock)), handler_(handler), index_(index), rbuf_(new uint8_t[kReadBuffer]) {
  net::set_io_timeout(sock_.fd(), std::chrono::milliseconds(0));
  net::tune_stream(sock_.fd(), buffer_bytes);
}

StreamChannel::~StreamChannel() {
  shutdown();
  join();
}

void StreamChannel::start() {
  pool_ = ProgressPool::shared();
  reactor_ = &pool_->pick();
  net::set_nonblocking(sock_.fd());
  int domain = 0;
  socklen_t dlen = sizeof(domain);
  // Unknown: treat as unix (recvmsg works on any socket and reports MSG_CTRUNC if it applies).
  unix_ = ::getsockopt(sock_.fd(), SOL_SOCKET, SO_DOMAIN, &domain, &dlen) != 0 || domain == AF_UNIX;
  fiber_ = std::make_unique<Fiber>([this] { reader_loop(); });
  std::lock_guard<std::mutex> lk(mu_);
  started_ = true;
  reactor_->add(sock_.fd(), this);
  if (out_armed_) reactor_->watch(sock_.fd(), this, true, true);  // a write before start() filled it
  reactor_->post([this] {
    {
      CurrentScope cur(this);
      fiber_->resume();
    }
    after_resume(parked());
  });
}

bool StreamChannel::parked() {
  // Read here, under recv_mu_: once parked_ is published a waiter may borrow the fiber and
  // run it to its end while we still look at it.
  std::lock_guard<std::mutex> lk(recv_mu_);
  parked_ = !fiber_->finished();
  return !parked_;
}

void StreamChannel::after_resume(bool finished) {
  if (!finished) return;
  // The receive side ended: the reactor lets go of us, then join() may return.
  std::lock_guard<std::mutex> lk(mu_);
  finishing_ = true;
  reactor_->remove(sock_.fd(), this, [this] {
    std::lock_guard<std::mutex> l(mu_);
    detached_ = true;
    detached_cv_.notify_all();
  });
}

void StreamChannel::wake_fiber(uint32_t events) {
  // Any wake but a timer may mean new input (or a local shutdown): read before waiting again.
  {
    std::lock_guard<std::mutex> lk(recv_mu_);
    if (lent_) {
      missed_wake_ = true;  // the borrower sees input itself; give_back() replays the rest
      return;
    }
    if (!parked_) return;
    parked_ = false;
  }
  clean_wake_ = events != 0 && (events & ~uint32_t{EPOLLIN | EPOLLOUT}) == 0;
  reactor_->cancel_wake(this);
  {
    CurrentScope cur(this);
    fiber_->resume();
  }
  after_resume(parked());
}

bool StreamChannel::lend() {
  {
    std::lock_guard<std::mutex> lk(recv_mu_);
    // A fiber parked with a deadline has the reactor's timer: left to the reactor.
    if (!parked_ || lent_ || park_until_ != std::chrono::steady_clock::time_point{}) return false;
    lent_ = true;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!input_off_ && !finishing_) {
    input_off_ = true;
    reactor_->watch(sock_.fd(), this, false, out_armed_);
  }
  return true;
}

void StreamChannel::run_lent(short revents) {
  {
    std::lock_guard<std::mutex> lk(recv_mu_);
    parked_ = false;
  }
  // Poll is level-triggered: a plain input report after a short read proves nothing was
  // left unread, as an edge does (see drained_).
  clean_wake_ = revents == POLLIN;
  // Completion callbacks run here, as on a reactor: a close from one must not wait for us.
  const bool was_transport = std::exchange(tls_transport_thread, true);
  {
    CurrentScope cur(this);
    fiber_->resume();
  }
  tls_transport_thread = was_transport;
  parked();
}

void StreamChannel::give_back() {
  bool replay, finished;
  {
    std::lock_guard<std::mutex> lk(recv_mu_);
    // Read before lent_ drops: from then on the reactor may resume (and end) a parked fiber.
    finished = !parked_;
    lent_ = false;
    // A wake-up the reactor skipped, or a deadline only the borrower knew: the reactor runs
    // the fiber once (an early wake is harmless: every waiter re-checks its condition).
    replay = parked_ && (missed_wake_ || park_until_ != std::chrono::steady_clock::time_point{});
    missed_wake_ = false;
  }
  if (finished) {
    after_resume(true);
    return;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (finishing_) return;  // the reactor ran it to its end meanwhile and detaches it
  if (input_off_) {
    input_off_ = false;
    reactor_->watch(sock_.fd(), this, true, out_armed_);  // reports input that came meanwhile
  }
  if (replay) reactor_->post([this] { wake_fiber(); });  // queued before any removal (finishing_)
}

void StreamChannel::on_events(uint32_t events) {
  if (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)) drain();
  if (events & (EPOLLIN | EPOLLPRI | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) wake_fiber(events);
}

void StreamChannel::on_deadline() { wake_fiber(); }

void StreamChannel::wait_input(std::chrono::steady_clock::time_point until) {
  // On a borrower's thread the borrower keeps the deadline (lent_until()).
  park_until_ = until;
  if (until != std::chrono::steady_clock::time_point{} && reactor_->on_thread()) reactor_->wake_at(this, until);
  fiber_->yield();
  park_until_ = {};
  drained_ = false;  // whatever woke us may have brought input
}

ssize_t StreamChannel::read_some(uint8_t* dest, size_t n) {
  ssize_t r;
  bool cut = false;  // the read stopped at a message that carried descriptors
  if (unix_) {
    iovec iov{dest, n};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    r = ::recvmsg(sock_.fd(), &msg, 0);
    cut = (msg.msg_flags & MSG_CTRUNC) != 0;
  } else {
    r = ::recv(sock_.fd(), dest, n, 0);
  }
  if (r > 0) {
    touch_io();
    drained_ = clean_wake_ && static_cast<size_t>(r) < n && !cut;
  }
  return r;
}

void StreamChannel::took(uint64_t bytes) {
  // A peer that never pauses would keep the fiber reading forever: every kYieldBytes it lets
  // the reactor serve the rest (this channel's own send backlog, other channels) first.
  read_since_yield_ += bytes;
  if (read_since_yield_ < kYieldBytes) return;
  read_since_yield_ = 0;
  // Parked with a deadline of now, not woken by a posted task: lend() leaves a fiber with a
  // deadline to the reactor, so a waiter cannot borrow it meanwhile and then wait on a socket
  // that may stay empty (the bytes that brought us here can be the last of a reply). The
  // reactor resumes us after this round of events; a borrower (run_lent) after one round
  // over its other channels.
  wait_input(std::chrono::steady_clock::now());
}

bool StreamChannel::flush(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  // The reactor writes what is queued as the socket takes it (EPOLLOUT is armed while frames
  // wait): this only watches the queue empty.
  while (!stop_ && (!queue_.empty() || writing_)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    lk.lock();
  }
  return queue_.empty() && !writing_;
}

void StreamChannel::kick() {
  // Callers hold mu_ and checked !finishing_: the task is queued before the reactor's
  // removal task, so it never runs on a destroyed channel.
  reactor_->post([this] { drain(); });
}

void StreamChannel::want_output(bool on) {
  // Callers hold mu_; once finishing_ the reactor drops the descriptor, leave it be.
  if (on == out_armed_ || finishing_) return;
  out_armed_ = on;
  if (started_) reactor_->watch(sock_.fd(), this, !input_off_, on);  // else start() arms it
}

bool StreamChannel::on_own_thread() const { return tls_current == this; }

void StreamChannel::shutdown() {
  {
    // Waits for a copy into a destination in progress on the channel's fiber; none starts after.
    std::lock_guard<std::mutex> lk(dest_mu_);
    dest_closed_ = true;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    closing_ = true;
    // The socket's hang-up wakes the fiber; this makes sure of it (any socket family).
    if (started_ && !finishing_) reactor_->post([this] { wake_fiber(); });
  }
  sock_.shutdown();
}

void StreamChannel::join() {
  // The watchdog, a user's close() and Engine::close() may all get here at once; each waits
  // until the reactor dropped the channel. The channel's own fiber (a completion callback
  // closing its endpoint) waits for nothing: it is what the others wait for.
  if (on_own_thread()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!started_) return;
  }
  if (Fiber::current() && tls_current) {
    // Another channel's fiber, maybe on the same reactor: wait by yielding to it.
    StreamChannel* me = tls_current;
    for (;;) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (detached_) return;
      }
      me->wait_input(std::chrono::steady_clock::now() + std::chrono::milliseconds(1));
    }
  }
  if (ProgressPool::on_reactor_thread()) {
    // A reactor thread outside any fiber cannot wait (it would wait for itself).
    SLUICE_LOG(kError, "stream channel: join() on a progress thread outside a channel; not waiting");
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  detached_cv_.wait(lk, [&] { return detached_; });
}

std::chrono::steady_clock::duration StreamChannel::write_stall(std::chrono::steady_clock::time_point now) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (queue_.empty() && !writing_) return {};
  }
  auto since = std::chrono::steady_clock::time_point(
      std::chrono::steady_clock::duration(write_progress_.load(std::memory_order_relaxed)));
  return now > since ? now - since : std::chrono::steady_clock::duration{};
}

void StreamChannel::write_failed(int err) {
  // The peer is gone (not a local close): the receive side reports kPeerLost, never
  // kCancelled. Callers hold mu_.
  stop_ = true;
  if (!write_errno_) write_errno_ = err ? err : EPIPE;
  queue_.clear();  // frames never sent are dropped here, releasing what they hold (pins)
  responses_queued_.store(0, std::memory_order_relaxed);
}

namespace {

// OutFrame::copy_unsent: the frame stays queued after post() returns, so it takes a copy.
void own_payload(OutFrame& f) {
  if (!f.copy_unsent || !f.data) return;
  f.text.assign(reinterpret_cast<const char*>(f.data), f.hdr.length);
  f.data = nullptr;
  f.copy_unsent = false;
}

}  // namespace

bool StreamChannel::post(OutFrame frame) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) return false;
  if (writing_ || !queue_.empty()) {
    own_payload(frame);
    // Whoever writes now takes it, or the reactor does when the socket has room again.
    if (frame.response) responses_queued_.fetch_add(1, std::memory_order_relaxed);
    queue_.push_back(std::move(frame));
    return true;
  }
  // Idle channel: write on the caller's thread, without blocking; the reactor takes over
  // whatever the socket buffer did not accept.
  writing_ = true;
  touch_write();  // the stall clock starts now, not at the last write long ago
  lk.unlock();
  std::vector<OutFrame> one;
  one.push_back(std::move(frame));
  size_t done = 0;
  bool ok = write_frames(one, /*progress=*/false, &done);
  const int err = errno;
  lk.lock();
  writing_ = false;
  if (!ok) {
    write_failed(err);
    lk.unlock();
    sock_.shutdown();
    return false;
  }
  if (done == 0) {
    // The socket is full: the reactor writes the rest when it has room (arming reports room
    // that came back meanwhile, so no edge is lost).
    if (one[0].response) responses_queued_.fetch_add(1, std::memory_order_relaxed);
    own_payload(one[0]);
    queue_.push_front(std::move(one[0]));
    want_output(true);
  } else if (!queue_.empty() && !finishing_) {
    // Frames other threads queued while we held the send side.
    kick();
  }
  return true;
}

void StreamChannel::drain() {
  CurrentScope cur(this);
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) {
    queue_.clear();
    responses_queued_.store(0, std::memory_order_relaxed);
    return;
  }
  if (writing_) return;
  if (queue_.empty()) {
    want_output(false);
    return;
  }
  writing_ = true;
  std::vector<OutFrame> batch;
  size_t written = 0;
  for (;;) {
    while (!queue_.empty() && batch.size() < kMaxFramesPerWrite) {
      if (queue_.front().response) responses_queued_.fetch_sub(1, std::memory_order_relaxed);
      written += sizeof(FrameHeader) + queue_.front().hdr.length;
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    lk.unlock();
    size_t done = 0;
    bool ok = write_frames(batch, /*progress=*/true, &done);
    const int err = errno;
    lk.lock();
    if (!ok) {
      writing_ = false;
      write_failed(err);
      lk.unlock();
      sock_.shutdown();
      return;
    }
    const bool full = done < batch.size();
    // Frames the socket did not take go back to the front, in order.
    for (size_t i = batch.size(); i-- > done;) {
      if (batch[i].response) responses_queued_.fetch_add(1, std::memory_order_relaxed);
      queue_.push_front(std::move(batch[i]));
    }
    batch.clear();
    if (full) {
      want_output(true);  // the next EPOLLOUT edge brings us back
      break;
    }
    if (queue_.empty()) {
      want_output(false);  // idle again: no wake-up per message the peer reads
      break;
    }
    if (written >= kDrainBytes) {
      // Let the other channels of this reactor have a turn, then carry on.
      if (!finishing_) kick();
      break;
    }
  }
  writing_ = false;
}

bool StreamChannel::write_frames(std::vector<OutFrame>& frames, bool progress, size_t* fully_sent) {
  size_t first = 0;
  while (first < frames.size()) {
    iovec iov[kMaxIov];
    int n = 0;
    for (size_t i = first; i < frames.size() && n + 2 <= static_cast<int>(kMaxIov); ++i) {
      OutFrame& f = frames[i];
      const uint64_t hlen = sizeof(FrameHeader);
      const uint8_t* payload = f.data ? f.data : reinterpret_cast<const uint8_t*>(f.text.data());
      if (f.sent < hlen) {
        iov[n++] = {reinterpret_cast<uint8_t*>(&f.hdr) + f.sent, hlen - f.sent};
        if (f.hdr.length) iov[n++] = {const_cast<uint8_t*>(payload), f.hdr.length};
      } else {
        uint64_t off = f.sent - hlen;
        iov[n++] = {const_cast<uint8_t*>(payload + off), f.hdr.length - off};
      }
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t w = ::sendmsg(sock_.fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // The socket buffer is full: the reactor goes on when it has room (EPOLLOUT).
        *fully_sent = first;
        return true;
      }
      return false;
    }
    if (w > 0) {
      touch_io();
      touch_write();
    }
    uint64_t left = static_cast<uint64_t>(w);
    while (first < frames.size() && left > 0) {
      OutFrame& f = frames[first];
      uint64_t total = sizeof(FrameHeader) + f.hdr.length;
      uint64_t take = std::min(left, total - f.sent);
      f.sent += take;
      left -= take;
      // Frames the caller's thread writes at once left right after their op was added (which
      // stamped it): only the reactor, draining a backlog, reports progress.
      if (progress && !f.response) handler_->on_frame_sent(*this, f.hdr);
      if (f.sent == total) {
        f.keep.reset();
        ++first;
      }
    }
  }
  *fully_sent = frames.size();
  return true;
}

bool StreamChannel::fill(size_t min_bytes, size_t max_read) {
  if (rend_ - rpos_ >= min_bytes) return true;
  if (rpos_ > 0) {
    std::memmove(rbuf_.get(), rbuf_.get() + rpos_, rend_ - rpos_);
    rend_ -= rpos_;
    rpos_ = 0;
  }
  while (rend_ < min_bytes) {
    if (drained_) {
      wait_input();
      continue;
    }
    size_t room = std::min(kReadBuffer - rend_, std::max(max_read, min_bytes - rend_));
    // Read before waiting unless drained_ proves the socket empty: a short read alone does not
    // (data and the peer's FIN can arrive together, and edge-triggered epoll reports them once).
    ssize_t r = read_some(rbuf_.get() + rend_, room);
    if (r > 0) {
      rend_ += static_cast<size_t>(r);
      took(static_cast<uint64_t>(r));
    } else if (r == 0) {
      errno = ECONNRESET;
      return false;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_input();  // the reactor serves the other channels meanwhile
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool StreamChannel::read_payload(uint8_t* dest, uint64_t n) {
  uint64_t have = std::min<uint64_t>(n, rend_ - rpos_);
  {
    std::lock_guard<std::mutex> lk(dest_mu_);
    if (dest_closed_) {
      errno = ECONNRESET;
      return false;
    }
    std::memcpy(dest, rbuf_.get() + rpos_, have);
  }
  rpos_ += have;
  dest += have;
  n -= have;
  if (n == 0) return true;
  if (n >= kDirectRead) {
    // Straight into the destination, as it arrives; waits yield to the reactor.
    exact_header_ = true;
    while (n > 0) {
      if (drained_) {
        wait_input();
        continue;
      }
      ssize_t r;
      {
        std::lock_guard<std::mutex> lk(dest_mu_);  // non-blocking recv: never held across a wait
        if (dest_closed_) {
          errno = ECONNRESET;
          return false;
        }
        r = read_some(dest, n);
      }
      if (r > 0) {
        dest += r;
        n -= static_cast<uint64_t>(r);
        took(static_cast<uint64_t>(r));
      } else if (r == 0) {
        errno = ECONNRESET;
        return false;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wait_input();
      } else if (errno != EINTR) {
        return false;
      }
    }
    return true;
  }
  if (!fill(n, kReadBuffer)) return false;
  {
    std::lock_guard<std::mutex> lk(dest_mu_);
    if (dest_closed_) {
      errno = ECONNRESET;
      return false;
    }
    std::memcpy(dest, rbuf_.get() + rpos_, n);
  }
  rpos_ += n;
  return true;
}

void StreamChannel::reader_loop() {
  Status why{ErrorCode::kPeerLost, "connection closed by peer"};
  for (;;) {
    bool exact = exact_header_;
    exact_header_ = false;
    if (!fill(sizeof(FrameHeader), exact ? sizeof(FrameHeader) : kReadBuffer)) {
      const int err = errno;
      bool closing;
      int write_err;
      {
        std::lock_guard<std::mutex> lk(mu_);  // closing_ is written under mu_ by shutdown()
        closing = closing_;
        write_err = write_errno_;
      }
      // kCancelled only for a local close: a failed write (stop_ set by the writer) or an
      // EOF / reset means the peer is gone.
      if (closing) why = {ErrorCode::kCancelled, "channel closed"};
      else if (write_err) why = {ErrorCode::kPeerLost, std::string("connection to peer lost (write failed): ") + net::errno_text(write_err)};
      else why = {ErrorCode::kPeerLost, std::string("connection to peer lost: ") + net::errno_text(err)};
      break;
    }
    FrameHeader h;
    std::memcpy(&h, rbuf_.get() + rpos_, sizeof(h));
    const char* problem = frame_problem(h);
    if (*problem) {
      why = {ErrorCode::kProtocol, std::string("peer sent a malformed frame (") + problem + ")"};
      OutFrame err;
      err.text = why.message;
      err.hdr = make_frame(FrameType::kError, 0, 0, 0, err.text.size(), 0, 0, 0, static_cast<uint16_t>(why.code));
      post(std::move(err));
      break;
    }
    rpos_ += sizeof(h);
    PayloadReader payload(*this, h.length);
    Status st = handler_->on_frame(*this, h, payload);
    if (st.ok() && payload.remaining() && !payload.discard(payload.remaining()))
      st = {ErrorCode::kPeerLost, "connection to peer lost mid-frame"};
    if (st.ok() && worked_since_yield_ + read_since_yield_ >= kYieldBytes) {
      // A frame can cost far more than its bytes (shm's SEND_RTS copies a message): after a
      // turn of such work the fiber yields between frames, as took() does within reads.
      worked_since_yield_ = read_since_yield_ = 0;
      between_frames_ = true;
      wait_input(std::chrono::steady_clock::now());
      between_frames_ = false;
    }
    if (!st.ok()) {
      why = st;
      if (st.code == ErrorCode::kProtocol) {
        OutFrame err;
        err.text = why.message;
        err.hdr = make_frame(FrameType::kError, 0, 0, 0, err.text.size(), 0, 0, 0, static_cast<uint16_t>(why.code));
        post(std::move(err));
      }
      break;
    }
  }
  down_.store(true, std::memory_order_release);
  {
    // Give a just-posted error frame a moment to leave before the socket goes down (waiting
    // by yielding: the reactor drains it meanwhile).
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_ && (!queue_.empty() || writing_) && std::chrono::steady_clock::now() < until) {
      if (!writing_) kick();
      lk.unlock();
      wait_input(std::min(until, std::chrono::steady_clock::now() + std::chrono::milliseconds(1)));
      lk.lock();
    }
    stop_ = true;
    queue_.clear();  // frames never sent are dropped here, releasing what they hold (pins)
    responses_queued_.store(0, std::memory_order_relaxed);
  }
  sock_.shutdown();
  handler_->on_channel_down(*this, why);
}

WaiterReceive::WaiterReceive(std::chrono::microseconds spin)
    : wakefd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)), spin_(spin) {
  if (wakefd_ < 0) throw Error(ErrorCode::kSystem, "waiting-thread receive: eventfd: " + std::string(std::strerror(errno)));
}

WaiterReceive::~WaiterReceive() { ::close(wakefd_); }

void WaiterReceive::interrupt() {
  uint64_t one = 1;
  (void)!::write(wakefd_, &one, sizeof(one));
}

// Not on a thread that delivers completions: a callback that waits there would run fibers
// from inside one (a reactor, a channel's fiber, a borrower running one).
bool WaiterReceive::may_drive_here() { return !tls_transport_thread && !Fiber::current(); }

void WaiterReceive::run(StreamChannel** lent, int n, const std::atomic<bool>& done, Clock::time_point deadline,
                        const char* who) {
  pollfd fds[kMaxLent + 1];
  auto spin_until = spin_.count() > 0 ? Clock::now() + spin_ : Clock::time_point{};
  while (n > 0) {
    auto now = Clock::now();
    if (now >= deadline) break;
    // A fiber parked with a deadline is mid-work, not waiting for input: a fairness yield,
    // or a completion callback on this thread that closes the endpoint and waits for its
    // other channels. Ours to finish even once our future is done: handed back, it would go
    // on on a reactor after wait() returned (and the callback's captures could then be the
    // endpoint's last owner, destroying it on its own fiber). Except a fiber that yielded
    // between two frames (lent_between_frames): nothing of it is on our stack, and keeping it
    // would hold a waiter whose future is done serving another side's backlog (shm: a
    // receiver that could not post its next recvs while it copied later messages into the
    // unexpected-message buffer, until that was full).
    bool busy = false;
    auto until = deadline;
    for (int i = 0; i < n; ++i) {
      fds[i] = {lent[i]->fd(), POLLIN | POLLRDHUP, 0};
      auto u = lent[i]->lent_until();
      if (u != Clock::time_point{}) {
        until = std::min(until, u);
        busy = busy || !lent[i]->lent_between_frames();
      }
    }
    if (!busy && done.load(std::memory_order_acquire)) break;
    fds[n] = {wakefd_, POLLIN, 0};
    timespec ts{};
    timespec* tsp = nullptr;
    if (now < spin_until) {
      tsp = &ts;  // polling: a zero timeout, no sleep
    } else if (until != Clock::time_point::max()) {
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::max(until - now, Clock::duration{})).count();
      ts.tv_sec = static_cast<time_t>(ns / 1000000000);
      ts.tv_nsec = static_cast<long>(ns % 1000000000);
      tsp = &ts;
    }
    int r = ::ppoll(fds, static_cast<nfds_t>(n + 1), tsp, nullptr);
    if (r < 0) {
      if (errno == EINTR) continue;
      SLUICE_LOG(kError, who << ": poll on a waiting thread: " << std::strerror(errno));
      break;
    }
    if (r == 0 && !busy && now < spin_until) continue;  // nothing yet: poll again while the spin lasts
    if (fds[n].revents) {
      uint64_t v;
      (void)!::read(wakefd_, &v, sizeof(v));
    }
    now = Clock::now();
    if (r > 0 && spin_.count() > 0) spin_until = now + spin_;  // input: the next answer may be as close
    int kept = 0;
    for (int i = 0; i < n; ++i) {
      StreamChannel* ch = lent[i];
      auto u = ch->lent_until();
      if (fds[i].revents || (u != Clock::time_point{} && u <= now)) ch->run_lent(fds[i].revents);
      if (ch->finished()) ch->give_back();  // the channel ended: the reactor detaches it
      else lent[kept++] = ch;
    }
    n = kept;
  }
  for (int i = 0; i < n; ++i) lent[i]->give_back();
}

}  // namespace sluice::detail
