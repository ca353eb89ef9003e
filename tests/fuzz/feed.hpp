// Shared by the fuzz targets: a connected socket pair whose far end plays the peer. The
// peer's bytes are written (and the far end shut for writing) from a thread, so an input
// larger than the socket buffer cannot deadlock against a reader on this thread; the thread
// then drains whatever the code under test answers, so its writes never block either.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace fuzz {

class FakePeer {
 public:
  FakePeer() {
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_) != 0) {
      std::perror("socketpair");
      std::abort();
    }
  }
  ~FakePeer() {
    finish();
    if (fds_[0] >= 0) ::close(fds_[0]);
  }
  // The end the code under test reads; release it to hand ownership over.
  int local() const { return fds_[0]; }
  int release_local() {
    int fd = fds_[0];
    fds_[0] = -1;
    return fd;
  }

  // Sends data then EOF, then reads (and drops) everything until the other end closes.
  void play(const uint8_t* data, size_t size) {
    thread_ = std::thread([this, data, size] {
      size_t off = 0;
      while (off < size) {
        ssize_t n = ::send(fds_[1], data + off, size - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;  // the code under test closed early: fine
        off += static_cast<size_t>(n);
      }
      ::shutdown(fds_[1], SHUT_WR);
      char sink[65536];
      while (true) {
        ssize_t n = ::recv(fds_[1], sink, sizeof(sink), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
      }
    });
  }
  // Reads only one reply first (the bootstrap reply of attach), before play().
  bool read_some(void* buf, size_t n) {
    size_t got = 0;
    while (got < n) {
      ssize_t k = ::recv(fds_[1], static_cast<char*>(buf) + got, n - got, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      got += static_cast<size_t>(k);
    }
    return true;
  }
  int remote() const { return fds_[1]; }
  // Waits for the peer thread; the local end must be closed (or shut down) first, or the
  // drain never sees EOF.
  void finish() {
    if (thread_.joinable()) thread_.join();
    if (fds_[1] >= 0) {
      ::close(fds_[1]);
      fds_[1] = -1;
    }
  }

 private:
  int fds_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace fuzz
