#include "transport/common/stream_channel.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "core/log.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {
constexpr size_t kReadBuffer = 256 << 10;
constexpr size_t kDirectRead = 32 << 10;  // payload reads this large bypass the buffer
constexpr size_t kMaxIov = 512;
constexpr size_t kMaxFramesPerWrite = kMaxIov / 2;
constexpr size_t kMaxWriteBytes = 4 << 20;
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

StreamChannel::StreamChannel(net::Socket sock, Handler* handler, int index)
    : sock_(std::move(sock)), handler_(handler), index_(index), rbuf_(kReadBuffer) {
  net::set_io_timeout(sock_.fd(), std::chrono::milliseconds(0));
  net::tune_stream(sock_.fd());
}

StreamChannel::~StreamChannel() {
  shutdown();
  join();
}

void StreamChannel::start() {
  // The threads start by taking mu_, so they see their ids (on_own_thread()) set.
  std::lock_guard<std::mutex> lk(mu_);
  reader_ = std::thread([this] {
    { std::lock_guard<std::mutex> l(mu_); }
    tls_transport_thread = true;
    reader_loop();
  });
  writer_ = std::thread([this] {
    { std::lock_guard<std::mutex> l(mu_); }
    tls_transport_thread = true;
    writer_loop();
  });
  reader_id_ = reader_.get_id();
  writer_id_ = writer_.get_id();
}

bool StreamChannel::on_own_thread() const {
  auto self = std::this_thread::get_id();
  return self == reader_id_ || self == writer_id_;
}

void StreamChannel::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    closing_ = true;
    cv_.notify_all();
  }
  sock_.shutdown();
}

void StreamChannel::join() {
  // The watchdog, a user's close() and Engine::close() may all get here at once: joinable()
  // and join() on one std::thread from two threads race (and a joiner left behind used to
  // join a reused handle later). One joiner at a time; the others wait, then find nothing
  // joinable. A channel thread (a completion callback closing its endpoint) joins nothing:
  // it would join itself or wait on a joiner that waits for it.
  if (on_own_thread()) return;
  std::lock_guard<std::mutex> lk(join_mu_);
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
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

void StreamChannel::post(OutFrame frame) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stop_) return;
  if (writing_ || !queue_.empty()) {
    if (frame.response) responses_queued_.fetch_add(1, std::memory_order_relaxed);
    queue_.push_back(std::move(frame));
    if (!writing_) cv_.notify_one();
    return;
  }
  // Idle channel: write on the caller's thread, without blocking; the writer thread takes
  // over whatever the socket buffer did not accept.
  writing_ = true;
  touch_write();  // the stall clock starts now, not at the last write long ago
  lk.unlock();
  std::vector<OutFrame> one;
  one.push_back(std::move(frame));
  size_t done = 0;
  bool ok = write_frames(one, /*nonblocking=*/true, &done);
  const int err = errno;
  lk.lock();
  writing_ = false;
  if (!ok) {
    // The peer is gone (not a local close): the reader reports kPeerLost, never kCancelled.
    stop_ = true;
    if (!write_errno_) write_errno_ = err ? err : EPIPE;
  } else if (done == 0) {
    if (one[0].response) responses_queued_.fetch_add(1, std::memory_order_relaxed);
    queue_.push_front(std::move(one[0]));
  }
  if (!queue_.empty() || stop_) cv_.notify_one();
}

bool StreamChannel::write_frames(std::vector<OutFrame>& frames, bool nonblocking, size_t* fully_sent) {
  size_t first = 0;
  while (first < frames.size()) {
    iovec iov[kMaxIov];
    int n = 0;
    // A blocking call gets at most kMaxWriteBytes: it returns only once it wrote all it was
    // given, and its return is what stamps progress (write_stall(), per-op progress).
    size_t budget = nonblocking ? SIZE_MAX : kMaxWriteBytes;
    auto add = [&](const uint8_t* p, uint64_t len) {
      size_t k = static_cast<size_t>(std::min<uint64_t>(len, budget));
      iov[n++] = {const_cast<uint8_t*>(p), k};
      budget -= k;
    };
    for (size_t i = first; i < frames.size() && n + 2 <= static_cast<int>(kMaxIov) && budget > 0; ++i) {
      OutFrame& f = frames[i];
      const uint64_t hlen = sizeof(FrameHeader);
      const uint8_t* payload = f.data ? f.data : reinterpret_cast<const uint8_t*>(f.text.data());
      if (f.sent < hlen) {
        add(reinterpret_cast<const uint8_t*>(&f.hdr) + f.sent, hlen - f.sent);
        if (f.hdr.length && budget > 0) add(payload, f.hdr.length);
      } else {
        uint64_t off = f.sent - hlen;
        add(payload + off, f.hdr.length - off);
      }
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    ssize_t w = ::sendmsg(sock_.fd(), &msg, MSG_NOSIGNAL | (nonblocking ? MSG_DONTWAIT : 0));
    if (w < 0) {
      if (errno == EINTR) continue;
      if (nonblocking && (errno == EAGAIN || errno == EWOULDBLOCK)) {
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
      // stamped it): only the writer thread, draining a backlog, reports progress.
      if (!nonblocking && !f.response) handler_->on_frame_sent(*this, f.hdr);
      if (f.sent == total) {
        f.keep.reset();
        ++first;
      }
    }
    if (nonblocking && first < frames.size()) {
      // The socket buffer is full: hand the rest to the writer thread.
      *fully_sent = first;
      return true;
    }
  }
  *fully_sent = frames.size();
  return true;
}

void StreamChannel::writer_loop() {
  std::vector<OutFrame> batch;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || (!writing_ && !queue_.empty()); });
    if (stop_) break;
    writing_ = true;
    touch_write();
    batch.clear();
    while (!queue_.empty() && batch.size() < kMaxFramesPerWrite) {
      if (queue_.front().response) responses_queued_.fetch_sub(1, std::memory_order_relaxed);
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    lk.unlock();
    size_t done = 0;
    bool ok = write_frames(batch, /*nonblocking=*/false, &done);
    const int err = errno;
    batch.clear();
    lk.lock();
    writing_ = false;
    if (!ok) {
      // A write failed: the peer is gone unless shutdown() (a local close) caused it.
      stop_ = true;
      if (!write_errno_) write_errno_ = err ? err : EPIPE;
      break;
    }
  }
  // Frames never sent are dropped here, releasing what they hold (region pins).
  queue_.clear();
  responses_queued_.store(0, std::memory_order_relaxed);
  lk.unlock();
  sock_.shutdown();
}

bool StreamChannel::fill(size_t min_bytes, size_t max_read) {
  if (rend_ - rpos_ >= min_bytes) return true;
  if (rpos_ > 0) {
    std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rend_ - rpos_);
    rend_ -= rpos_;
    rpos_ = 0;
  }
  while (rend_ < min_bytes) {
    size_t room = std::min(rbuf_.size() - rend_, std::max(max_read, min_bytes - rend_));
    ssize_t r = ::recv(sock_.fd(), rbuf_.data() + rend_, room, 0);
    if (r > 0) {
      touch_io();
      rend_ += static_cast<size_t>(r);
    } else if (r == 0) {
      errno = ECONNRESET;
      return false;
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool StreamChannel::read_payload(uint8_t* dest, uint64_t n) {
  uint64_t have = std::min<uint64_t>(n, rend_ - rpos_);
  std::memcpy(dest, rbuf_.data() + rpos_, have);
  rpos_ += have;
  dest += have;
  n -= have;
  if (n == 0) return true;
  if (n >= kDirectRead) {
    exact_header_ = true;
    bool ok = net::read_full(sock_.fd(), dest, n);
    touch_io();
    return ok;
  }
  if (!fill(n, rbuf_.size())) return false;
  std::memcpy(dest, rbuf_.data() + rpos_, n);
  rpos_ += n;
  return true;
}

void StreamChannel::reader_loop() {
  Status why{ErrorCode::kPeerLost, "connection closed by peer"};
  for (;;) {
    bool exact = exact_header_;
    exact_header_ = false;
    if (!fill(sizeof(FrameHeader), exact ? sizeof(FrameHeader) : rbuf_.size())) {
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
    std::memcpy(&h, rbuf_.data() + rpos_, sizeof(h));
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
    // Give a just-posted error frame a moment to leave before the socket goes down.
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, std::chrono::milliseconds(50), [&] { return queue_.empty() && !writing_; });
    stop_ = true;
    cv_.notify_all();
  }
  sock_.shutdown();
  handler_->on_channel_down(*this, why);
}

}  // namespace sluice::detail
