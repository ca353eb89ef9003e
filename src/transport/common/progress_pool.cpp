#include "transport/common/progress_pool.hpp"

#include "core/params.hpp"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "core/log.hpp"
#include "sluice/error.hpp"
#include "transport/transport.hpp"
#include "core/thread_name.hpp"

// Fibers switch stacks behind the sanitizers' backs unless told (ucontext is not intercepted).
#if defined(__SANITIZE_THREAD__)
#define SLUICE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SLUICE_TSAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define SLUICE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SLUICE_ASAN 1
#endif
#endif

#ifdef SLUICE_TSAN
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
}
#endif
#ifdef SLUICE_ASAN
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
void __asan_unpoison_memory_region(void const volatile* addr, size_t size);
}
#endif

// The x86-64 fiber switch: saves the callee-saved registers (and the SSE/x87 control words,
// which the ABI also makes callee-saved) on the current stack, stores the stack pointer in
// *from, loads `to` and pops the same frame from there. No signal mask (fibers never change
// it), so no syscall. A fresh fiber's stack holds a frame whose return address is
// sluice_fiber_entry, which calls r13(r12) = Fiber::asm_main(this).
#if defined(__x86_64__) && defined(__linux__)
#define SLUICE_FIBER_ASM 1
extern "C" {
void sluice_fiber_switch(void** from, void* to);
void sluice_fiber_entry();
}
asm(R"(
  .pushsection .text
  .p2align 4
  .globl sluice_fiber_switch
  .hidden sluice_fiber_switch
  .type sluice_fiber_switch,@function
sluice_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sluice_fiber_switch,.-sluice_fiber_switch

  .p2align 4
  .globl sluice_fiber_entry
  .hidden sluice_fiber_entry
  .type sluice_fiber_entry,@function
sluice_fiber_entry:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size sluice_fiber_entry,.-sluice_fiber_entry
  .popsection
)");
#endif

namespace sluice::detail {

namespace {
thread_local Fiber* tls_fiber = nullptr;
thread_local bool tls_reactor = false;
constexpr size_t kGuard = 4096;

// Whether fibers switch with sluice_fiber_switch. Not where a shadow stack is enforced: its
// `ret` onto another stack would not match the shadow stack (rdssp reads 0, a no-op on CPUs
// without CET, when none is active).
bool use_asm_switch() {
#ifdef SLUICE_FIBER_ASM
  static const bool on = [] {
    unsigned long long ssp = 0;
    asm volatile(".byte 0xf3, 0x48, 0x0f, 0x1e, 0xc8" : "+a"(ssp));  // rdsspq %rax
    return ssp == 0;
  }();
  return on;
#else
  return false;
#endif
}
}  // namespace

struct Fiber::Context {
  ucontext_t fiber;   // ucontext switch only
  ucontext_t caller;
  void* fiber_sp = nullptr;   // fiber_switch: the fiber's saved stack pointer
  void* caller_sp = nullptr;  // fiber_switch: the resumer's
  bool asm_switch = false;
};

Fiber::Fiber(std::function<void()> body, size_t stack_bytes)
    : ctx_(std::make_unique<Context>()), body_(std::move(body)), stack_bytes_(stack_bytes) {
  // The stack is reserved, not committed: an idle channel costs the pages it touched.
  stack_ = ::mmap(nullptr, stack_bytes_ + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                  -1, 0);
  if (stack_ == MAP_FAILED) {
    stack_ = nullptr;
    throw Error(ErrorCode::kSystem, "fiber stack: " + std::string(std::strerror(errno)));
  }
  ::mprotect(stack_, kGuard, PROT_NONE);  // overflow faults instead of corrupting memory
#ifdef SLUICE_ASAN
  // A new mapping may reuse the addresses of an earlier fiber's stack, whose frames' redzones
  // are still poisoned in ASan's shadow (munmap does not clear it): the initial frame written
  // below would be reported as a stack-buffer-overflow.
  __asan_unpoison_memory_region(static_cast<char*>(stack_) + kGuard, stack_bytes_);
#endif
  ctx_->asm_switch = use_asm_switch();
  if (ctx_->asm_switch) {
#ifdef SLUICE_FIBER_ASM
    // The frame sluice_fiber_switch pops: control words, r15, r14, r13, r12, rbx, rbp, and
    // the return address. `ret` leaves rsp 16-byte aligned, as a call instruction expects.
    auto top = (reinterpret_cast<uintptr_t>(stack_) + kGuard + stack_bytes_) & ~uintptr_t{15};
    auto* frame = reinterpret_cast<uint64_t*>(top) - 8;
    uint32_t ctl[2] = {0, 0};
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(ctl[0]), "=m"(ctl[1]));  // inherit the creator's
    frame[0] = static_cast<uint64_t>(ctl[0]) | (static_cast<uint64_t>(ctl[1] & 0xffff) << 32);
    frame[1] = 0;                                        // r15
    frame[2] = 0;                                        // r14
    frame[3] = reinterpret_cast<uint64_t>(&Fiber::asm_main);  // r13: what the entry calls
    frame[4] = reinterpret_cast<uint64_t>(this);         // r12: its argument
    frame[5] = 0;                                        // rbx
    frame[6] = 0;                                        // rbp
    frame[7] = reinterpret_cast<uint64_t>(&sluice_fiber_entry);
    ctx_->fiber_sp = frame;
#endif
  } else {
    ::getcontext(&ctx_->fiber);
    ctx_->fiber.uc_stack.ss_sp = static_cast<char*>(stack_) + kGuard;
    ctx_->fiber.uc_stack.ss_size = stack_bytes_;
    ctx_->fiber.uc_link = nullptr;
    auto p = reinterpret_cast<uintptr_t>(this);
    ::makecontext(&ctx_->fiber, reinterpret_cast<void (*)()>(&Fiber::trampoline), 2, static_cast<unsigned>(p),
                  static_cast<unsigned>(p >> 32));
  }
#ifdef SLUICE_TSAN
  san_fiber_ = __tsan_create_fiber(0);
#endif
}

Fiber::~Fiber() {
#ifdef SLUICE_TSAN
  if (san_fiber_) __tsan_destroy_fiber(san_fiber_);
#endif
#ifdef SLUICE_ASAN
  if (stack_) __asan_unpoison_memory_region(static_cast<char*>(stack_) + kGuard, stack_bytes_);
#endif
  if (stack_) ::munmap(stack_, stack_bytes_ + kGuard);
}

Fiber* Fiber::current() { return tls_fiber; }

void Fiber::run_body() {
#ifdef SLUICE_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &caller_stack_, &caller_stack_size_);
#endif
  try {
    body_();
  } catch (const std::exception& e) {
    SLUICE_LOG(kError, "progress fiber: uncaught exception: " << e.what());
  }
  finished_ = true;
}

// Back to the reactor for good; this stack is never resumed. A macro, not a function: after
// TSan's switch no instrumented function may return on this stack (its exit would pop the
// resumer's shadow stack).
#if defined(SLUICE_ASAN)
#define SLUICE_FIBER_LEAVE(self) __sanitizer_start_switch_fiber(nullptr, (self)->caller_stack_, (self)->caller_stack_size_)
#elif defined(SLUICE_TSAN)
#define SLUICE_FIBER_LEAVE(self) __tsan_switch_to_fiber((self)->san_caller_, 0)
#else
#define SLUICE_FIBER_LEAVE(self) (void)(self)
#endif

void Fiber::trampoline(unsigned lo, unsigned hi) {
  auto* self = reinterpret_cast<Fiber*>(static_cast<uintptr_t>(lo) | (static_cast<uintptr_t>(hi) << 32));
  self->run_body();
  SLUICE_FIBER_LEAVE(self);
  ::setcontext(&self->ctx_->caller);
}

void Fiber::asm_main(Fiber* self) {
  self->run_body();
  SLUICE_FIBER_LEAVE(self);
#ifdef SLUICE_FIBER_ASM
  void* dead = nullptr;
  sluice_fiber_switch(&dead, self->ctx_->caller_sp);
#endif
  std::abort();  // not reached
}

void Fiber::resume() {
  if (finished_) return;
  Fiber* outer = tls_fiber;
  tls_fiber = this;
#ifdef SLUICE_TSAN
  san_caller_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(san_fiber_, 0);
#endif
#ifdef SLUICE_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, static_cast<char*>(stack_) + kGuard, stack_bytes_);
#endif
#ifdef SLUICE_FIBER_ASM
  if (ctx_->asm_switch) sluice_fiber_switch(&ctx_->caller_sp, ctx_->fiber_sp);
  else
#endif
    ::swapcontext(&ctx_->caller, &ctx_->fiber);
#ifdef SLUICE_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  tls_fiber = outer;
}

void Fiber::yield() {
#ifdef SLUICE_ASAN
  __sanitizer_start_switch_fiber(&asan_fake_, caller_stack_, caller_stack_size_);
#endif
#ifdef SLUICE_TSAN
  __tsan_switch_to_fiber(san_caller_, 0);
#endif
#ifdef SLUICE_FIBER_ASM
  if (ctx_->asm_switch) sluice_fiber_switch(&ctx_->fiber_sp, ctx_->caller_sp);
  else
#endif
    ::swapcontext(&ctx_->fiber, &ctx_->caller);
#ifdef SLUICE_ASAN
  __sanitizer_finish_switch_fiber(asan_fake_, &caller_stack_, &caller_stack_size_);
#endif
}

Reactor::Reactor(std::chrono::microseconds spin) : spin_(spin) {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wakefd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epfd_ < 0 || wakefd_ < 0) throw Error(ErrorCode::kSystem, "progress reactor: " + std::string(std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;  // the wake descriptor
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev);
  std::lock_guard<std::mutex> lk(mu_);  // the thread reads thread_id_ only after taking mu_
  thread_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-progress");
    { std::lock_guard<std::mutex> l(mu_); }
    tls_reactor = true;
    tls_transport_thread = true;
    loop();
  });
  thread_id_ = thread_.get_id();
}

Reactor::~Reactor() {
  stop_.store(true);
  uint64_t one = 1;
  (void)!::write(wakefd_, &one, sizeof(one));
  if (thread_.joinable()) {
    if (on_thread()) thread_.detach();
    else thread_.join();
  }
  ::close(epfd_);
  ::close(wakefd_);
}

namespace {
constexpr uint32_t kWatchInput = EPOLLIN | EPOLLPRI | EPOLLRDHUP | EPOLLET;
}  // namespace

void Reactor::add(int fd, ReactorSource* src) {
  epoll_event ev{};
  ev.events = kWatchInput;
  ev.data.ptr = src;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0)
    throw Error(ErrorCode::kSystem, "epoll_ctl: " + std::string(std::strerror(errno)));
  sources_.fetch_add(1, std::memory_order_relaxed);
}

void Reactor::watch(int fd, ReactorSource* src, bool input, bool output) {
  epoll_event ev{};
  ev.events = (input ? kWatchInput : uint32_t{EPOLLET}) | (output ? uint32_t{EPOLLOUT} : 0u);
  ev.data.ptr = src;
  (void)::epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev);
}

void Reactor::remove(int fd, ReactorSource* src, std::function<void()> done) {
  // Removed as a task, after the batch that may still name src: no stale pointer is used.
  post([this, fd, src, done = std::move(done)] {
    ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
    cancel_wake(src);
    sources_.fetch_sub(1, std::memory_order_relaxed);
    done();
  });
}

void Reactor::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    tasks_.push_back(std::move(fn));
  }
  uint64_t one = 1;
  (void)!::write(wakefd_, &one, sizeof(one));
}

void Reactor::wake_at(ReactorSource* src, std::chrono::steady_clock::time_point when) {
  for (auto& d : deadlines_)
    if (d.second == src) {
      d.first = when;
      return;
    }
  deadlines_.emplace_back(when, src);
}

void Reactor::cancel_wake(ReactorSource* src) {
  std::erase_if(deadlines_, [&](const auto& d) { return d.second == src; });
}

void Reactor::loop() {
  constexpr int kMaxEvents = 128;
  epoll_event evs[kMaxEvents];
  std::vector<std::function<void()>> tasks;
  std::chrono::steady_clock::time_point poll_until{};  // progress.spin_us after the last events
  while (!stop_.load(std::memory_order_relaxed)) {
    int timeout = -1;
    auto now = std::chrono::steady_clock::now();
    for (const auto& d : deadlines_) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(d.first - now).count();
      ms = std::max<long long>(ms, 0);
      if (timeout < 0 || ms < timeout) timeout = static_cast<int>(std::min<long long>(ms, 1000));
    }
    if (now < poll_until) timeout = 0;
    int n = ::epoll_wait(epfd_, evs, kMaxEvents, timeout);
    if (n > 0 && spin_.count() > 0) poll_until = std::chrono::steady_clock::now() + spin_;
    if (n < 0 && errno != EINTR) {
      SLUICE_LOG(kError, "progress reactor: epoll_wait: " << std::strerror(errno));
      n = 0;
    }
    for (int i = 0; i < n; ++i) {
      if (!evs[i].data.ptr) {
        uint64_t v;
        (void)!::read(wakefd_, &v, sizeof(v));
        continue;
      }
      static_cast<ReactorSource*>(evs[i].data.ptr)->on_events(evs[i].events);
    }
    if (!deadlines_.empty()) {
      now = std::chrono::steady_clock::now();
      std::vector<ReactorSource*> due;
      for (auto it = deadlines_.begin(); it != deadlines_.end();) {
        if (it->first <= now) {
          due.push_back(it->second);
          it = deadlines_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto* s : due) s->on_deadline();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      tasks.swap(tasks_);
    }
    for (auto& t : tasks) t();
    tasks.clear();
  }
}

namespace {
// Process-wide, like the pool: read when the pool is first used, never at static init.
const Param<int> kProgressThreads{"progress.threads", "SLUICE_PROGRESS_THREADS", 0, int_in(0, 64),
                                  "epoll reactors serving every stream channel of the process; 0 = min(4, cores)",
                                  ParamScope::kProcess};
}  // namespace

const Param<int> kProgressSpin{"progress.spin_us", "SLUICE_PROGRESS_SPIN_US", 0, int_in(0, 1000000),
                               "after handling events a reactor keeps polling this long before it blocks in "
                               "epoll_wait again (a message arriving meanwhile costs no wake-up; a core while it "
                               "polls); 0 = block at once",
                               ParamScope::kProcess};

int progress_threads_from_env() {
  int n = kProgressThreads.read();
  if (n > 0) return n;
  unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<int>(std::min(4u, hw));
}

ProgressPool::ProgressPool(int threads, std::chrono::microseconds spin) {
  for (int i = 0; i < threads; ++i) reactors_.push_back(std::make_unique<Reactor>(spin));
}

Reactor& ProgressPool::pick() {
  Reactor* best = reactors_.front().get();
  for (auto& r : reactors_)
    if (r->sources() < best->sources()) best = r.get();
  return *best;
}

bool ProgressPool::on_reactor_thread() { return tls_reactor; }

std::shared_ptr<ProgressPool> ProgressPool::shared() {
  // Kept for the life of the process (reactors idle in epoll_wait cost nothing); a forked
  // child inherits the object but not its threads, so it builds its own (the parent's copy
  // is leaked there on purpose: its threads do not exist to be joined).
  static std::mutex mu;
  static std::shared_ptr<ProgressPool>* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lk(mu);
  if (!pool || owner != ::getpid()) {
    int n = progress_threads_from_env();
    const int spin = kProgressSpin.read();
    pool = new std::shared_ptr<ProgressPool>(std::make_shared<ProgressPool>(n, std::chrono::microseconds(spin)));
    owner = ::getpid();
    SLUICE_LOG(kInfo, "progress: " << n << " reactor threads (SLUICE_PROGRESS_THREADS), polling " << spin
                                   << " us after events (SLUICE_PROGRESS_SPIN_US)");
  }
  return *pool;
}

}  // namespace sluice::detail
