// The producer side of the port channel: the request FIFO's push protocol and the channel's
// device handle (put / signal / flush / wait / poll). Plain C++ for host producers (threads
// standing in for GPU threads, the CI tests, Python) and CUDA for kernels: nvcc compiles the
// same functions as __host__ __device__, so one protocol serves both. No library symbol is
// needed: a kernel only includes this header and takes the handle by value.
//
// The FIFO protocol (LL, as NCCL's low-latency protocol: no fence on the producer's path):
//   1. A producer takes a ticket t with an atomic fetch-add on `head`.
//   2. It may write slot t % depth only once the proxy consumed ticket t - depth, i.e. once
//      t < tail + depth. It first checks its cached tail (cheap: producer-side memory) and
//      only when that says "full" reads the proxy's tail (host memory) with acquire order,
//      spinning at most the spin bound. It never overwrites an unconsumed slot.
//   3. It writes the request as kSlotWords 8-byte words, each {32 bits of the request, the
//      flag (t + 1) mod 2^32}, with plain stores. Each 8-byte store arrives whole, in any
//      order: no word needs to wait for another, so there is no system-scope fence (which
//      waits for the stores to reach host memory across PCIe: about 2 us a push).
//   4. The proxy reads the words of slot tail % depth; once every one carries the flag of
//      ticket tail, the request is complete (a word of an older lap carries an older flag).
//      It copies the request, then publishes tail + 1 with release order, after its reads.
//      Nothing is zeroed: the flags tell the laps apart.
//   A producer that times out in step 2 holds a ticket it can never fill; the proxy would wait
//   on that slot forever, so the producer marks the FIFO failed instead (`state`): every later
//   push fails at once and the proxy fails the FIFO's channels.
#pragma once

#include <chrono>  // host side of the functions (nvcc compiles them for the host too)
#include <cstdint>
#include <thread>

#if defined(__CUDACC__)
#include <cuda/atomic>
#define SLUICE_PORT_FN __host__ __device__ __forceinline__
#else
#define SLUICE_PORT_FN inline
#endif

namespace sluice {

// What a producer-side call returns. kFailed: the channel (or its FIFO, or the proxy) failed;
// the host's PortChannel::status() says why (e.g. kPeerLost). kTimeout: the spin bound ran out
// (a full FIFO, a wait whose signal never came, a flush the proxy did not finish in time).
enum class PortResult : int32_t { kOk = 0, kTimeout = 1, kFailed = 2 };

// Index into a proxy's memory table (ProxyService::add_memory); 32 bits, no other limit.
using MemoryId = uint32_t;

namespace port {

// Request kinds (bits of the control word; several may be combined in one request).
constexpr uint64_t kPut = 1, kSignal = 2, kFlush = 4;
constexpr uint64_t kKindMask = 0xf;
// Default spin bound of push / wait / flush: 10 s.
constexpr uint64_t kDefaultSpinNs = 10ull * 1000 * 1000 * 1000;
// FIFO state values (PortFifoHandle::state).
constexpr uint32_t kFifoOk = 0, kFifoTimedOut = 1, kFifoStopped = 2, kFifoCorrupt = 3;

// One request as producers and the proxy see it: 64-bit offsets and sizes, 32-bit memory
// and channel ids.
struct Request {
  uint64_t dst_offset;
  uint64_t src_offset;
  uint64_t size;
  uint32_t dst_mem;
  uint32_t src_mem;
  uint32_t channel;
};

// A request in the FIFO (step 3 above): kSlotWords words of {32 bits of the request in the
// low half, the flag in the high half}, on two cache lines.
constexpr int kSlotWords = 10;
struct alignas(64) Slot {
  uint64_t word[16];  // the first kSlotWords are used
};
static_assert(sizeof(Slot) == 128, "a slot is two cache lines");
SLUICE_PORT_FN uint32_t flag_of(uint64_t ticket) { return static_cast<uint32_t>(ticket + 1); }

// What the proxy publishes per channel (host memory; a GPU reads it through a mapping).
struct alignas(64) ChannelState {
  uint64_t flush_done;  // ticket + 1 of the channel's last completed flush request
  uint32_t error;       // 0, or the sluice::ErrorCode that failed the channel
  uint32_t reserved;
};

// ---- atomics and clocks: system scope on a GPU (the proxy is a host thread), __atomic on a host
namespace detail {

SLUICE_PORT_FN uint64_t load_acquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>(*const_cast<uint64_t*>(p))
      .load(::cuda::memory_order_acquire);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
SLUICE_PORT_FN uint32_t load_acquire32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  return ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*const_cast<uint32_t*>(p))
      .load(::cuda::memory_order_acquire);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
SLUICE_PORT_FN void store_release32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system>(*p).store(v, ::cuda::memory_order_release);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}
// The head lives in producer-side memory (device memory for GPU producers): device scope.
SLUICE_PORT_FN uint64_t fetch_add(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  return ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_device>(*p).fetch_add(v, ::cuda::memory_order_relaxed);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}
// The cached tail: acquire/release so that a producer trusting another producer's cached
// value inherits what that producer saw (the zeroed slot), see step 4 above.
SLUICE_PORT_FN uint64_t load_cached(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_device>(*const_cast<uint64_t*>(p))
      .load(::cuda::memory_order_acquire);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}
SLUICE_PORT_FN void raise_cached(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_device>(*p).fetch_max(v, ::cuda::memory_order_acq_rel);
#else
  uint64_t cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
  }
#endif
}
SLUICE_PORT_FN uint64_t now_ns() {
#if defined(__CUDA_ARCH__)
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#endif
}
// One step of a spin loop. On a host, producers may outnumber cores (64 threads on 2 cores in
// CI): after a short spin they yield so that the proxy gets the CPU.
SLUICE_PORT_FN void relax(uint64_t iteration) {
#if defined(__CUDA_ARCH__)
  (void)iteration;
#else
  if (iteration < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    std::this_thread::yield();
  }
#endif
}

// One step of a producer waiting on a full FIFO: on a GPU, a short sleep (thousands of
// threads polling cost the proxy more than they gain).
SLUICE_PORT_FN void backoff(uint64_t iteration) {
#if defined(__CUDA_ARCH__)
  if (iteration >= 8) __nanosleep(200);
#else
  relax(iteration);
#endif
}

}  // namespace detail

// Writes ticket's request into its slot (step 3).
SLUICE_PORT_FN void write_slot(Slot* s, const Request& r, uint64_t kinds, uint64_t ticket) {
  const uint64_t f = uint64_t(flag_of(ticket)) << 32;
  const uint64_t w[kSlotWords] = {f | uint32_t(r.dst_offset), f | uint32_t(r.dst_offset >> 32),
                                  f | uint32_t(r.src_offset), f | uint32_t(r.src_offset >> 32),
                                  f | uint32_t(r.size),       f | uint32_t(r.size >> 32),
                                  f | r.dst_mem,              f | r.src_mem,
                                  f | r.channel,              f | uint32_t(kinds & kKindMask)};
#if defined(__CUDA_ARCH__)
  // Five 16-byte stores; each 8-byte half arrives whole (volatile: straight to memory).
  for (int i = 0; i < kSlotWords; i += 2)
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(&s->word[i]), "l"(w[i]), "l"(w[i + 1]) : "memory");
#else
  for (int i = 0; i < kSlotWords; ++i) __atomic_store_n(&s->word[i], w[i], __ATOMIC_RELAXED);
#endif
}

// What the proxy finds in ticket's slot (step 4; host side).
enum class SlotState { kReady, kNotYet, kCorrupt };
inline SlotState read_slot(const Slot* s, uint64_t ticket, uint64_t depth, Request* r, uint64_t* kinds) {
  const uint32_t want = flag_of(ticket);
  uint32_t p[kSlotWords];
  for (int i = 0; i < kSlotWords; ++i) {
    const uint64_t v = __atomic_load_n(&s->word[i], __ATOMIC_RELAXED);
    const uint32_t f = static_cast<uint32_t>(v >> 32);
    if (f != want) {
      // A word of an older lap (or never written) is not here yet; any other flag was not
      // written by a producer following the protocol.
      return (f == 0 || static_cast<uint32_t>(want - f) % depth == 0) ? SlotState::kNotYet : SlotState::kCorrupt;
    }
    p[i] = static_cast<uint32_t>(v);
  }
  r->dst_offset = p[0] | uint64_t(p[1]) << 32;
  r->src_offset = p[2] | uint64_t(p[3]) << 32;
  r->size = p[4] | uint64_t(p[5]) << 32;
  r->dst_mem = p[6];
  r->src_mem = p[7];
  r->channel = p[8];
  *kinds = p[9] & kKindMask;
  return SlotState::kReady;
}

// The producer's view of one FIFO. Copied by value into kernels.
struct FifoHandle {
  Slot* slots = nullptr;        // depth requests (host memory; mapped for a GPU)
  uint64_t* head = nullptr;     // next ticket (producer-side memory)
  uint64_t* tail = nullptr;     // tickets below it are consumed (host memory, proxy-written)
  uint64_t* tail_cache = nullptr;  // producers' last seen tail (producer-side memory)
  uint32_t* state = nullptr;    // kFifoOk or why the FIFO failed (host memory)
  uint64_t depth = 0;           // a power of two

  // Publishes `r` with the given kinds. On kOk, *ticket is the request's ticket.
  SLUICE_PORT_FN PortResult push(const Request& r, uint64_t kinds, uint64_t spin_ns, uint64_t* ticket) const {
#if !defined(__CUDA_ARCH__)
    // On a GPU this would be a read across the bus on every push (about a microsecond); there
    // the state is read only while the FIFO is full, and flush() / wait() report failures.
    if (detail::load_acquire32(state) != kFifoOk) return PortResult::kFailed;
#endif
    uint64_t t = detail::fetch_add(head, 1);
    if (t >= detail::load_cached(tail_cache) + depth) {
      uint64_t start = detail::now_ns();
      for (uint64_t i = 0;; ++i) {
        if ((i & 63) == 63) {
          uint32_t s = detail::load_acquire32(state);
          if (s != kFifoOk) return PortResult::kFailed;
          if (detail::now_ns() - start > spin_ns) {
            // Our ticket can never be filled now: fail the FIFO rather than stall it silently.
            detail::store_release32(state, kFifoTimedOut);
            return PortResult::kTimeout;
          }
        }
        // The proxy's tail is read across the bus; with many producers waiting, most polls
        // read the cached tail another producer raised, so that their reads do not crowd the
        // link the proxy's slots and tail travel on.
        if ((i & 7) != 0) {
          if (t < detail::load_cached(tail_cache) + depth) break;
        } else {
          const uint64_t seen = detail::load_acquire(tail);
          if (t < seen + depth) {
            detail::raise_cached(tail_cache, seen);
            break;
          }
        }
        detail::backoff(i);
      }
    }
    write_slot(slots + (t & (depth - 1)), r, kinds, t);
    if (ticket) *ticket = t;
    return PortResult::kOk;
  }
};

}  // namespace port

// A channel as its producers see it: one GPU thread (or host thread) per call. Obtained from
// PortChannel::device_handle() and passed by value to a kernel. Offsets and sizes are bytes,
// 64-bit; `dst` memories are the peer's regions, `src` memories local ones.
struct PortChannelDeviceHandle {
  port::FifoHandle fifo;
  uint32_t channel = 0;
  MemoryId dst_mem = 0;  // default destination of put(dst_off, src_off, size)
  MemoryId src_mem = 0;  // default source
  uint32_t reserved = 0;
  uint64_t* local_semaphore = nullptr;  // the 64-bit counter the peer's signals raise
  uint64_t* expected = nullptr;         // signals consumed by wait()/poll() (producer-side memory)
  port::ChannelState* state = nullptr;  // proxy-published flush progress and error
  uint64_t spin_ns = port::kDefaultSpinNs;  // bound of push when a call is not given one

  SLUICE_PORT_FN PortResult put(MemoryId dst, uint64_t dst_offset, MemoryId src, uint64_t src_offset,
                                uint64_t size) const {
    return push(port::kPut, dst, dst_offset, src, src_offset, size, nullptr);
  }
  SLUICE_PORT_FN PortResult put(uint64_t dst_offset, uint64_t src_offset, uint64_t size) const {
    return put(dst_mem, dst_offset, src_mem, src_offset, size);
  }
  // Raises the peer's semaphore by one once every earlier put of this channel is visible there.
  SLUICE_PORT_FN PortResult signal() const { return push(port::kSignal, 0, 0, 0, 0, 0, nullptr); }
  SLUICE_PORT_FN PortResult put_with_signal(uint64_t dst_offset, uint64_t src_offset, uint64_t size) const {
    return push(port::kPut | port::kSignal, dst_mem, dst_offset, src_mem, src_offset, size, nullptr);
  }
  SLUICE_PORT_FN PortResult put_with_signal(MemoryId dst, uint64_t dst_offset, MemoryId src, uint64_t src_offset,
                                            uint64_t size) const {
    return push(port::kPut | port::kSignal, dst, dst_offset, src, src_offset, size, nullptr);
  }
  SLUICE_PORT_FN PortResult put_with_signal_and_flush(uint64_t dst_offset, uint64_t src_offset, uint64_t size,
                                                      uint64_t bound_ns = port::kDefaultSpinNs) const {
    uint64_t t = 0;
    PortResult r = push(port::kPut | port::kSignal | port::kFlush, dst_mem, dst_offset, src_mem, src_offset, size, &t);
    return r == PortResult::kOk ? wait_flushed(t, bound_ns) : r;
  }
  // Returns once every earlier request of this channel has completed at the peer (the
  // proxy flushed the endpoint), or kFailed / kTimeout.
  SLUICE_PORT_FN PortResult flush(uint64_t bound_ns = port::kDefaultSpinNs) const {
    uint64_t t = 0;
    PortResult r = push(port::kFlush, 0, 0, 0, 0, 0, &t);
    return r == PortResult::kOk ? wait_flushed(t, bound_ns) : r;
  }
  // Waits for the next signal of the peer (acquire: its puts before that signal are visible).
  SLUICE_PORT_FN PortResult wait(uint64_t bound_ns = port::kDefaultSpinNs) const {
    uint64_t want = *expected + 1;
    uint64_t start = 0;
    for (uint64_t i = 0;; ++i) {
      if (port::detail::load_acquire(local_semaphore) >= want) {
        *expected = want;
        return PortResult::kOk;
      }
      // The error word and the clock are read every 64 spins: on a GPU the error word is a
      // read across the bus, the semaphore one in device memory.
      if ((i & 63) == 0) {
        if (port::detail::load_acquire32(&state->error) != 0) return PortResult::kFailed;
        uint64_t now = port::detail::now_ns();
        if (i == 0) start = now;
        else if (now - start > bound_ns) return PortResult::kTimeout;
      }
      port::detail::relax(i);
    }
  }
  // True (and the signal consumed) if the peer's next signal has arrived.
  SLUICE_PORT_FN bool poll() const {
    uint64_t want = *expected + 1;
    if (port::detail::load_acquire(local_semaphore) < want) return false;
    *expected = want;
    return true;
  }

 private:
  SLUICE_PORT_FN PortResult push(uint64_t kinds, MemoryId dst, uint64_t dst_offset, MemoryId src, uint64_t src_offset,
                                 uint64_t size, uint64_t* ticket) const {
#if !defined(__CUDA_ARCH__)
    // Host producers learn of a failed channel at their next push. A GPU's push skips this
    // read across the bus: its requests on a failed channel are consumed and dropped by the
    // proxy, and the next flush() or wait() returns kFailed.
    if (port::detail::load_acquire32(&state->error) != 0) return PortResult::kFailed;
#endif
    port::Request r{};
    r.dst_offset = dst_offset;
    r.src_offset = src_offset;
    r.size = size;
    r.dst_mem = dst;
    r.src_mem = src;
    r.channel = channel;
    return fifo.push(r, kinds, spin_ns, ticket);
  }
  SLUICE_PORT_FN PortResult wait_flushed(uint64_t ticket, uint64_t bound_ns) const {
    uint64_t start = port::detail::now_ns();
    for (uint64_t i = 0;; ++i) {
      if (port::detail::load_acquire(&state->flush_done) > ticket) return PortResult::kOk;
      if (port::detail::load_acquire32(&state->error) != 0) return PortResult::kFailed;
      if (port::detail::load_acquire32(fifo.state) != port::kFifoOk) return PortResult::kFailed;
      if ((i & 63) == 63 && port::detail::now_ns() - start > bound_ns) return PortResult::kTimeout;
      port::detail::relax(i);
    }
  }
};

}  // namespace sluice
