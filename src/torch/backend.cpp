#include "backend.hpp"

#include <c10/core/StreamGuard.h>

#include <Python.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <set>

#include <c10/util/Exception.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "core/engine_impl.hpp"
#include "core/log.hpp"
#include "cuda_registrations.hpp"
#include "host_staging.hpp"
#include "sluice/cuda.hpp"
#include "store_directory.hpp"
#include "transport/transport.hpp"
#include "work.hpp"
#include "core/thread_name.hpp"

namespace sluice::torch_backend {

std::exception_ptr backend_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

SluiceWork::SluiceWork(c10d::OpType type, std::vector<at::Tensor> outputs, std::chrono::milliseconds timeout, int rank)
    : Work(rank, type),
      outputs_(std::move(outputs)),
      timeout_(timeout),
      rank_(rank),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void SluiceWork::complete(std::exception_ptr error, int source) {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    source_ = source;
  }
  // The future first, as gloo does: a wait() that returns must find it completed too (a caller
  // reading work.get_future().value() right after work.wait() hit torch's "completed()"
  // assertion when the Work was marked first). Its callbacks run user code here, before the
  // Work reads as completed; a callback only sees the future, which is done.
  if (error)
    future_->setError(error);
  else
    future_->markCompleted(c10::IValue(outputs_));
  finish(error);
  // A thread driving the queue in wait() sleeps on the queue, not on the Work: tell it. (A
  // Work completed by a task needs this only when another thread ran the task; cheap anyway.)
  if (queue_) queue_->wake();
}

bool SluiceWork::wait(std::chrono::milliseconds timeout) {
  // Without an explicit timeout this is only a backstop: every step of the operation is
  // bounded by the group timeout where it waits on a peer (a recv expires, a send to a peer
  // that takes nothing fails), and that failure names the peer rank. Waiting exactly the
  // group timeout here would race it and report a bare "did not complete" instead.
  auto limit = timeout == kNoTimeout ? timeout_ * 2 + std::chrono::seconds(10) : timeout;
  if (trace_) trace_->mark(TraceEv::kWaitStart, trace_peer_);
  struct End {
    Trace* t;
    int peer;
    ~End() {
      if (t) t->mark(TraceEv::kWaitEnd, peer);
    }
  } end{trace_, trace_peer_};
  if (queue_) {
    // Run the mailbox's tasks here until this op completed (or the limit): the engine's
    // completion wakes this thread rather than the mailbox thread, which would wake it.
    queue_->drive_until(
        [this] {
          std::lock_guard<std::mutex> g(mutex_);
          return completed_;
        },
        std::chrono::steady_clock::now() + limit);
  }
  std::unique_lock<std::mutex> lk(mutex_);
  if (!cv_.wait_for(lk, queue_ ? std::chrono::milliseconds(0) : limit, [&] { return completed_; })) {
    lk.unlock();
    std::rethrow_exception(backend_error("sluice: rank " + std::to_string(rank_) + ": " +
                                         c10d::opTypeToString(opType_) + (peer_.empty() ? "" : " with " + peer_) +
                                         " did not complete within " + std::to_string(limit.count()) + " ms"));
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

int SluiceWork::sourceRank() const {
  std::lock_guard<std::mutex> lk(mutex_);
  TORCH_CHECK(source_ >= 0, "sluice: sourceRank() is known only for a completed recv");
  return source_;
}

StreamWork::StreamWork(c10d::OpType type, std::vector<at::Tensor> outputs, c10::Stream stream,
                       std::shared_ptr<c10::Event> done, bool captured, int rank)
    : Work(rank, type),
      outputs_(std::move(outputs)),
      stream_(stream),
      done_(std::move(done)),
      captured_(captured) {
  if (captured_) {
    std::lock_guard<std::mutex> lk(future_mu_);
    make_future();
  }
}

void StreamWork::make_future() {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                     std::vector<c10::Device>{stream_.device()});
  // As NCCL does: the future is complete; being a CUDA future, it records an event on the
  // current stream, made the op's here (then the event follows the op), and makes whoever
  // reads its value wait for it.
  c10::StreamGuard guard(stream_);
  future_->markCompleted(c10::IValue(outputs_));
}

c10::intrusive_ptr<c10::ivalue::Future> StreamWork::getFuture() {
  std::lock_guard<std::mutex> lk(future_mu_);
  if (!future_) make_future();
  return future_;
}

bool StreamWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lk(mutex_);
    if (completed_) return true;
  }
  // Never query an event made in a capture (a query would invalidate it).
  if (!captured_ && !done_->query()) return false;
  finish();
  return true;
}

void StreamWork::synchronize() {
  const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream cur = g->getStream(stream_.device());
  if (cur == stream_) return;  // ordered already
  // Across the start or end of a capture an event wait means nothing or is refused (see
  // LowLatencyAllGather::launch); within one capture or outside any, it orders the streams.
  if (captured_ != cuda::stream_capturing(cur.native_handle())) return;
  done_->block(cur);
}

bool StreamWork::wait(std::chrono::milliseconds) {
  synchronize();
  return true;
}

namespace {

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.layout() == at::kStrided, "sluice: ", what, ": only dense (strided) tensors are supported, got ",
              t.layout());
  TORCH_CHECK(t.device().is_cpu(), "sluice: ", what, ": ", t.device(),
              " tensors are not supported by the sluice backend (CPU and CUDA tensors are)");
}

// A user tag (c10d passes an int) in the p2p tag space; collectives use the top bit.
uint64_t user_tag(int tag) { return uint64_t(uint32_t(tag)); }

std::chrono::milliseconds env_ms(const char* name, std::chrono::milliseconds fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  return std::chrono::milliseconds(std::stoll(v));
}

// A byte count from the environment, strictly: digits only (no sign, unit or spaces).
uint64_t env_bytes(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  uint64_t out = 0;
  const char* end = v + std::strlen(v);
  auto [p, ec] = std::from_chars(v, end, out);
  if (ec != std::errc() || p != end)
    throw Error(ErrorCode::kInvalidArgument, std::string("sluice: ") + name + " must be a byte count, got '" + v + "'");
  return out;
}

}  // namespace

SluiceBackend::SluiceBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size), timeout_(timeout) {
  // Messages from this size go by rendezvous (mailbox.hpp); the default is measured in
  // docs/torch.md. The bound on unexpected eager messages held at once (mailbox.hpp). Read
  // before connecting, so that a bad value fails before any peer waits.
  const uint64_t rndv_bytes = env_bytes("SLUICE_TORCH_RNDV_BYTES", 256 << 10);
  const uint64_t max_unexpected_bytes =
      env_bytes("SLUICE_TORCH_MAX_UNEXPECTED_BYTES", Mailbox::kDefaultMaxUnexpectedBytes);
  // Eager messages up to this size travel inside their header's engine message (mailbox.hpp).
  const uint64_t inline_bytes = env_bytes("SLUICE_TORCH_INLINE_BYTES", Mailbox::kDefaultInlineBytes);
  // CUDA all_gathers of up to this many bytes per rank run as one NVLink kernel on the
  // caller's stream where the group allows it (ll_allgather.hpp); 0 turns that off.
  const uint64_t ll_bytes = env_bytes("SLUICE_TORCH_LL_ALLGATHER_BYTES", LowLatencyAllGather::kDefaultMaxBytes);
  if (inline_bytes > Mailbox::kMaxInlineBytes)
    throw Error(ErrorCode::kInvalidArgument, "sluice: SLUICE_TORCH_INLINE_BYTES must be at most " +
                                                 std::to_string(Mailbox::kMaxInlineBytes) + ", got " +
                                                 std::to_string(inline_bytes));
  // Recvs of rndv_bytes or more tell their sender in advance that they are posted (mailbox.hpp,
  // ready-to-receive), so that the payload goes without an RTS / CTS round trip. Only the
  // receiver's setting matters: every rank takes the RTRs it is given.
  const uint64_t recv_ready = env_bytes("SLUICE_TORCH_RECV_READY", 1);
  // Who runs the mailbox's tasks (docs/torch.md, "Who runs the mailbox"): 1, the threads
  // that wait for them; 0, the mailbox thread alone (as before; for comparisons). And
  // whether bookkeeping completions wake nobody (1) or a runner like any other (0).
  const uint64_t caller_runs = env_bytes("SLUICE_TORCH_CALLER_RUNS", 1);
  const uint64_t quiet_acks = env_bytes("SLUICE_TORCH_QUIET_ACKS", 1);
  // How long a thread waiting for the mailbox polls before it sleeps (progress_queue.hpp): a
  // completion it sees while polling costs no wake-up. Default 1 ms where the host has at least
  // 4 hardware threads per rank on it (torchrun's LOCAL_WORLD_SIZE, else 2 assumed), else 0: a
  // polling waiter would take the cores the engine's threads need.
  const unsigned hw = std::thread::hardware_concurrency();
  const uint64_t local_ranks = std::max<uint64_t>(1, env_bytes("LOCAL_WORLD_SIZE", 2));
  const uint64_t spin_us = env_bytes("SLUICE_TORCH_SPIN_US", hw >= 4 * local_ranks && hw >= 8 ? 1000 : 0);
  if (spin_us > 1000000)
    throw Error(ErrorCode::kInvalidArgument, "sluice: SLUICE_TORCH_SPIN_US must be at most 1000000 (1 s), got " +
                                                 std::to_string(spin_us));
  for (auto [name, v] : {std::pair<const char*, uint64_t>{"SLUICE_TORCH_CALLER_RUNS", caller_runs},
                         std::pair<const char*, uint64_t>{"SLUICE_TORCH_QUIET_ACKS", quiet_acks}})
    if (v > 1)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("sluice: ") + name + " must be 0 or 1, got " + std::to_string(v));
  if (recv_ready > 1)
    throw Error(ErrorCode::kInvalidArgument, "sluice: SLUICE_TORCH_RECV_READY must be 0 or 1, got " +
                                                 std::to_string(recv_ready));
  // Collectives of CUDA tensors over the device path (exchange_device): on by default since it
  // ran on 2 and 4 H200s (2026-11-28: bit-equal, 10-300x faster than staging through host
  // memory, docs/torch.md). Set it alike on every rank: it decides who sends what, where.
  const uint64_t device_collectives = env_bytes("SLUICE_TORCH_DEVICE_COLLECTIVES", 1);
  if (device_collectives > 1)
    throw Error(ErrorCode::kInvalidArgument, "sluice: SLUICE_TORCH_DEVICE_COLLECTIVES must be 0 or 1, got " +
                                                 std::to_string(device_collectives));
  device_collectives_ = device_collectives == 1;
  // How CUDA tensors move: "auto" (default) sends and receives large ones directly between
  // GPUs of a host (a device endpoint over nvlink per peer, see below); "host" always stages
  // them through host memory (host_staging.hpp); "stream" is "auto" with send/recv between
  // GPUs of a host as kernels on the caller's stream, NCCL's contract (stream_p2p_link.hpp).
  const char* path_env = std::getenv("SLUICE_TORCH_CUDA_PATH");
  const std::string cuda_path = path_env && *path_env ? path_env : "auto";
  if (cuda_path != "auto" && cuda_path != "host" && cuda_path != "stream")
    throw Error(ErrorCode::kInvalidArgument,
                "sluice: SLUICE_TORCH_CUDA_PATH must be 'auto', 'host' or 'stream', got '" + cuda_path + "'");
  EngineConfig base;
  // Our own header recvs stay posted while the group is idle: the Mailbox bounds every
  // user-visible recv with the group timeout instead of the engine's recv timeout.
  base.recv_timeout = std::chrono::milliseconds(0);
  base.op_timeout = timeout;
  // nvlink runs only for the device endpoints (and only with the device path on). The
  // control and data endpoints avoid it: they carry host memory, which nvlink moves through
  // the copy engine (on the H100 machine an 8-byte send/recv took 130-230 us over it against
  // about 50 us for gloo, docs/torch.md). SLUICE_TRANSPORTS (applied by the Engine on top of
  // this) still chooses; SLUICE_TORCH_TRANSPORT forces one for the control and data endpoints.
  bool has_nvlink = false;
  for (const auto& f : detail::transport_factories()) {
    if (f.name == "nvlink" && (cuda_path == "host" || cuda::device_count() == 0)) continue;
    base.transports.push_back(f.name);
  }
  engine_ = std::make_unique<Engine>(base);
  for (const auto& t : engine_->transports()) has_nvlink |= t == "nvlink";
  auto dir = std::make_shared<StoreDirectory>(store, rank);
  engine_->impl().use_directory(dir);

  ConnectOptions co;
  if (const char* t = std::getenv("SLUICE_TORCH_TRANSPORT")) co.transport = t;
  co.avoid = {"nvlink"};
  // Peers start at different times: the Store lookup waits for them, up to the group timeout
  // (SLUICE_TORCH_CONNECT_TIMEOUT_MS shortens it).
  co.timeout = std::min(timeout, env_ms("SLUICE_TORCH_CONNECT_TIMEOUT_MS", timeout));
  // A lost rank fails the group (as with gloo and NCCL): a new connection would restart the
  // pair's message sequence under operations the peer never matches.
  co.reconnect = false;
  const auto deadline = std::chrono::steady_clock::now() + *co.timeout;

  std::vector<Endpoint> peers(size), data(size), dev(size);
  // The lower rank dials, the higher one accepts: two endpoints per pair (control and data,
  // see mailbox.hpp), used in both directions, and a third, the device endpoint, where both
  // ranks run nvlink and it reaches (CUDA payloads). The first message on each says which one
  // it is (the accept order need not be the dial order); the dialer tells the acceptor
  // through the Store whether a device endpoint comes.
  auto key = [](const std::string& what, int a, int b) {
    return "sluice_torch/" + what + "/" + std::to_string(a) + (b >= 0 ? "/" + std::to_string(b) : "");
  };
  auto store_wait = [&](const std::string& k) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    store->wait({k}, std::max(left, std::chrono::milliseconds(1)));
    auto v = store->get(k);
    return std::string(v.begin(), v.end());
  };
  auto put = [&](const std::string& k, const std::string& v) {
    store->set(k, std::vector<uint8_t>(v.begin(), v.end()));
  };
  put(key("nvlink", rank, -1), has_nvlink ? "1" : "0");
  put(key("p2p_mode", rank, -1), cuda_path == "stream" ? "stream" : "rendezvous");
  uint8_t roles[3] = {0, 1, 2};
  MemoryHandle roles_handle = engine_->register_memory(roles, sizeof(roles));
  std::vector<Future> marks;
  for (int j = rank + 1; j < size; ++j) {
    peers[j] = engine_->connect(StoreDirectory::ref(j), co);
    data[j] = engine_->connect(StoreDirectory::ref(j), co);
    marks.push_back(peers[j].send(roles_handle, 0, 1));
    marks.push_back(data[j].send(roles_handle, 1, 1));
    if (has_nvlink && store_wait(key("nvlink", j, -1)) == "1") {
      ConnectOptions dco = co;
      dco.transport = "nvlink";
      try {
        dev[j] = engine_->connect(StoreDirectory::ref(j), dco);
        marks.push_back(dev[j].send(roles_handle, 2, 1));
      } catch (const Error& e) {
        // Another host, or GPUs that cannot share memory: CUDA tensors to j go through host
        // memory instead.
        SLUICE_LOG(kInfo, "sluice torch: rank " << rank << ": no device endpoint to rank " << j << ": " << e.what());
      }
    }
    put(key("dev", rank, j), dev[j].valid() ? "1" : "0");
  }
  std::vector<size_t> expect(size, 2);
  int expected = 0;
  for (int j = 0; j < rank; ++j) {
    dir->lookup(StoreDirectory::ref(j), deadline);  // learn their engine ids
    if (has_nvlink && store_wait(key("dev", j, rank)) == "1") expect[j] = 3;
    expected += static_cast<int>(expect[j]);
  }
  std::vector<std::vector<Endpoint>> got_eps(size);
  for (int got = 0; got < expected;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    auto ep = left.count() > 0 ? engine_->accept(left) : std::nullopt;
    if (!ep) {
      engine_->close();  // the role marks we sent read `roles`
      std::string missing;
      for (int j = 0; j < rank; ++j)
        if (got_eps[j].size() < expect[j]) missing += (missing.empty() ? "" : ", ") + std::to_string(j);
      throw Error(ErrorCode::kTimeout, "sluice: rank " + std::to_string(rank) + ": peer rank(s) " + missing +
                                           " did not connect within " + std::to_string(co.timeout->count()) + " ms");
    }
    int j = dir->rank_of(ep->peer_engine_id());
    if (j < 0 || j >= rank || got_eps[j].size() >= expect[j]) {
      ep->close();  // not one of the ranks expected to dial us
      continue;
    }
    got_eps[j].push_back(std::move(*ep));
    ++got;
  }
  std::vector<uint8_t> seen(3 * size_t(rank), 0xff);
  MemoryHandle seen_handle = rank ? engine_->register_memory(seen.data(), seen.size()) : MemoryHandle{};
  for (int j = 0; j < rank; ++j)
    for (size_t k = 0; k < expect[j]; ++k) marks.push_back(got_eps[j][k].recv(seen_handle, 3 * j + k, 1));
  for (auto& f : marks) {
    auto left = deadline - std::chrono::steady_clock::now();
    Status st = f.wait_for(std::max<std::chrono::nanoseconds>(left, std::chrono::nanoseconds(0)))
                    ? f.status()
                    : Status{ErrorCode::kTimeout, "no answer"};
    if (!st.ok()) {
      engine_->close();  // nothing may still touch roles / seen
      throw Error(st.code, "sluice: rank " + std::to_string(rank) + ": could not set up the endpoints to the peers: " +
                               st.message);
    }
  }
  for (int j = 0; j < rank; ++j) {
    std::vector<Endpoint*> slot = {&peers[j], &data[j], &dev[j]};
    for (size_t k = 0; k < expect[j]; ++k) {
      const uint8_t role = seen[3 * j + k];
      if (role >= expect[j] || slot[role]->valid())
        throw Error(ErrorCode::kProtocol, "sluice: rank " + std::to_string(rank) + ": peer rank " + std::to_string(j) +
                                              " opened endpoints with roles out of order");
      *slot[role] = std::move(got_eps[j][k]);
    }
  }
  engine_->unregister_memory(roles_handle);
  if (seen_handle.id) engine_->unregister_memory(seen_handle);
  for (auto& p : peers)
    if (p.valid()) transport_ = p.transport();
  cuda_path_ = "host";
  for (auto& d : dev)
    if (d.valid()) cuda_path_ = d.transport();
  if (cuda_path_ != "host") cuda_regs_ = std::make_unique<CudaRegistrations>(*engine_);
  // The low-latency all_gather: this rank could take it with a device endpoint (nvlink, so the
  // same host) to every peer; all ranks agree through the Store (ll_allgather.hpp) once the
  // mailbox is up (a peer that is through may already send to us).
  std::string ll_off;
  if (size > 1) {
    if (ll_bytes == 0)
      ll_off = "SLUICE_TORCH_LL_ALLGATHER_BYTES=0";
    else if (size > LowLatencyAllGather::kMaxWorld)
      ll_off = "a group of " + std::to_string(size) + " ranks (it takes at most " +
               std::to_string(LowLatencyAllGather::kMaxWorld) + ")";
    else if (cuda_path == "host")
      ll_off = "SLUICE_TORCH_CUDA_PATH=host";
    else if (!has_nvlink)
      ll_off = "no nvlink transport on this rank (no GPU seen, or libsluice built without CUDA)";
    for (int j = 0; j < size && ll_off.empty(); ++j)
      if (j != rank && !dev[j].valid())
        ll_off = "no device endpoint between ranks " + std::to_string(rank) + " and " + std::to_string(j) +
                 " (another host, or GPUs that cannot share memory)";
  }
  // The stream path takes a pair's CUDA messages only if both ranks run it: a sender on it and
  // a receiver off it would never meet, so ranks that disagree fail here, naming the setting.
  std::vector<int> stream_peers;
  for (int j = 0; j < size; ++j) {
    if (j == rank || !dev[j].valid()) continue;
    const std::string theirs = store_wait(key("p2p_mode", j, -1));
    if ((theirs == "stream") != (cuda_path == "stream")) {
      engine_->close();
      throw Error(ErrorCode::kInvalidArgument,
                  "sluice: rank " + std::to_string(rank) + " runs " +
                      (cuda_path == "stream" ? "SLUICE_TORCH_CUDA_PATH=stream" : "without SLUICE_TORCH_CUDA_PATH=stream") +
                      ", rank " + std::to_string(j) + " " + (theirs == "stream" ? "with" : "without") +
                      " it: set it alike on every rank of a host");
    }
    stream_peers.push_back(j);
  }
  if (cuda_path == "stream" && !stream_peers.empty())
    stream_p2p_ = std::make_unique<StreamP2pLink>(store, rank, stream_peers, timeout);
  trace_ = Trace::from_env(rank);
  mailbox_ = std::make_unique<Mailbox>(*engine_, std::move(peers), std::move(data), rank, timeout, rndv_bytes,
                                       max_unexpected_bytes, std::move(dev), inline_bytes,
                                       recv_ready != 0, caller_runs != 0, quiet_acks != 0, trace_.get(),
                                       std::chrono::microseconds(spin_us));
  if (size > 1) {
    try {
      ll_ = std::make_unique<LowLatencyAllGather>(store, rank, size, ll_bytes, ll_off,
                                                  /*publish=*/has_nvlink && size <= LowLatencyAllGather::kMaxWorld,
                                                  std::chrono::steady_clock::now() + timeout);
    } catch (...) {
      mailbox_->close();  // no destructor runs for a constructor that throws
      engine_->close();
      throw;
    }
  }
  worker_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-torch");
    worker();
  });
}

SluiceBackend::~SluiceBackend() { shutdown(); }

std::string SluiceBackend::transport() const { return transport_; }
std::string SluiceBackend::cuda_path() const { return cuda_path_; }
std::string SluiceBackend::stream_p2p_state() const {
  return stream_p2p_ ? stream_p2p_->state() : "off (SLUICE_TORCH_CUDA_PATH is not 'stream', or no peer shares this host's GPUs)";
}
uint64_t SluiceBackend::stream_p2p_calls() const { return stream_p2p_ ? stream_p2p_->calls() : 0; }
uint64_t SluiceBackend::ll_allgather_calls() const { return ll_ ? ll_->calls() : 0; }
std::string SluiceBackend::ll_allgather_state() const {
  return ll_ ? ll_->state() : "off: a group of one rank";
}

void sync_current_stream(const at::Tensor& t) {
  const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream s = g->getStream(t.device());
  // An idle stream (the common case: the tensor was made a while ago) answers a query without
  // the synchronize's wait setup.
  if (g->queryStream(s)) return;
  g->synchronizeStream(s);
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::send_stream(const at::Tensor& t, int dst, int tag) {
  if (!stream_p2p_ || !t.is_cuda() || t.layout() != at::kStrided || !stream_p2p_->reaches(dst)) return {};
  c10::DeviceGuard guard(t.device());
  const LlStream ls = ll_stream(t.device());
  at::Tensor buf = t.contiguous();  // a copy on the current stream, if needed
  auto q = stream_p2p_->send(buf, dst, uint32_t(tag), ls.stream, ls.capturing);
  return c10::make_intrusive<StreamWork>(c10d::OpType::SEND, std::vector<at::Tensor>{t}, q.stream,
                                         std::move(q.done), ls.capturing, getRank());
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::recv_stream(const at::Tensor& t, int src, int tag) {
  if (!stream_p2p_ || !t.is_cuda() || t.layout() != at::kStrided) return {};
  TORCH_CHECK(src != Mailbox::kAnySource, "sluice: rank ", getRank(),
              ": a CUDA recv from any source cannot take the stream path (SLUICE_TORCH_CUDA_PATH=stream): name the "
              "source rank");
  if (!stream_p2p_->reaches(src)) return {};
  c10::DeviceGuard guard(t.device());
  const LlStream ls = ll_stream(t.device());
  at::Tensor buf = t.is_contiguous() ? t : at::empty_like(t, at::MemoryFormat::Contiguous);
  at::Tensor out = t;
  auto q = stream_p2p_->recv(buf, src, uint32_t(tag), ls.stream, ls.capturing, [&] {
    if (!buf.is_same(out)) out.copy_(buf);
  });
  return c10::make_intrusive<StreamWork>(c10d::OpType::RECV, std::vector<at::Tensor>{t}, q.stream,
                                         std::move(q.done), ls.capturing, getRank());
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::send_device(const at::Tensor& t, int dst, int tag) {
  if (!cuda_regs_ || !t.is_cuda() || t.layout() != at::kStrided || dst < 0 || dst >= getSize() || dst == getRank() ||
      !mailbox_->has_device(dst) || t.nbytes() < mailbox_->rndv_bytes())
    return {};
  if (trace_) trace_->mark(TraceEv::kSendCall, dst);
  at::Tensor buf = t.contiguous();
  std::string why;
  auto lease = cuda_regs_->acquire(buf.data_ptr(), buf.nbytes(), &why);
  if (!lease) {
    SLUICE_LOG(kInfo, "sluice torch: a CUDA send goes through host memory: " << why);
    return {};
  }
  sync_current_stream(buf);
  if (trace_) trace_->mark(TraceEv::kSendSynced, dst);
  auto work = c10::make_intrusive<SluiceWork>(c10d::OpType::SEND, std::vector<at::Tensor>{t}, timeout_, getRank());
  work->set_peer("peer rank " + std::to_string(dst));
  work->set_trace(trace_.get(), dst);
  work->drive_with(mailbox_->progress());
  CudaRegistrations* regs = cuda_regs_.get();
  void* key = lease->key;
  try {
    mailbox_->send(dst, user_tag(tag), Mailbox::Buffer{buf.data_ptr(), buf.nbytes(), lease->handle, lease->offset, true},
                   [work, buf, regs, key](const Status& st, int, uint64_t) {
                     regs->release(key);
                     work->complete(st.ok() ? nullptr : backend_error("sluice: send failed: " + st.message));
                   });
  } catch (...) {
    regs->release(key);
    throw;
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::recv_device(const at::Tensor& t, int src, int tag) {
  if (!cuda_regs_ || !t.is_cuda() || t.layout() != at::kStrided || !t.is_contiguous() || src < 0 ||
      src >= getSize() || src == getRank() || !mailbox_->has_device(src) || t.nbytes() < mailbox_->rndv_bytes())
    return {};
  if (trace_) trace_->mark(TraceEv::kRecvCall, src);
  std::string why;
  auto lease = cuda_regs_->acquire(t.data_ptr(), t.nbytes(), &why);
  if (!lease) {
    SLUICE_LOG(kInfo, "sluice torch: a CUDA recv goes through host memory: " << why);
    return {};
  }
  // Work the caller queued on the tensor (an earlier kernel reading it) ends before the
  // engine writes into it.
  sync_current_stream(t);
  if (trace_) trace_->mark(TraceEv::kRecvSynced, src);
  auto work = c10::make_intrusive<SluiceWork>(c10d::OpType::RECV, std::vector<at::Tensor>{t}, timeout_, getRank());
  work->set_peer("peer rank " + std::to_string(src));
  work->set_trace(trace_.get(), src);
  work->drive_with(mailbox_->progress());
  CudaRegistrations* regs = cuda_regs_.get();
  void* key = lease->key;
  try {
    mailbox_->recv(src, user_tag(tag), Mailbox::Buffer{t.data_ptr(), t.nbytes(), lease->handle, lease->offset, true},
                   [work, t, regs, key](const Status& st, int peer, uint64_t) {
                     regs->release(key);
                     work->complete(st.ok() ? nullptr : backend_error("sluice: recv failed: " + st.message), peer);
                   });
  } catch (...) {
    regs->release(key);
    throw;
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::exchange_device(c10d::OpType type, const at::Tensor& in,
                                                               const at::Tensor& out,
                                                               const std::vector<DevMsg>& sends,
                                                               const std::vector<DevMsg>& recvs,
                                                               const std::function<void()>& local) {
  // What decides is shared by both ranks of every message (its size; the pair's device
  // endpoint, which both see alike), so a rank that stages instead still meets one that does
  // not: the mailbox moves CUDA memory to host memory and back over the device endpoint.
  if (!device_collectives_ || !cuda_regs_ || !in.is_cuda() || !out.is_cuda() || !in.is_contiguous() ||
      !out.is_contiguous() || in.device() != out.device() || !device_messages(sends) || !device_messages(recvs) ||
      !(moves_bytes(sends) || moves_bytes(recvs)))
    return {};
  std::string why;
  auto in_lease = cuda_regs_->acquire(in.data_ptr(), in.nbytes(), &why);
  if (!in_lease) {
    SLUICE_LOG(kInfo, "sluice torch: a CUDA collective goes through host memory: " << why);
    return {};
  }
  const bool same = in.data_ptr() == out.data_ptr() && in.nbytes() == out.nbytes();
  auto out_lease = same ? in_lease : cuda_regs_->acquire(out.data_ptr(), out.nbytes(), &why);
  if (!out_lease) {
    cuda_regs_->release(in_lease->key);
    SLUICE_LOG(kInfo, "sluice torch: a CUDA collective goes through host memory: " << why);
    return {};
  }
  // This rank's own part moves on the caller's stream; then that stream is waited for: what
  // the caller queued before (the input written, earlier reads of the output) is done, and so
  // is that copy. The device send/recv wait the same way.
  if (local) local();
  sync_current_stream(out);
  auto* i8 = static_cast<uint8_t*>(in.data_ptr());
  auto* o8 = static_cast<uint8_t*>(out.data_ptr());
  std::vector<Xfer> xs;
  // An empty message still goes, as the host path's does (the peer may be on it).
  for (const DevMsg& m : sends)
    xs.push_back(m.bytes ? Xfer{true, m.peer, i8 + m.offset, m.bytes, true, in_lease->handle, in_lease->offset + m.offset}
                         : Xfer{true, m.peer, nullptr, 0});
  for (const DevMsg& m : recvs)
    xs.push_back(m.bytes ? Xfer{false, m.peer, o8 + m.offset, m.bytes, true, out_lease->handle, out_lease->offset + m.offset}
                         : Xfer{false, m.peer, nullptr, 0});
  CudaRegistrations* regs = cuda_regs_.get();
  void* in_key = in_lease->key;
  void* out_key = same ? nullptr : out_lease->key;
  // The leases end with the body, done or failed (a failed exchange closed what could still
  // touch the memory: exchange()).
  auto leases = std::shared_ptr<void>(nullptr, [regs, in_key, out_key](void*) {
    regs->release(in_key);
    if (out_key) regs->release(out_key);
  });
  at::Tensor keep_in = in;  // `out` is kept as the Work's result
  auto work = enqueue(type, {out}, [this, xs, keep_in, leases](uint64_t tag) { exchange(tag, xs); });
  device_calls_.fetch_add(1, std::memory_order_relaxed);
  return work;
}

bool SluiceBackend::device_messages(const std::vector<DevMsg>& msgs) const {
  for (const DevMsg& m : msgs)
    if (m.bytes != 0 && (m.bytes < mailbox_->rndv_bytes() || !mailbox_->has_device(m.peer))) return false;
  return true;
}

bool SluiceBackend::moves_bytes(const std::vector<DevMsg>& msgs) {
  for (const DevMsg& m : msgs)
    if (m.bytes != 0) return true;
  return false;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::allgather_device(const at::Tensor& output, const at::Tensor& input) {
  if (!device_collectives_ || !input.is_cuda() || !output.is_cuda() || input.layout() != at::kStrided ||
      output.layout() != at::kStrided || !output.is_contiguous() || output.scalar_type() != input.scalar_type() ||
      output.numel() != input.numel() * getSize())
    return {};
  const uint64_t part = input.nbytes();
  at::Tensor src = input.contiguous();
  std::vector<DevMsg> sends, recvs;
  for (int j = 0; j < getSize(); ++j) {
    if (j == getRank()) continue;
    sends.push_back({j, 0, part});
    recvs.push_back({j, uint64_t(j) * part, part});
  }
  return exchange_device(c10d::OpType::_ALLGATHER_BASE, src, output, sends, recvs, [&] {
    output.view(-1).narrow(0, input.numel() * getRank(), input.numel()).copy_(src.view(-1));
  });
}

void SluiceBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  if (mailbox_) mailbox_->set_timeout(timeout);
  if (stream_p2p_) stream_p2p_->set_timeout(timeout);
}

namespace {
// Shutting down waits for the worker and progress threads, whose callbacks may drop the last
// reference to a tensor made in Python, which takes the GIL. A Python thread that destroys
// the backend (destroy_process_group(), or its last reference dropped) holds the GIL: give it
// up for the wait.
struct WithoutGil {
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  ~WithoutGil() {
    if (saved) PyEval_RestoreThread(saved);
  }
};
}  // namespace

void SluiceBackend::shutdown() {
  WithoutGil nogil;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
    cv_.notify_all();
  }
  // Collectives already queued run to the end (each is bounded by the group timeout).
  if (worker_.joinable()) worker_.join();
  // This rank's stream-path kernels end before the goodbyes, so that once a peer has ours, no
  // kernel of either rank still writes into the other's regions (freed after them).
  if (stream_p2p_) stream_p2p_->quiesce();
  if (mailbox_) {
    say_goodbye();
    mailbox_->close();
  }
  cuda_regs_.reset();  // its registrations go before the engine does
  ll_.reset();         // waits for this rank's kernels (peers ran theirs: each needs all ranks)
  stream_p2p_.reset();
  if (engine_) engine_->close();
}

void SluiceBackend::abort() {
  if (ll_) ll_->abandon();
  if (stream_p2p_) stream_p2p_->abandon();
  shutdown();
}

void SluiceBackend::say_goodbye() {
  // A send completes when the peer acknowledges it; a peer that closed its endpoint right
  // after taking our last message (the end of a barrier, say) could lose that ack and fail
  // our send. So every rank trades an empty message with every peer before closing: when
  // ours is acknowledged and theirs has arrived, nothing is in flight either way. Bounded
  // and best effort: a dead peer fails it at once, a missing one costs at most the limit.
  struct Sync {
    std::mutex mu;
    std::condition_variable cv;
    size_t left = 0;
  };
  auto sync = std::make_shared<Sync>();
  auto done = [sync](const Status&, int, uint64_t) {
    std::lock_guard<std::mutex> lk(sync->mu);
    --sync->left;
    sync->cv.notify_all();
  };
  const uint64_t tag = ~uint64_t(0);  // outside the tags enqueue() hands out
  for (int j = 0; j < getSize(); ++j) {
    if (j == getRank()) continue;
    {
      std::lock_guard<std::mutex> lk(sync->mu);
      sync->left += 2;
    }
    try {
      mailbox_->send(j, tag, nullptr, 0, done);
    } catch (const std::exception&) {
      done({}, j, 0);
    }
    try {
      mailbox_->recv(j, tag, nullptr, 0, done);
    } catch (const std::exception&) {
      done({}, j, 0);
    }
  }
  const auto limit = std::min<std::chrono::milliseconds>(timeout_, env_ms("SLUICE_TORCH_GOODBYE_MS", std::chrono::milliseconds(10000)));
  std::unique_lock<std::mutex> lk(sync->mu);
  sync->cv.wait_for(lk, limit, [&] { return sync->left == 0; });
}

void SluiceBackend::worker() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();  // after stop_, jobs still run and fail fast on the closed mailbox
  }
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::enqueue(c10d::OpType type, std::vector<at::Tensor> outputs, Body body) {
  auto work = c10::make_intrusive<SluiceWork>(type, std::move(outputs), timeout_, getRank());
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!stop_, "sluice: rank ", getRank(), ": the process group was destroyed");
  const uint64_t tag = (uint64_t(1) << 63) | ((++seq_ & ((uint64_t(1) << 47) - 1)) << 16);
  queue_.push_back([this, work, body = std::move(body), tag, type] {
    try {
      body(tag);
      work->complete(nullptr);
    } catch (const std::exception& e) {
      work->complete(backend_error(std::string("sluice: ") + c10d::opTypeToString(type) + " failed: " + e.what()));
    }
  });
  cv_.notify_all();
  return work;
}

void SluiceBackend::exchange(uint64_t tag, const std::vector<Xfer>& xfers) {
  struct Sync {
    std::mutex mu;
    size_t left = 0;
    Status first;
    std::set<int> waiting;
  };
  auto sync = std::make_shared<Sync>();
  sync->left = xfers.size();
  for (auto& x : xfers) sync->waiting.insert(x.peer);
  auto done = [sync](const Status& st, int peer, uint64_t) {
    std::lock_guard<std::mutex> lk(sync->mu);
    if (!st.ok() && sync->first.ok()) sync->first = st;
    --sync->left;  // the queue wakes the driving thread (below) after the task that ran this
  };
  size_t posted = 0;
  try {
    for (auto& x : xfers) {
      if (x.device) {
        const Mailbox::Buffer b{x.ptr, x.n, x.handle, x.offset, true};
        if (x.is_send)
          mailbox_->send(x.peer, tag, b, done);
        else
          mailbox_->recv(x.peer, tag, b, done);
      } else if (x.is_send) {
        mailbox_->send(x.peer, tag, x.ptr, x.n, done);
      } else {
        mailbox_->recv(x.peer, tag, x.ptr, x.n, done);
      }
      ++posted;
    }
  } catch (...) {
    std::lock_guard<std::mutex> lk(sync->mu);
    sync->left -= xfers.size() - posted;
    if (sync->first.ok()) sync->first = {ErrorCode::kInvalidArgument, "could not post every transfer"};
  }
  // Recvs expire after the group timeout in the mailbox and sends through the engine's op
  // timeout, so this wait ends; the margin only guards against a bug leaving a buffer in use.
  // This thread runs the mailbox's tasks meanwhile (the step's completions wake it directly).
  const bool done_in_time = mailbox_->progress()->drive_until(
      [&] {
        std::lock_guard<std::mutex> g(sync->mu);
        return sync->left == 0;
      },
      std::chrono::steady_clock::now() + timeout_ * 2 + std::chrono::seconds(10));
  std::unique_lock<std::mutex> lk(sync->mu);
  if (!done_in_time) {
    lk.unlock();
    mailbox_->close();  // cancels everything, so no buffer of ours is written after we return
    throw Error(ErrorCode::kTimeout, "rank " + std::to_string(getRank()) + ": a collective step did not finish");
  }
  if (!sync->first.ok()) throw Error(sync->first);
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  TORCH_CHECK(tensors.size() == 1, "sluice: send takes exactly one tensor");
  if (any_cuda(tensors)) {
    if (auto w = send_stream(tensors[0], dst, tag)) return w;
    if (auto w = send_device(tensors[0], dst, tag)) return w;
    HostStaging s;
    auto host = s.inputs(tensors);
    return s.wrap(send(host, dst, tag), c10d::OpType::SEND, tensors, timeout_, getRank());
  }
  check_cpu(tensors[0], "send");
  TORCH_CHECK(dst >= 0 && dst < getSize() && dst != getRank(), "sluice: rank ", getRank(), ": invalid destination rank ",
              dst, " (group size ", getSize(), ")");
  if (trace_) trace_->mark(TraceEv::kSendCall, dst);
  at::Tensor buf = tensors[0].contiguous();
  auto work = c10::make_intrusive<SluiceWork>(c10d::OpType::SEND, tensors, timeout_, getRank());
  work->set_peer("peer rank " + std::to_string(dst));
  work->set_trace(trace_.get(), dst);
  work->drive_with(mailbox_->progress());
  mailbox_->send(dst, user_tag(tag), buf.data_ptr(), buf.nbytes(), [work, buf](const Status& st, int peer, uint64_t) {
    work->complete(st.ok() ? nullptr : backend_error("sluice: send failed: " + st.message));
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  TORCH_CHECK(tensors.size() == 1, "sluice: recv takes exactly one tensor");
  if (any_cuda(tensors)) {
    if (auto w = recv_stream(tensors[0], src, tag)) return w;
    if (auto w = recv_device(tensors[0], src, tag)) return w;
    HostStaging s;
    auto host = s.outputs(tensors);
    return s.wrap(recv(host, src, tag), src == Mailbox::kAnySource ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV,
                  tensors, timeout_, getRank(), /*recv=*/true);
  }
  check_cpu(tensors[0], "recv");
  TORCH_CHECK(src == Mailbox::kAnySource || (src >= 0 && src < getSize() && src != getRank()), "sluice: rank ",
              getRank(), ": invalid source rank ", src, " (group size ", getSize(), ")");
  if (trace_) trace_->mark(TraceEv::kRecvCall, src);
  at::Tensor out = tensors[0];
  at::Tensor buf = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  auto work = c10::make_intrusive<SluiceWork>(
      src == Mailbox::kAnySource ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensors, timeout_, getRank());
  work->set_peer(src == Mailbox::kAnySource ? "any peer rank" : "peer rank " + std::to_string(src));
  work->set_trace(trace_.get(), src);
  work->drive_with(mailbox_->progress());
  mailbox_->recv(src, user_tag(tag), buf.data_ptr(), buf.nbytes(), [work, out, buf](const Status& st, int peer, uint64_t) mutable {
    if (!st.ok()) {
      work->complete(backend_error("sluice: recv failed: " + st.message), peer);
      return;
    }
    try {
      if (!buf.is_same(out)) out.copy_(buf);
      work->complete(nullptr, peer);
    } catch (const std::exception& e) {
      work->complete(backend_error(std::string("sluice: recv failed: ") + e.what()), peer);
    }
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> SluiceBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return recv(tensors, Mailbox::kAnySource, tag);
}

}  // namespace sluice::torch_backend
