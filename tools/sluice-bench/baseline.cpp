#include "baseline.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace bench {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

bool write_all(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n) {
    ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n) {
    ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A listening socket on 127.0.0.1 and its port.
int listen_any(uint16_t* port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::listen(s, 1);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return s;
}

int connect_to(uint16_t port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1;
  int one = 1;
  ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return s;
}

}  // namespace

double tcp_stream_mbps(uint64_t chunk, uint64_t total, uint64_t footprint) {
  footprint = std::max(footprint, chunk);
  const uint64_t slots = footprint / chunk;
  const uint64_t iters = std::max<uint64_t>(1, total / chunk);
  total = iters * chunk;
  uint16_t port = 0;
  int ls = listen_any(&port);
  pid_t child = ::fork();
  if (child == 0) {
    int s = ::accept(ls, nullptr, nullptr);
    std::vector<char> buf(footprint, 0);
    uint64_t got = 0, i = 0;
    while (got < total) {
      char* dst = buf.data() + (i++ % slots) * chunk;
      if (!read_all(s, dst, chunk)) break;
      got += chunk;
    }
    char ack = 1;
    write_all(s, &ack, 1);
    ::_exit(0);
  }
  ::close(ls);
  int s = connect_to(port);
  std::vector<char> buf(footprint, 7);
  double t0 = now();
  for (uint64_t i = 0; i < iters; ++i)
    if (!write_all(s, buf.data() + (i % slots) * chunk, chunk)) break;
  char ack;
  read_all(s, &ack, 1);
  double dt = now() - t0;
  ::close(s);
  ::waitpid(child, nullptr, 0);
  return static_cast<double>(iters * chunk) / dt / 1e6;
}

double tcp_pingpong_us(uint64_t size, int iterations) {
  uint16_t port = 0;
  int ls = listen_any(&port);
  pid_t child = ::fork();
  if (child == 0) {
    int s = ::accept(ls, nullptr, nullptr);
    int one = 1;
    ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::vector<char> buf(size);
    while (read_all(s, buf.data(), size) && write_all(s, buf.data(), size)) {
    }
    ::_exit(0);
  }
  ::close(ls);
  int s = connect_to(port);
  std::vector<char> buf(size, 1);
  for (int i = 0; i < 100; ++i) write_all(s, buf.data(), size), read_all(s, buf.data(), size);
  double t0 = now();
  for (int i = 0; i < iterations; ++i) {
    write_all(s, buf.data(), size);
    read_all(s, buf.data(), size);
  }
  double dt = now() - t0;
  ::close(s);
  ::waitpid(child, nullptr, 0);
  return dt / iterations * 1e6;
}

double cma_read_mbps(uint64_t size, uint64_t footprint, int iterations) {
  int p[2];
  if (::pipe(p) != 0) return 0;
  footprint = std::max(footprint, size);
  const uint64_t slots = footprint / size;
  char* src = static_cast<char*>(std::aligned_alloc(4096, (footprint + 4095) / 4096 * 4096));
  std::memset(src, 3, footprint);
  pid_t child = ::fork();
  if (child == 0) {
    std::memset(src, 5, footprint);
    char x = 1;
    write_all(p[1], &x, 1);
    ::pause();
    ::_exit(0);
  }
  char x;
  read_all(p[0], &x, 1);
  std::vector<char> dst(footprint, 1);
  for (int w = 0; w < 2; ++w) {
    iovec l{dst.data(), size}, r{src, size};
    ::process_vm_readv(child, &l, 1, &r, 1, 0);
  }
  double t0 = now();
  for (int i = 0; i < iterations; ++i) {
    uint64_t off = (i % slots) * size;
    iovec l{dst.data() + off, size}, r{src + off, size};
    ::process_vm_readv(child, &l, 1, &r, 1, 0);
  }
  double dt = now() - t0;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(p[0]);
  ::close(p[1]);
  std::free(src);
  return static_cast<double>(size) * iterations / dt / 1e6;
}

double memcpy_mbps(uint64_t size, uint64_t footprint, int iterations) {
  footprint = std::max(footprint, size);
  const uint64_t slots = footprint / size;
  std::vector<char> a(footprint, 1), b(footprint, 2);
  for (int w = 0; w < 2; ++w) std::memcpy(b.data(), a.data(), size);
  double t0 = now();
  for (int i = 0; i < iterations; ++i) {
    uint64_t off = (i % slots) * size;
    std::memcpy(b.data() + off, a.data() + off, size);
    asm volatile("" : : "r"(b.data()) : "memory");
  }
  double dt = now() - t0;
  return static_cast<double>(size) * iterations / dt / 1e6;
}

}  // namespace bench
