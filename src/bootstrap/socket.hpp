// Thin RAII and helpers over TCP sockets; every failure throws sluice::Error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace sluice::net {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void close();
  // Unblocks threads sitting in recv/send on this socket without closing the descriptor.
  void shutdown();

 private:
  int fd_ = -1;
};

// Connects, giving each of host's addresses `timeout`. An attempt not connected after
// connect.retry_ms is joined by a fresh one (a lost SYN would otherwise wait for the
// kernel's 1 s resend); the first to connect wins.
Socket connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);
Socket listen_tcp(const std::string& host, uint16_t port, int backlog = 128);
uint16_t local_port(int fd);
Socket accept_tcp(int listen_fd);

// Data-path settings: TCP_NODELAY, and SO_SNDBUF/SO_RCVBUF of buffer_bytes unless 0 (a TCP
// socket's buffers are then autotuned by the kernel).
void tune_stream(int fd, int buffer_bytes = 8 << 20);
// O_NONBLOCK on: the progress reactors drive the descriptor.
void set_nonblocking(int fd);
// Bound every blocking recv/send on fd (0 = no bound).
void set_io_timeout(int fd, std::chrono::milliseconds timeout);

// Blocking full transfers. Return false on EOF/error/timeout (errno describes it).
bool read_full(int fd, void* buf, size_t n);
bool write_full(int fd, const void* buf, size_t n);

std::string errno_text(int err);

}  // namespace sluice::net
