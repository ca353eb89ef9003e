// Physical ceilings for bench/peers, matched to an engine's parallelism (issue 16).
//
//   ceilings tcp    SIZE MESSAGES NSTREAMS [FOOTPRINT]  N loopback TCP connections between two processes
//   ceilings cma    SIZE MESSAGES NTHREADS FOOTPRINT   N threads of process_vm_readv from a child
//   ceilings memcpy SIZE MESSAGES NTHREADS FOOTPRINT   N threads of memcpy in one process (streaming
//                                                      stores from 64 KiB, as the engine)
//   ceilings tcp-pingpong SIZE MESSAGES [1 [FOOTPRINT]]  one connection: SIZE bytes out, 1 byte back
//
// MESSAGES messages of SIZE bytes are split over the N streams/threads (what the engine moves
// in one cell); the copies walk a FOOTPRINT-byte buffer slot by slot like the engines do, on
// both sides of a TCP connection too (the sender's slot i goes into the receiver's slot i): one
// hot buffer sent into another hot one measured the cache, not the path (1 MiB round trips at
// 8.5 GB/s on a host whose engines all moved 2-4 GB/s).
// Prints one JSON line: {"secs": wall seconds, "lat_ms": mean time of one message on one
// stream}. Exit status 1 with a message on stderr on any error (never a made-up number).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "peers_mem.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static void die(const char* what) {
  perror(what);
  exit(1);
}

static size_t g_size, g_msgs, g_foot;
static int g_n;
static char *g_src, *g_dst;
static char* g_remote;  // cma: the child's buffer, at its address in the child
static pid_t g_child;
static int g_mode;  // 0 tcp, 1 cma, 2 memcpy
static int* g_socks;

// The memcpy ceiling copies as Sluice's shm transport does into and out of mapped memory: with
// streaming (non-temporal) stores from 64 KiB on (its shm.stream_copy_min; bulk_copy.hpp),
// which skip reading each destination line first. A plain memcpy ceiling stood at 0.6x of
// what the engine then moved (1 MiB slots over 64 MiB: 12 against 20 GB/s, one thread).
// PEERS_CEILING_STREAM=0: plain memcpy.
#define STREAM_MIN ((size_t)64 << 10)
static int g_stream = 1;
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static void stream_avx2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m256i a = _mm256_loadu_si256((const __m256i*)(s + i)), b = _mm256_loadu_si256((const __m256i*)(s + i + 32));
    _mm256_stream_si256((__m256i*)(d + i), a);
    _mm256_stream_si256((__m256i*)(d + i + 32), b);
  }
}
static void stream_sse2(char* d, const char* s, size_t n) {
  for (size_t i = 0; i < n; i += 16) _mm_stream_si128((__m128i*)(d + i), _mm_loadu_si128((const __m128i*)(s + i)));
}
static int g_avx2;
#endif
static void ceiling_copy(char* d, const char* s, size_t n) {
#if defined(__x86_64__)
  if (g_stream && n >= STREAM_MIN) {
    size_t head = (32 - ((size_t)d & 31)) & 31, body = (n - head) & ~(size_t)63;
    memcpy(d, s, head);
    if (g_avx2) stream_avx2(d + head, s + head, body);
    else stream_sse2(d + head, s + head, body);
    memcpy(d + head + body, s + head + body, n - head - body);
    _mm_sfence();
    return;
  }
#endif
  memcpy(d, s, n);
}

static size_t share(int t) { return g_msgs / g_n + ((size_t)t < g_msgs % g_n); }

static void write_all(int s, const char* p, size_t n) {
  while (n) {
    ssize_t k = write(s, p, n);
    if (k <= 0) die("write");
    p += k, n -= k;
  }
}
static void read_all(int s, char* p, size_t n) {
  while (n) {
    ssize_t k = read(s, p, n);
    if (k <= 0) die("read");
    p += k, n -= k;
  }
}

static void* worker(void* arg) {
  int t = (int)(long)arg;
  size_t slots = g_foot / g_size ? g_foot / g_size : 1, m = share(t);
  for (size_t i = 0; i < m; i++) {
    size_t off = ((i * g_n + t) % slots) * g_size;
    if (g_mode == 0) {
      write_all(g_socks[t], g_src + off, g_size);
    } else if (g_mode == 1) {
      struct iovec l = {g_dst + off, g_size}, r = {g_remote + off, g_size};
      if (process_vm_readv(g_child, &l, 1, &r, 1, 0) != (ssize_t)g_size) die("process_vm_readv");
    } else {
      ceiling_copy(g_dst + off, g_src + off, g_size);
    }
  }
  return NULL;
}

static double run_threads(void) {
  pthread_t th[64];
  double t0 = now();
  for (int t = 0; t < g_n; t++) pthread_create(&th[t], NULL, worker, (void*)(long)t);
  for (int t = 0; t < g_n; t++) pthread_join(th[t], NULL);
  return now() - t0;
}

static int listen_any(int* port) {
  int one = 1, ls = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, 4);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (bind(ls, (void*)&a, sizeof a) || listen(ls, 64) || getsockname(ls, (void*)&a, &len)) die("listen");
  *port = ntohs(a.sin_port);
  return ls;
}
static int dial(int port) {
  int one = 1, s = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, 4);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  if (connect(s, (void*)&a, sizeof a)) die("connect");
  return s;
}

// The receiving process: one reader per connection; stream t's k-th message goes into slot
// (k * N + t) of the receiver's own FOOTPRINT-byte buffer, as the sender's came from there.
static char* g_rbuf;
static size_t slot_of(size_t k, int t) {
  size_t slots = g_foot / g_size ? g_foot / g_size : 1;
  return ((k * g_n + t) % slots) * g_size;
}
static void* drain(void* arg) {
  int s = (int)(long)arg >> 8, t = (int)(long)arg & 0xff;
  size_t k = 0, got = 0;
  ssize_t r;
  while ((r = read(s, g_rbuf + slot_of(k, t) + got, g_size - got)) > 0)
    if ((got += (size_t)r) == g_size) got = 0, k++;
  char ack = 1;
  write_all(s, &ack, 1);
  return NULL;
}

static int tcp(int pingpong) {
  int port, ls = listen_any(&port);
  pid_t srv = fork();
  if (srv == 0) {
    pthread_t th[64];
    int n = pingpong ? 1 : g_n;
    size_t alloc = (g_foot + 4095) & ~(size_t)4095;
    g_rbuf = peers_alloc(alloc);  // zeroed: its pages made before the clock starts, as the engines' are
    if (!g_rbuf) die("peers_alloc");
    for (int t = 0; t < n; t++) {
      int s = accept(ls, 0, 0);
      if (s < 0) die("accept");
      if (pingpong) {
        char ack = 1;
        for (size_t i = 0; i < g_msgs + 1; i++) read_all(s, g_rbuf + slot_of(i, 0), g_size), write_all(s, &ack, 1);
        _exit(0);
      }
      pthread_create(&th[t], NULL, drain, (void*)(long)(s << 8 | t));
    }
    for (int t = 0; t < n; t++) pthread_join(th[t], NULL);
    _exit(0);
  }
  close(ls);
  g_socks = calloc(g_n, sizeof(int));
  for (int t = 0; t < (pingpong ? 1 : g_n); t++) g_socks[t] = dial(port);
  double secs, lat;
  if (pingpong) {
    char ack;
    write_all(g_socks[0], g_src + slot_of(0, 0), g_size), read_all(g_socks[0], &ack, 1);  // warm-up
    double t0 = now();
    for (size_t i = 1; i <= g_msgs; i++) write_all(g_socks[0], g_src + slot_of(i, 0), g_size), read_all(g_socks[0], &ack, 1);
    secs = now() - t0;
    lat = secs / g_msgs;
  } else {
    double t0 = now();
    run_threads();
    for (int t = 0; t < g_n; t++) shutdown(g_socks[t], SHUT_WR);
    for (int t = 0; t < g_n; t++) {
      char ack;
      read_all(g_socks[t], &ack, 1);  // the receiver has every byte
    }
    secs = now() - t0;
    lat = secs / ((g_msgs + g_n - 1) / g_n);
  }
  waitpid(srv, NULL, 0);
  printf("{\"secs\": %.9f, \"lat_ms\": %.9f}\n", secs, lat * 1e3);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: ceilings tcp|tcp-pingpong|cma|memcpy SIZE MESSAGES [N [FOOTPRINT]]\n");
    return 2;
  }
  const char* mode = argv[1];
  g_size = strtoull(argv[2], 0, 0), g_msgs = strtoull(argv[3], 0, 0);
  g_n = argc > 4 ? atoi(argv[4]) : 1;
  g_foot = argc > 5 ? strtoull(argv[5], 0, 0) : g_size;
  if (g_size == 0 || g_msgs == 0 || g_n < 1 || g_n > 64 || g_foot < g_size) {
    fprintf(stderr, "ceilings: bad arguments\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  size_t alloc = (g_foot + 4095) & ~(size_t)4095;
  g_src = peers_alloc(alloc), g_dst = peers_alloc(alloc);
  if (!g_src || !g_dst) die("peers_alloc");
  memset(g_src, 3, alloc), memset(g_dst, 0, alloc);
  if (!strcmp(mode, "tcp")) return g_mode = 0, tcp(0);
  if (!strcmp(mode, "tcp-pingpong")) return g_mode = 0, g_n = 1, tcp(1);
  if (!strcmp(mode, "cma")) {
    int p[2];
    if (pipe(p)) die("pipe");
    g_child = fork();
    if (g_child == 0) {
      // A buffer of the child's own, allocated here: writing into the parent's copy-on-write
      // pages would leave the child 4 KiB pages (the kernel splits a huge page on that fault),
      // unlike an engine's region.
      char* own = peers_alloc(alloc);
      if (!own) die("peers_alloc");
      memset(own, 5, alloc);
      write_all(p[1], (const char*)&own, sizeof(own));
      pause();
      _exit(0);
    }
    read_all(p[0], (char*)&g_remote, sizeof(g_remote));
    g_mode = 1;
  } else if (!strcmp(mode, "memcpy")) {
    g_mode = 2;
    const char* st = getenv("PEERS_CEILING_STREAM");
    g_stream = !(st && !strcmp(st, "0"));
#if defined(__x86_64__)
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2");
#endif
  } else {
    fprintf(stderr, "ceilings: unknown mode %s\n", mode);
    return 2;
  }
  // One untimed pass faults every page in, as the engines' warm-up does.
  size_t msgs = g_msgs;
  g_msgs = g_n * (g_foot / g_size ? g_foot / g_size : 1);
  run_threads();
  g_msgs = msgs;
  double secs = run_threads();
  int bad = g_mode == 1 && g_dst[0] != 5;
  if (g_child) kill(g_child, SIGKILL), waitpid(g_child, NULL, 0);
  if (bad) {
    fprintf(stderr, "ceilings: process_vm_readv copied the wrong bytes\n");
    return 1;
  }
  printf("{\"secs\": %.9f, \"lat_ms\": %.9f}\n", secs, secs / ((g_msgs + g_n - 1) / g_n) * 1e3);
  return 0;
}
