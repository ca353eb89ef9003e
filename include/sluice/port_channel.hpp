// The GPU-initiated port channel, host side: a ProxyService owns request FIFOs and worker
// threads that turn producers' requests (put / signal / flush, pushed by GPU threads or host
// threads through PortChannelDeviceHandle) into the engine's thin post path
// (Endpoint::post_write / post_signal / flush). See docs/port-channel.md.
//
//   sluice::ProxyService proxy(engine, {.workers = 1, .fifo_depth = 512});
//   MemoryId dst = proxy.add_memory(ep, *ep.remote_region("buf"));   // the peer's region
//   MemoryId src = proxy.add_memory(local_handle);                    // a local region
//   sluice::PortChannel ch = proxy.add_channel(ep, dst, src,
//       {*ep.remote_region("sem"), 0},   // the peer's counter our signal raises
//       {sem_handle, 0});                // our counter the peer's signal raises
//   proxy.start();
//   my_kernel<<<...>>>(ch.device_handle());
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "sluice/endpoint.hpp"
#include "sluice/error.hpp"
#include "sluice/export.hpp"
#include "sluice/port_channel_device.hpp"
#include "sluice/types.hpp"

namespace sluice {

class Engine;

namespace detail {
class ProxyCore;
struct PortChannelRecord;
}

// Where the producers of a proxy's FIFOs run.
enum class ProducerKind : uint8_t {
  kHost = 0,  // host threads: the FIFO and its counters in plain aligned host memory
  kCuda = 1,  // GPU threads: the FIFO in cudaHostAlloc'd mapped memory, head and cached tail
              // in device memory (needs a CUDA build and a GPU, else kNoDevice)
};

struct ProxyOptions {
  int workers = 1;              // worker threads; each owns one FIFO and serves its channels
  uint32_t fifo_depth = 512;    // requests per FIFO, a power of two >= 2
  ProducerKind producers = ProducerKind::kHost;
  int cuda_device = 0;          // for ProducerKind::kCuda
  // An idle worker spins this long before it naps (idle_sleep at a time) between polls.
  // Spinning costs a core; napping adds up to idle_sleep (plus the timer slack) of latency
  // to the first request after a pause.
  std::chrono::microseconds idle_spin{200};
  std::chrono::microseconds idle_sleep{50};
  // Bound of a flush request's Endpoint::flush (0: the engine's op_timeout).
  std::chrono::milliseconds flush_timeout{0};
  // How often a worker checks its channels' endpoints, so that a peer lost while nothing is
  // pending still fails the channel (and a waiting kernel returns kFailed).
  std::chrono::milliseconds liveness_interval{20};
  // Bound (ns) of every push of the channels' handles (PortChannelDeviceHandle::spin_ns).
  uint64_t push_spin_ns = port::kDefaultSpinNs;
  // Requests a worker pops before it posts them, as one Endpoint::post_batch per endpoint
  // (0: the engine's port.batch_max parameter, default 256; 1: one request at a time).
  uint32_t batch_max = 0;
};

// Counters of one proxy (all workers together).
struct ProxyStats {
  uint64_t requests = 0;  // requests consumed
  uint64_t puts = 0;
  uint64_t signals = 0;
  uint64_t flushes = 0;
  uint64_t dropped = 0;   // requests of failed channels, consumed without effect
  uint64_t batches = 0;   // Endpoint::post_batch calls (puts + signals over batches: the mean batch)
};

// One channel: an endpoint, its default destination / source memories and a semaphore pair.
// A cheap handle; the proxy keeps the channel alive for its own lifetime.
class SLUICE_API PortChannel {
 public:
  PortChannel() = default;
  // What producers use (by value in a kernel; from host threads for ProducerKind::kHost).
  PortChannelDeviceHandle device_handle() const;
  uint32_t id() const;
  // Ok, or why the channel failed (e.g. kPeerLost): what kFailed on the device side means.
  Status status() const;
  bool valid() const { return static_cast<bool>(rec_); }

  explicit PortChannel(std::shared_ptr<detail::PortChannelRecord> rec) : rec_(std::move(rec)) {}

 private:
  std::shared_ptr<detail::PortChannelRecord> rec_;
};

// A semaphore slot: a 64-bit counter at an 8-byte aligned offset of a region.
struct RemoteSemaphore {
  RemoteHandle region;
  uint64_t offset = 0;
};
struct LocalSemaphore {
  MemoryHandle region;
  uint64_t offset = 0;
};

class SLUICE_API ProxyService {
 public:
  // `engine` must outlive the service (local handles are checked against its registry).
  explicit ProxyService(Engine& engine, ProxyOptions options = {});
  ~ProxyService();  // stop()
  ProxyService(const ProxyService&) = delete;
  ProxyService& operator=(const ProxyService&) = delete;

  // A local region as a source of puts. Throws kUnknownHandle if it is not registered.
  MemoryId add_memory(MemoryHandle local);
  // A region of `ep`'s peer as a destination of puts (only channels on `ep` may use it).
  MemoryId add_memory(const Endpoint& ep, RemoteHandle remote);

  // A channel on `ep`. `worker` < 0 picks one round robin. The local semaphore must stay
  // registered while the channel is used (producers read it directly); throws
  // kInvalidArgument / kUnknownHandle / kOutOfRange naming what was wrong.
  PortChannel add_channel(const Endpoint& ep, MemoryId dst, MemoryId src, RemoteSemaphore remote_sem,
                          LocalSemaphore local_sem, int worker = -1);

  // Starts the workers (channels may be added before or after). Idempotent.
  void start();
  // Stops the workers; requests still queued are dropped, and every channel and FIFO
  // reports kFailed (status kClosed) to its producers from then on. Idempotent.
  void stop();

  const ProxyOptions& options() const;
  ProxyStats stats() const;
  size_t channels() const;
  size_t memories() const;

 private:
  std::shared_ptr<detail::ProxyCore> core_;
};

}  // namespace sluice
