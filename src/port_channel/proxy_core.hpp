// The proxy's private state: FIFOs (one per worker), the memory and channel tables, and the
// worker threads that pop requests and post them on the channels' endpoints.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "port_channel/post_batcher.hpp"
#include "port_channel/shared_block.hpp"
#include "sluice/config.hpp"
#include "sluice/endpoint.hpp"
#include "sluice/port_channel.hpp"

namespace sluice::detail {

class Registry;

// One FIFO and the proxy's private read position.
struct Fifo {
  Fifo(uint32_t depth, ProducerKind kind, int device);
  SharedBlock shared;      // depth slots, then the tail and the state word (own cache lines)
  ProducerBlock counters;  // head, then the cached tail (own cache lines)
  port::FifoHandle handle;  // the producer's view
  port::Slot* slots = nullptr;  // the proxy's view of the same memory
  uint64_t* tail = nullptr;
  uint32_t* state = nullptr;
  uint64_t next = 0;  // the next ticket to consume (worker-private)
};

struct MemoryEntry {
  bool remote = false;
  MemoryHandle local;
  RemoteHandle remote_handle;
  const void* endpoint = nullptr;  // EndpointImpl of a remote entry
};

struct PortChannelRecord {
  PortChannelRecord(ProducerKind kind, int device);
  uint32_t id = 0;
  int worker = 0;
  Endpoint ep;
  RemoteSemaphore remote_sem;
  SharedBlock state_block;     // port::ChannelState
  ProducerBlock expected_block;  // wait()'s consumed count
  std::shared_ptr<Fifo> fifo;    // keeps the handle's FIFO memory alive
  PortChannelDeviceHandle handle;
  port::ChannelState* state = nullptr;  // host view

  std::atomic<bool> failed{false};
  mutable std::mutex mu;
  Status why;
  // First failure wins; producers see it through state->error. A failure is logged unless
  // it is the proxy's own orderly stop.
  void fail(const Status& st, bool log = true);
  Status status() const;
};

class ProxyCore {
 public:
  // `config`: the engine's, for the port.* parameters.
  ProxyCore(Registry& registry, ProxyOptions options, const EngineConfig& config);
  ~ProxyCore();

  MemoryId add_local(MemoryHandle h);
  MemoryId add_remote(const Endpoint& ep, RemoteHandle h);
  std::shared_ptr<PortChannelRecord> add_channel(const Endpoint& ep, MemoryId dst, MemoryId src,
                                                 RemoteSemaphore remote_sem, LocalSemaphore local_sem, int worker);
  void start();
  void stop();
  ProxyStats stats() const;
  size_t channels() const;
  size_t memories() const;
  const ProxyOptions& options() const { return opt_; }

 private:
  struct Popped {
    port::Request r;
    uint64_t kinds = 0;
    uint64_t ticket = 0;
  };
  using Memories = std::vector<MemoryEntry>;
  using Channels = std::vector<std::shared_ptr<PortChannelRecord>>;
  struct Snapshot {
    std::shared_ptr<const Memories> mems;
    std::shared_ptr<const Channels> chans;
  };
  Snapshot snapshot() const;
  MemoryId append_memory(MemoryEntry e);
  void worker(int index);
  // Pops what the FIFO holds, up to port.batch_max requests, into *out (false: the FIFO is
  // corrupt, its channels failed, the worker ends).
  bool pop(Fifo& f, int index, Snapshot& snap, std::vector<Popped>* out);
  // Adds a popped request's puts and signals to the batch; a flush (or an error the proxy
  // finds itself) first posts the batch so far, so it happens in FIFO order.
  void handle(const Popped& p, Snapshot& snap, PostBatcher& batch);
  void check_liveness(int index, const Snapshot& snap);

  Registry& registry_;
  ProxyOptions opt_;
  size_t batch_max_ = 1;  // port.batch_max
  std::vector<std::shared_ptr<Fifo>> fifos_;
  std::vector<std::thread> threads_;

  // Copy-on-write tables: workers take a snapshot and reload it only when a request names an
  // id past its end, so the hot path takes no lock.
  mutable std::mutex mu_;
  std::shared_ptr<const Memories> mems_;
  std::shared_ptr<const Channels> chans_;
  bool started_ = false, stopped_ = false;
  uint32_t next_worker_ = 0;
  std::atomic<bool> running_{false};

  std::atomic<uint64_t> requests_{0}, puts_{0}, signals_{0}, flushes_{0}, dropped_{0}, batches_{0};
};

}  // namespace sluice::detail
