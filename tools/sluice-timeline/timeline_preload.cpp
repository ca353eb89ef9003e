// LD_PRELOAD library for tools/sluice-timeline/timeline.py: records, per thread, when each
// socket, pipe/eventfd, epoll/poll, process_vm_*, ioctl and condition-variable call starts and ends,
// so that a message's way through the threads of two processes can be read off afterwards
// (which thread slept where, who woke whom, how long each hop took). perf and strace are not on
// every machine we measure on (the GPU hosts have neither); this needs only a C++ compiler.
//
// Enabled by SLUICE_TIMELINE_DIR (a writable folder); at exit each process writes
// DIR/timeline.<pid>: "T <tid> <name>" lines, then "<ns> <tid> <call> <0 enter|1 exit> <value>
// <fd>" lines (value: the byte count asked on enter, the result on exit). The clock is
// CLOCK_MONOTONIC, shared by the processes of one host. A write(2) to fd -1 is a mark: the
// program under test calls it (os.write(-1, b"x" * k) fails with EBADF and records mark k).
// Events past SLUICE_TIMELINE_EVENTS (default 4M per process) are dropped, counted on the first
// line. Nothing here changes what the calls do.
#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cstdarg>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

struct Event {
  uint64_t ns;
  int32_t tid;
  int16_t call;
  int16_t exit;
  int64_t value;
  int32_t fd;
};

enum Call : int16_t {
  kSendmsg, kSendto, kRecvfrom, kRecvmsg, kRead, kWrite, kWritev, kReadv, kEpollWait, kEpollPwait,
  kPoll, kCondWait, kCondTimedwait, kCondClockwait, kCondSignal, kCondBroadcast, kVmReadv, kVmWritev, kIoctl,
  kCount
};
const char* const kNames[kCount] = {"sendmsg",        "sendto",        "recvfrom",       "recvmsg",
                                    "read",           "write",         "writev",         "readv",
                                    "epoll_wait",     "epoll_pwait",   "poll",           "cond_wait",
                                    "cond_timedwait", "cond_clockwait", "cond_signal",   "cond_broadcast",
                                    "process_vm_readv", "process_vm_writev", "ioctl"};

Event* g_buf = nullptr;
uint64_t g_cap = 0;
std::atomic<uint64_t> g_next{0};
constexpr int kMaxThreads = 1024;
struct Named {
  std::atomic<int32_t> tid{0};
  char name[17] = {};
};
Named g_names[kMaxThreads];
std::atomic<int> g_named{0};
thread_local int32_t t_tid = 0;
thread_local uint32_t t_count = 0;
thread_local int t_slot = -1;

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void record(Call c, int exit, int64_t value, int fd) {
  if (!g_buf) return;
  if (!t_tid) t_tid = static_cast<int32_t>(syscall(SYS_gettid));
  // Names are set after a thread starts (pthread_setname_np): taken at the thread's 1st, 2nd,
  // 4th, ... 512th event and every 1024th after.
  const uint32_t k_ = t_count++;
  if ((k_ & (k_ - 1)) == 0 || (k_ & 1023u) == 0) {
    if (t_slot < 0) {
      int k = g_named.fetch_add(1);
      if (k < kMaxThreads) t_slot = k;
    }
    if (t_slot >= 0) {
      char nm[17] = {};
      prctl(PR_GET_NAME, nm, 0, 0, 0);
      std::memcpy(g_names[t_slot].name, nm, sizeof nm);
      g_names[t_slot].tid.store(t_tid);
    }
  }
  uint64_t i = g_next.fetch_add(1, std::memory_order_relaxed);
  if (i >= g_cap) return;
  g_buf[i] = Event{now_ns(), t_tid, c, static_cast<int16_t>(exit), value, fd};
}

template <typename F>
F real(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

__attribute__((constructor)) void start() {
  const char* dir = std::getenv("SLUICE_TIMELINE_DIR");
  if (!dir || !*dir) return;
  const char* cap = std::getenv("SLUICE_TIMELINE_EVENTS");
  g_cap = cap ? std::strtoull(cap, nullptr, 10) : (4ull << 20);
  if (g_cap == 0) return;
  g_buf = static_cast<Event*>(std::calloc(g_cap, sizeof(Event)));
}

__attribute__((destructor)) void finish() {
  Event* buf = g_buf;
  if (!buf) return;
  g_buf = nullptr;  // calls made while writing are not recorded
  char path[4096];
  std::snprintf(path, sizeof path, "%s/timeline.%d", std::getenv("SLUICE_TIMELINE_DIR"), static_cast<int>(getpid()));
  FILE* f = std::fopen(path, "w");
  if (!f) return;
  uint64_t n = g_next.load();
  std::fprintf(f, "# sluice-timeline pid %d events %llu dropped %llu\n", static_cast<int>(getpid()),
               static_cast<unsigned long long>(n < g_cap ? n : g_cap),
               static_cast<unsigned long long>(n > g_cap ? n - g_cap : 0));
  int named = g_named.load();
  for (int k = 0; k < named && k < kMaxThreads; ++k)
    if (g_names[k].tid.load()) std::fprintf(f, "T %d %s\n", g_names[k].tid.load(), g_names[k].name);
  if (n > g_cap) n = g_cap;
  for (uint64_t i = 0; i < n; ++i) {
    const Event& e = buf[i];
    if (e.ns == 0) continue;  // claimed by a thread that had not written it yet
    std::fprintf(f, "%llu %d %s %d %lld %d\n", static_cast<unsigned long long>(e.ns), e.tid, kNames[e.call], e.exit,
                 static_cast<long long>(e.value), e.fd);
  }
  std::fclose(f);
  std::free(buf);
}

}  // namespace

#define TIMED(call, enter_value, fd, expr) \
  do {                                     \
    record(call, 0, enter_value, fd);      \
    auto r_ = (expr);                      \
    record(call, 1, r_, fd);               \
    return r_;                             \
  } while (0)

extern "C" {

ssize_t sendmsg(int fd, const msghdr* m, int fl) {
  static auto f = real<ssize_t (*)(int, const msghdr*, int)>("sendmsg");
  TIMED(kSendmsg, 0, fd, f(fd, m, fl));
}
ssize_t sendto(int fd, const void* b, size_t n, int fl, const sockaddr* a, socklen_t l) {
  static auto f = real<ssize_t (*)(int, const void*, size_t, int, const sockaddr*, socklen_t)>("sendto");
  TIMED(kSendto, static_cast<int64_t>(n), fd, f(fd, b, n, fl, a, l));
}
ssize_t send(int fd, const void* b, size_t n, int fl) { return sendto(fd, b, n, fl, nullptr, 0); }
ssize_t recvfrom(int fd, void* b, size_t n, int fl, sockaddr* a, socklen_t* l) {
  static auto f = real<ssize_t (*)(int, void*, size_t, int, sockaddr*, socklen_t*)>("recvfrom");
  TIMED(kRecvfrom, static_cast<int64_t>(n), fd, f(fd, b, n, fl, a, l));
}
ssize_t recv(int fd, void* b, size_t n, int fl) { return recvfrom(fd, b, n, fl, nullptr, nullptr); }
ssize_t recvmsg(int fd, msghdr* m, int fl) {
  static auto f = real<ssize_t (*)(int, msghdr*, int)>("recvmsg");
  TIMED(kRecvmsg, 0, fd, f(fd, m, fl));
}
ssize_t read(int fd, void* b, size_t n) {
  static auto f = real<ssize_t (*)(int, void*, size_t)>("read");
  TIMED(kRead, static_cast<int64_t>(n), fd, f(fd, b, n));
}
ssize_t write(int fd, const void* b, size_t n) {
  static auto f = real<ssize_t (*)(int, const void*, size_t)>("write");
  TIMED(kWrite, static_cast<int64_t>(n), fd, f(fd, b, n));
}
ssize_t writev(int fd, const iovec* v, int c) {
  static auto f = real<ssize_t (*)(int, const iovec*, int)>("writev");
  TIMED(kWritev, c, fd, f(fd, v, c));
}
ssize_t readv(int fd, const iovec* v, int c) {
  static auto f = real<ssize_t (*)(int, const iovec*, int)>("readv");
  TIMED(kReadv, c, fd, f(fd, v, c));
}
int epoll_wait(int e, epoll_event* ev, int m, int to) {
  static auto f = real<int (*)(int, epoll_event*, int, int)>("epoll_wait");
  TIMED(kEpollWait, to, e, f(e, ev, m, to));
}
int epoll_pwait(int e, epoll_event* ev, int m, int to, const sigset_t* s) {
  static auto f = real<int (*)(int, epoll_event*, int, int, const sigset_t*)>("epoll_pwait");
  TIMED(kEpollPwait, to, e, f(e, ev, m, to, s));
}
int poll(pollfd* p, nfds_t n, int to) {
  static auto f = real<int (*)(pollfd*, nfds_t, int)>("poll");
  TIMED(kPoll, to, n ? p[0].fd : -1, f(p, n, to));
}
int pthread_cond_wait(pthread_cond_t* c, pthread_mutex_t* m) {
  static auto f = real<int (*)(pthread_cond_t*, pthread_mutex_t*)>("pthread_cond_wait");
  TIMED(kCondWait, 0, 0, f(c, m));
}
int pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const timespec* t) {
  static auto f = real<int (*)(pthread_cond_t*, pthread_mutex_t*, const timespec*)>("pthread_cond_timedwait");
  TIMED(kCondTimedwait, 0, 0, f(c, m, t));
}
int pthread_cond_clockwait(pthread_cond_t* c, pthread_mutex_t* m, clockid_t k, const timespec* t) {
  static auto f = real<int (*)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const timespec*)>("pthread_cond_clockwait");
  TIMED(kCondClockwait, 0, 0, f(c, m, k, t));
}
int pthread_cond_signal(pthread_cond_t* c) {
  static auto f = real<int (*)(pthread_cond_t*)>("pthread_cond_signal");
  record(kCondSignal, 0, 0, 0);
  return f(c);
}
int pthread_cond_broadcast(pthread_cond_t* c) {
  static auto f = real<int (*)(pthread_cond_t*)>("pthread_cond_broadcast");
  record(kCondBroadcast, 0, 0, 0);
  return f(c);
}
ssize_t process_vm_readv(pid_t p, const iovec* l, unsigned long ln, const iovec* r, unsigned long rn, unsigned long fl) {
  static auto f = real<ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long, unsigned long)>(
      "process_vm_readv");
  TIMED(kVmReadv, static_cast<int64_t>(ln), p, f(p, l, ln, r, rn, fl));
}
ssize_t process_vm_writev(pid_t p, const iovec* l, unsigned long ln, const iovec* r, unsigned long rn, unsigned long fl) {
  static auto f = real<ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long, unsigned long)>(
      "process_vm_writev");
  TIMED(kVmWritev, static_cast<int64_t>(ln), p, f(p, l, ln, r, rn, fl));
}

// The GPU driver's calls into the kernel (a CUDA launch, event or query that takes one shows
// here; value on enter: the request number).
int ioctl(int fd, unsigned long req, ...) {
  static auto f = real<int (*)(int, unsigned long, void*)>("ioctl");
  va_list ap;
  va_start(ap, req);
  void* arg = va_arg(ap, void*);
  va_end(ap);
  TIMED(kIoctl, static_cast<int64_t>(req), fd, f(fd, req, arg));
}

}  // extern "C"
