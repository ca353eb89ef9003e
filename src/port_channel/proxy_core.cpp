#include "port_channel/proxy_core.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "core/device_hooks.hpp"
#include "core/log.hpp"
#include "core/params.hpp"
#include "core/registry.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail {
namespace {

using Clock = std::chrono::steady_clock;

// The FIFO's shared block: the slots, then the tail and the state word, each on its own cache
// line (the proxy writes the tail on every pop; producers spin on it only when full).
constexpr size_t kTailOffset = 0, kStateOffset = 64, kLine = 64;

std::string mem_name(MemoryId id) { return "memory id " + std::to_string(id); }

const Param<uint64_t> kBatchMax{"port.batch_max", "SLUICE_PORT_BATCH_MAX", 256, size_in(1, 1 << 20),
                                "port channel: requests a proxy worker pops before it posts them, as one "
                                "Endpoint::post_batch per endpoint (1 = one request at a time)"};

}  // namespace

Fifo::Fifo(uint32_t depth, ProducerKind kind, int device)
    : shared(size_t(depth) * sizeof(port::Slot) + 2 * kLine, kind, device), counters(2 * kLine, kind, device) {
  auto* host = static_cast<uint8_t*>(shared.host());
  auto* prod = static_cast<uint8_t*>(shared.producer());
  size_t slots_bytes = size_t(depth) * sizeof(port::Slot);
  slots = reinterpret_cast<port::Slot*>(host);
  tail = reinterpret_cast<uint64_t*>(host + slots_bytes + kTailOffset);
  state = reinterpret_cast<uint32_t*>(host + slots_bytes + kStateOffset);
  auto* c = static_cast<uint8_t*>(counters.get());
  handle.slots = reinterpret_cast<port::Slot*>(prod);
  handle.tail = reinterpret_cast<uint64_t*>(prod + slots_bytes + kTailOffset);
  handle.state = reinterpret_cast<uint32_t*>(prod + slots_bytes + kStateOffset);
  handle.head = reinterpret_cast<uint64_t*>(c);
  handle.tail_cache = reinterpret_cast<uint64_t*>(c + kLine);
  handle.depth = depth;
}

PortChannelRecord::PortChannelRecord(ProducerKind kind, int device)
    : state_block(sizeof(port::ChannelState), kind, device), expected_block(sizeof(uint64_t), kind, device) {
  state = static_cast<port::ChannelState*>(state_block.host());
}

void PortChannelRecord::fail(const Status& st, bool log) {
  std::lock_guard<std::mutex> lk(mu);
  if (failed.load(std::memory_order_relaxed)) return;
  why = st;
  failed.store(true, std::memory_order_release);
  uint32_t code = static_cast<uint32_t>(st.code == ErrorCode::kOk ? ErrorCode::kInternal : st.code);
  __atomic_store_n(&state->error, code, __ATOMIC_RELEASE);
  if (log) SLUICE_LOG(kWarn, "port channel " << id << " failed: " << st.to_string());
}

Status PortChannelRecord::status() const {
  std::lock_guard<std::mutex> lk(mu);
  return why;
}

ProxyCore::ProxyCore(Registry& registry, ProxyOptions options, const EngineConfig& config)
    : registry_(registry),
      opt_(options),
      batch_max_(options.batch_max ? options.batch_max : static_cast<size_t>(kBatchMax.get(config))),
      mems_(std::make_shared<const Memories>()),
      chans_(std::make_shared<const Channels>()) {
  if (opt_.workers < 1)
    throw Error(ErrorCode::kInvalidArgument, "ProxyService: workers must be >= 1 (got " + std::to_string(opt_.workers) + ")");
  if (opt_.fifo_depth < 2 || (opt_.fifo_depth & (opt_.fifo_depth - 1)) != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "ProxyService: fifo_depth must be a power of two >= 2 (got " + std::to_string(opt_.fifo_depth) + ")");
  if (opt_.fifo_depth > (1u << 23))
    throw Error(ErrorCode::kInvalidArgument, "ProxyService: fifo_depth " + std::to_string(opt_.fifo_depth) +
                                                 " is above the limit of 2^23 requests (1 GiB of pinned memory)");
  // A batch never holds more than one FIFO's worth: what a worker pops it has room for.
  batch_max_ = std::min<size_t>(batch_max_, opt_.fifo_depth);
  opt_.batch_max = static_cast<uint32_t>(batch_max_);  // options() reports what is used
  for (int i = 0; i < opt_.workers; ++i)
    fifos_.push_back(std::make_shared<Fifo>(opt_.fifo_depth, opt_.producers, opt_.cuda_device));
}

ProxyCore::~ProxyCore() { stop(); }

ProxyCore::Snapshot ProxyCore::snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {mems_, chans_};
}

MemoryId ProxyCore::append_memory(MemoryEntry e) {
  std::lock_guard<std::mutex> lk(mu_);
  if (mems_->size() >= 0xffffffffull)
    throw Error(ErrorCode::kInvalidArgument, "ProxyService: 2^32 - 1 memories already added");
  auto next = std::make_shared<Memories>(*mems_);
  next->push_back(e);
  mems_ = std::move(next);
  return static_cast<MemoryId>(mems_->size() - 1);
}

MemoryId ProxyCore::add_local(MemoryHandle h) {
  if (!registry_.find(h.id))
    throw Error(ErrorCode::kUnknownHandle,
                "ProxyService::add_memory: local handle " + std::to_string(h.id) + " is not registered with this engine");
  MemoryEntry e;
  e.local = h;
  return append_memory(e);
}

MemoryId ProxyCore::add_remote(const Endpoint& ep, RemoteHandle h) {
  if (!ep.valid()) throw Error(ErrorCode::kInvalidArgument, "ProxyService::add_memory: invalid endpoint");
  bool found = false;
  for (const auto& r : ep.remote_regions()) found = found || r.id == h.id;
  if (!found)
    throw Error(ErrorCode::kUnknownHandle, "ProxyService::add_memory: remote handle " + std::to_string(h.id) +
                                               " is not a region of peer " + ep.peer_engine_id());
  MemoryEntry e;
  e.remote = true;
  e.remote_handle = h;
  e.endpoint = ep.impl().get();
  return append_memory(e);
}

std::shared_ptr<PortChannelRecord> ProxyCore::add_channel(const Endpoint& ep, MemoryId dst, MemoryId src,
                                                          RemoteSemaphore remote_sem, LocalSemaphore local_sem,
                                                          int worker) {
  const char* what = "ProxyService::add_channel";
  if (!ep.valid()) throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": invalid endpoint");
  if (!ep.capabilities().rma_post)
    throw Error(ErrorCode::kUnsupported, std::string(what) + ": transport " + ep.transport() +
                                             " has no thin post path (Capabilities::rma_post)");
  if (!ep.capabilities().signal)
    throw Error(ErrorCode::kUnsupported,
                std::string(what) + ": transport " + ep.transport() + " cannot signal (Capabilities::signal)");
  if (worker >= opt_.workers)
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": worker " + std::to_string(worker) +
                                                 " but the service has " + std::to_string(opt_.workers));
  {
    auto snap = snapshot();
    auto check = [&](MemoryId id, bool remote, const char* role) {
      if (id >= snap.mems->size())
        throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": " + role + " " + mem_name(id) +
                                                     " was never added (the service has " +
                                                     std::to_string(snap.mems->size()) + ")");
      const MemoryEntry& e = (*snap.mems)[id];
      if (e.remote != remote)
        throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": " + role + " " + mem_name(id) + " is a " +
                                                     (e.remote ? "remote" : "local") + " memory");
      if (remote && e.endpoint != ep.impl().get())
        throw Error(ErrorCode::kInvalidArgument,
                    std::string(what) + ": " + role + " " + mem_name(id) + " belongs to another endpoint");
    };
    check(dst, true, "destination");
    check(src, false, "source");
  }
  // The peer's counter: in a region it advertised, 8-byte aligned.
  if (remote_sem.offset % 8 != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": remote semaphore offset " +
                                                 std::to_string(remote_sem.offset) + " is not 8-byte aligned");
  bool found = false;
  for (const auto& r : ep.remote_regions())
    if (r.id == remote_sem.region.id) {
      found = true;
      if (!in_bounds(remote_sem.offset, 8, r.length))
        throw Error(ErrorCode::kOutOfRange, std::string(what) + ": remote semaphore at offset " +
                                                std::to_string(remote_sem.offset) + " is outside region " +
                                                std::to_string(r.id) + " of " + std::to_string(r.length) + " bytes");
    }
  if (!found)
    throw Error(ErrorCode::kUnknownHandle, std::string(what) + ": remote semaphore region " +
                                               std::to_string(remote_sem.region.id) + " is not a region of the peer");
  // Our counter: producers read it directly, so it must be memory they can read.
  auto entry = registry_.find(local_sem.region.id);
  if (!entry)
    throw Error(ErrorCode::kUnknownHandle, std::string(what) + ": local semaphore region " +
                                               std::to_string(local_sem.region.id) + " is not registered");
  if (local_sem.offset % 8 != 0 || !in_bounds(local_sem.offset, 8, entry->length))
    throw Error(local_sem.offset % 8 ? ErrorCode::kInvalidArgument : ErrorCode::kOutOfRange,
                std::string(what) + ": local semaphore offset " + std::to_string(local_sem.offset) +
                    " must be 8-byte aligned and inside region " + std::to_string(local_sem.region.id) + " (" +
                    std::to_string(entry->length) + " bytes)");
  bool producers_on_gpu = opt_.producers == ProducerKind::kCuda;
  // Host memory serves GPU producers only when it is pinned and mapped at the same address
  // (the HierAllGather's rail buffer): a kernel then waits on it across the bus.
  const DeviceMemoryHooks* hooks = device_memory_hooks();
  if (producers_on_gpu && entry->location.is_host() &&
      !(hooks && hooks->host_mapped && hooks->host_mapped(entry->base + local_sem.offset, 8)))
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": the local semaphore is host memory that GPU threads cannot read (register "
                                    "it as cuda memory, or use pinned mapped host memory), but the producers are "
                                    "GPU threads");
  if (!producers_on_gpu && !entry->location.is_host())
    throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": the local semaphore is " +
                                                 entry->location.to_string() +
                                                 " memory, but the producers are host threads (ProducerKind::kHost)");

  auto rec = std::make_shared<PortChannelRecord>(opt_.producers, opt_.cuda_device);
  rec->ep = ep;
  rec->remote_sem = remote_sem;
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_) throw Error(ErrorCode::kClosed, std::string(what) + ": the proxy service was stopped");
  if (chans_->size() >= 0xffffffffull) throw Error(ErrorCode::kInvalidArgument, std::string(what) + ": too many channels");
  rec->id = static_cast<uint32_t>(chans_->size());
  rec->worker = worker >= 0 ? worker : static_cast<int>(next_worker_++ % opt_.workers);
  rec->fifo = fifos_[rec->worker];
  PortChannelDeviceHandle& h = rec->handle;
  h.fifo = rec->fifo->handle;
  h.channel = rec->id;
  h.dst_mem = dst;
  h.src_mem = src;
  h.local_semaphore = reinterpret_cast<uint64_t*>(entry->base + local_sem.offset);
  h.expected = static_cast<uint64_t*>(rec->expected_block.get());
  h.state = static_cast<port::ChannelState*>(rec->state_block.producer());
  h.spin_ns = opt_.push_spin_ns;
  auto next = std::make_shared<Channels>(*chans_);
  next->push_back(rec);
  chans_ = std::move(next);
  return rec;
}

void ProxyCore::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_) throw Error(ErrorCode::kClosed, "ProxyService::start: the service was stopped");
  if (started_) return;
  started_ = true;
  running_ = true;
  for (int i = 0; i < opt_.workers; ++i) threads_.emplace_back([this, i] {
    ::sluice::detail::name_this_thread("sluice-proxy" + std::to_string(i));
    worker(i);
  });
}

void ProxyCore::stop() {
  std::shared_ptr<const Channels> chans;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return;
    stopped_ = true;
    running_ = false;
    chans = chans_;
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  // Producers must not wait for a proxy that is gone: the FIFOs and channels report kFailed.
  for (auto& f : fifos_) {
    uint32_t ok = port::kFifoOk;
    __atomic_compare_exchange_n(f->state, &ok, port::kFifoStopped, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }
  for (auto& c : *chans) c->fail({ErrorCode::kClosed, "the proxy service was stopped"}, /*log=*/false);
}

ProxyStats ProxyCore::stats() const {
  ProxyStats s;
  s.requests = requests_.load();
  s.puts = puts_.load();
  s.signals = signals_.load();
  s.flushes = flushes_.load();
  s.dropped = dropped_.load();
  s.batches = batches_.load();
  return s;
}

size_t ProxyCore::channels() const { return snapshot().chans->size(); }
size_t ProxyCore::memories() const { return snapshot().mems->size(); }

void ProxyCore::worker(int index) {
  Fifo& f = *fifos_[index];
  Snapshot snap = snapshot();
  auto idle_since = Clock::now();
  auto next_liveness = idle_since + opt_.liveness_interval;
  uint64_t since_check = 0;
  std::vector<Popped> popped;
  popped.reserve(batch_max_);
  PostBatcher batch({&puts_, &signals_, &dropped_, &batches_});
  while (running_.load(std::memory_order_relaxed)) {
    popped.clear();
    if (!pop(f, index, snap, &popped)) break;
    if (popped.empty()) {
      auto now = Clock::now();
      if (now >= next_liveness) {
        check_liveness(index, snap);
        next_liveness = now + opt_.liveness_interval;
      }
      if (__atomic_load_n(f.state, __ATOMIC_ACQUIRE) != port::kFifoOk) {
        // A producer gave up a ticket (push timeout): that slot will never be filled.
        snap = snapshot();
        for (auto& c : *snap.chans)
          if (c->worker == index)
            c->fail({ErrorCode::kTimeout, "a producer's push timed out on a full FIFO (worker " + std::to_string(index) +
                                              "): the FIFO cannot recover"});
        break;
      }
      if (now - idle_since > opt_.idle_spin) std::this_thread::sleep_for(opt_.idle_sleep);
      continue;
    }
    for (const Popped& p : popped) handle(p, snap, batch);
    batch.post_all();
    idle_since = Clock::now();
    since_check += popped.size();
    if (since_check >= 64) {
      since_check = 0;
      if (idle_since >= next_liveness) {
        check_liveness(index, snap);
        next_liveness = idle_since + opt_.liveness_interval;
      }
    }
  }
}

bool ProxyCore::pop(Fifo& f, int index, Snapshot& snap, std::vector<Popped>* out) {
  const uint64_t mask = f.handle.depth - 1;
  while (out->size() < batch_max_) {
    Popped& p = out->emplace_back();
    const port::SlotState got = port::read_slot(f.slots + (f.next & mask), f.next, f.handle.depth, &p.r, &p.kinds);
    if (got == port::SlotState::kNotYet) {
      out->pop_back();
      return true;
    }
    if (got == port::SlotState::kCorrupt) {
      out->pop_back();
      // Only a producer writing outside the protocol gets here; nothing later can be trusted.
      // What was popped before it is dropped with the FIFO's channels.
      __atomic_store_n(f.state, port::kFifoCorrupt, __ATOMIC_RELEASE);
      snap = snapshot();
      for (auto& c : *snap.chans)
        if (c->worker == index)
          c->fail({ErrorCode::kProtocol, "port channel FIFO of worker " + std::to_string(index) + ": slot " +
                                             std::to_string(f.next & mask) + " holds a word that no producer of ticket " +
                                             std::to_string(f.next) + " or of an earlier lap wrote"});
      return false;
    }
    // Pop before posting: the request is copied, and producers refill the slot meanwhile.
    p.ticket = f.next++;
    __atomic_store_n(f.tail, f.next, __ATOMIC_RELEASE);
  }
  return true;
}

void ProxyCore::check_liveness(int index, const Snapshot& snap) {
  for (auto& c : *snap.chans) {
    if (c->worker != index || c->failed.load(std::memory_order_acquire) || c->ep.connected()) continue;
    Status st{ErrorCode::kPeerLost, "the endpoint to peer " + c->ep.peer_engine_id() + " failed"};
    try {
      c->ep.flush(std::chrono::milliseconds(1));  // a failed endpoint throws its failure at once
    } catch (const Error& e) {
      st = e.status();
    }
    c->fail(st);
  }
}

void ProxyCore::handle(const Popped& p, Snapshot& snap, PostBatcher& batch) {
  const port::Request& r = p.r;
  requests_.fetch_add(1, std::memory_order_relaxed);
  if (r.channel >= snap.chans->size()) snap = snapshot();
  if (r.channel >= snap.chans->size()) {
    // No channel to fail: a producer used a handle of another service.
    dropped_.fetch_add(1, std::memory_order_relaxed);
    SLUICE_LOG(kError, "port channel: request for unknown channel " << r.channel << " dropped");
    return;
  }
  PortChannelRecord& c = *(*snap.chans)[r.channel];
  if (c.failed.load(std::memory_order_acquire)) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  bool first = true;
  if ((p.kinds & port::kPut) && r.size > 0) {
    if (std::max(r.dst_mem, r.src_mem) >= snap.mems->size()) snap = snapshot();
    std::string bad;
    if (r.dst_mem >= snap.mems->size() || r.src_mem >= snap.mems->size()) {
      bad = "put names " + mem_name(std::max(r.dst_mem, r.src_mem)) + ", never added (the service has " +
            std::to_string(snap.mems->size()) + ")";
    } else {
      const MemoryEntry& dst = (*snap.mems)[r.dst_mem];
      const MemoryEntry& src = (*snap.mems)[r.src_mem];
      if (!dst.remote || dst.endpoint != c.ep.impl().get())
        bad = "put destination " + mem_name(r.dst_mem) +
              (dst.remote ? " is a region of another endpoint's peer" : " is a local memory");
      else if (src.remote)
        bad = "put source " + mem_name(r.src_mem) + " is a remote memory";
      else
        batch.add(c, PostRequest::write(src.local, r.src_offset, dst.remote_handle, r.dst_offset, r.size), true);
    }
    if (!bad.empty()) {
      // The channel's earlier requests still go out first, as they did one at a time.
      batch.post_all();
      c.fail({ErrorCode::kInvalidArgument, "channel " + std::to_string(c.id) + ": " + bad});
      return;
    }
    first = false;
  }
  if (p.kinds & port::kSignal) batch.add(c, PostRequest::signal(c.remote_sem.region, c.remote_sem.offset, 1), first);
  if (p.kinds & port::kFlush) {
    batch.post_all();
    if (c.failed.load(std::memory_order_acquire)) return;  // a post of this request failed it
    try {
      c.ep.flush(opt_.flush_timeout);
      flushes_.fetch_add(1, std::memory_order_relaxed);
      __atomic_store_n(&c.state->flush_done, p.ticket + 1, __ATOMIC_RELEASE);
    } catch (const Error& e) {
      c.fail({e.code(), "channel " + std::to_string(c.id) + ": " + e.status().message});
    }
  }
}

}  // namespace sluice::detail
