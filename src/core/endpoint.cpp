#include <string>
#include <thread>

#include "core/engine_impl.hpp"
#include "core/log.hpp"
#include "core/params.hpp"

namespace sluice::detail {
EndpointImpl::EndpointImpl(std::shared_ptr<EngineImpl> engine, const Transport* kind, EngineInfo peer, uint64_t token,
                           int channels, std::shared_ptr<EndpointCounters> counters)
    : engine_(std::move(engine)),
      kind_(kind),
      transport_name_(kind->name()),
      token_(token),
      channels_(channels),
      matcher_(engine_->config().max_unexpected_bytes, engine_->config().max_unexpected_messages),
      counters_(counters ? std::move(counters) : std::make_shared<EndpointCounters>()) {
  set_peer(std::move(peer));
  // A waiter that polls saves a wake-up, but only where a spare core runs the progress
  // threads meanwhile: on a 2-core host it steals their CPU (measured here: 7.6 us round
  // trip without polling, 10-30 us with a 30 us poll).
  busy_wait_ = busy_wait_of(engine_->config());
}

EndpointImpl::~EndpointImpl() { close_transport({ErrorCode::kCancelled, "endpoint destroyed"}); }

void EndpointImpl::close_transport(const Status& why) {
  if (!transport_) return;
  std::unique_lock<std::mutex> lk(close_mu_);
  if (close_state_ == CloseState::kClosed) return;
  if (close_state_ == CloseState::kClosing) {
    // The closer itself (a callback of a future its close completes) and transport threads
    // (the closer may be joining them) return at once; everyone else waits.
    if (!tls_transport_thread && closer_ != std::this_thread::get_id())
      close_cv_.wait(lk, [&] { return close_state_ == CloseState::kClosed; });
    return;
  }
  close_state_ = CloseState::kClosing;
  closer_ = std::this_thread::get_id();
  lk.unlock();
  transport_->close(why);
  lk.lock();
  close_state_ = CloseState::kClosed;
  close_cv_.notify_all();
}

const Registry& EndpointImpl::registry() const { return engine_->registry(); }

void EndpointImpl::set_peer(EngineInfo peer) {
  if (transport_) transport_->peer_updated(peer);
  std::lock_guard<std::mutex> lk(peer_mu_);
  remote_.clear();
  remote_names_.clear();
  if (peer.engine_id != peer_.engine_id) imported_.clear();  // another engine: other regions
  for (const auto& r : peer.regions) {
    remote_[r.info.id] = r;
    // Names are unique per engine; a peer that repeats one gets its first region found.
    if (!r.info.name.empty()) remote_names_.emplace(r.info.name, r.info.id);
  }
  for (const auto& [id, r] : imported_) remote_.emplace(id, r);  // the peer's table wins
  peer_ = std::move(peer);
}

RemoteHandle EndpointImpl::import_region(const std::string& descriptor) {
  PeerRegion r;
  std::string owner;
  try {
    if (descriptor.size() > (64 << 10)) throw Error(ErrorCode::kProtocol, "longer than 64 KiB");
    nlohmann::json j = nlohmann::json::parse(descriptor);
    if (!j.is_object() || !j.contains("engine_id") || !j["engine_id"].is_string() || !j.contains("region"))
      throw Error(ErrorCode::kProtocol, "needs a string 'engine_id' and a 'region'");
    owner = j["engine_id"].get<std::string>();
    r = region_from_json(j["region"]);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kInvalidArgument, std::string("import_region: not a region descriptor: ") + e.what());
  }
  std::lock_guard<std::mutex> lk(peer_mu_);
  if (owner != peer_.engine_id)
    throw Error(ErrorCode::kInvalidArgument, "import_region: the descriptor is of engine " + owner +
                                                 ", this endpoint's peer is " + peer_.engine_id);
  imported_[r.info.id] = r;
  remote_[r.info.id] = r;
  return RemoteHandle{r.info.id};
}

std::string EndpointImpl::peer_engine_id() const {
  std::lock_guard<std::mutex> lk(peer_mu_);
  return peer_.engine_id;
}

void EndpointImpl::refresh(bool fail_if_moved) {
  std::string ref, engine_id;
  {
    std::lock_guard<std::mutex> lk(peer_mu_);
    ref = peer_ref_.empty() ? engine_->peer_ref(peer_) : peer_ref_;
    engine_id = peer_.engine_id;
  }
  EngineInfo fresh = engine_->lookup_peer(ref, engine_->config().connect_timeout);
  // The engine id is the incarnation: another one under the same name (or address) is a
  // restarted peer, not ours, and its regions and keys must never be mixed into this endpoint.
  if (!engine_id.empty() && fresh.engine_id != engine_id) {
    Status moved{ErrorCode::kPeerLost, "refresh: '" + ref + "' is now engine " + fresh.engine_id + ", not " +
                                           engine_id + " (the peer restarted or was replaced): connect again"};
    if (fail_if_moved) {
      on_failure(moved);
      close_transport(moved);
    }
    throw Error(moved.code, moved.message);
  }
  set_peer(std::move(fresh));
}

std::optional<RemoteHandle> EndpointImpl::remote_region(const std::string& name) const {
  std::lock_guard<std::mutex> lk(peer_mu_);
  auto it = remote_names_.find(name);
  if (it == remote_names_.end()) return std::nullopt;
  return RemoteHandle{it->second};
}

std::vector<RegionInfo> EndpointImpl::remote_regions() const {
  std::lock_guard<std::mutex> lk(peer_mu_);
  std::vector<RegionInfo> out;
  for (const auto& [id, r] : remote_) out.push_back(r.info);
  return out;
}

void EndpointImpl::check_usable() const {
  if (failed_code_.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lk(fail_mu_);
  throw Error(failure_.code, "endpoint to " + peer_engine_id() + " is unusable: " + failure_.message);
}

void EndpointImpl::check_options(const OpOptions& options, OpKind kind, const char* what) const {
  if (options.flags != 0)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(what) + ": unknown op flags " + std::to_string(options.flags) + " (none is defined)");
  if (!options.cuda_stream) return;
  // Decided by the capability, not by a driver or a device: a CPU-only build refuses a stream
  // on tcp exactly as a GPU build does.
  const bool message = kind == OpKind::kSend || kind == OpKind::kRecv;
  const Capabilities caps = kind_->capabilities();
  if (message ? caps.stream_ordered_messages : caps.stream_ordered) return;
  throw Error(ErrorCode::kUnsupported, std::string(what) + ": transport " + transport_name_ + " lacks the " +
                                           (message ? "stream_ordered_messages" : "stream_ordered") +
                                           " capability that an op with a cuda_stream needs");
}

RegionPin EndpointImpl::pin_local(MemoryHandle h, uint64_t offset, uint64_t length, const char* what, long index) const {
  Status st;
  RegionPin pin = engine_->registry().pin(h.id, offset, length, &st, "local");
  // Error text is built only on failure: this runs once per assignment of every transfer.
  auto where = [&] { return std::string(what) + (index >= 0 ? ": assignment " + std::to_string(index) : ""); };
  if (!pin) throw Error(st.code, where() + ": " + st.message);
  if (!kind_->supports(pin.get()->location))
    throw Error(ErrorCode::kUnsupported, where() + ": transport " + transport_name_ + " cannot move " +
                                             pin.get()->location.to_string() + " memory");
  return pin;
}

Future EndpointImpl::transfer(OpKind kind, const Batch& batch, uint32_t imm, const OpOptions& options) {
  const char* what = kind == OpKind::kRead ? "read" : kind == OpKind::kWrite ? "write" : "write_with_imm";
  if (batch.empty()) throw Error(ErrorCode::kEmptyBatch, std::string(what) + ": the batch has no assignments");
  if (options.flags != 0 || options.cuda_stream) check_options(options, kind, what);
  check_usable();
  auto op = std::make_shared<TransferOp>();
  op->kind = kind;
  op->imm = imm;
  op->options = options;
  // A one-assignment batch (the common small transfer) is planned from the stack.
  Piece single;
  std::vector<Piece> pieces;
  if (batch.size() > 1) pieces.reserve(batch.size());
  {
    std::lock_guard<std::mutex> lk(peer_mu_);
    for (size_t i = 0; i < batch.size(); ++i) {
      const Assignment& a = batch[i];
      auto where = [&] { return std::string(what) + ": assignment " + std::to_string(i); };
      if (a.length == 0) throw Error(ErrorCode::kInvalidArgument, where() + " has zero length");
      RegionPin pin = pin_local(a.local, a.local_offset, a.length, what, static_cast<long>(i));
      uint8_t* base = pin.get()->base;
      // One pin per run of assignments on the same region is enough to hold it.
      if (op->pins.empty() || op->pins.back().get() != pin.get()) op->pins.push_back(std::move(pin));
      auto it = remote_.find(a.remote.id);
      if (it == remote_.end())
        throw Error(ErrorCode::kUnknownHandle, where() + ": remote region handle " + std::to_string(a.remote.id) +
                                                   " is not advertised by peer " + peer_.engine_id +
                                                   " (call refresh_remote_regions() after the peer registers it)");
      const RegionInfo& r = it->second.info;
      if (!in_bounds(a.remote_offset, a.length, r.length))
        throw Error(ErrorCode::kOutOfRange, where() + ": remote region " + std::to_string(r.id) + ": offset " +
                                                std::to_string(a.remote_offset) + " + length " + std::to_string(a.length) +
                                                " exceeds its " + std::to_string(r.length) + " bytes");
      if (!kind_->supports(r.location))
        throw Error(ErrorCode::kUnsupported, where() + ": transport " + transport_name_ + " cannot reach the peer's " +
                                                 r.location.to_string() + " memory");
      Piece p{base + a.local_offset, r.id, a.remote_offset, r.addr + a.remote_offset, a.length};
      if (batch.size() == 1)
        single = p;
      else
        pieces.push_back(p);
      op->bytes += a.length;
    }
  }
  const auto& cfg = engine_->config();
  PlanOptions plan{channels_, cfg.chunk_size, cfg.stripe_threshold, std::min<uint64_t>(64 << 10, cfg.chunk_size),
                   rotate_.fetch_add(1, std::memory_order_relaxed)};
  op->lanes = plan_batch(batch.size() == 1 ? std::span<const Piece>(&single, 1) : std::span<const Piece>(pieces), plan);
  int parts = 0;
  for (auto& l : op->lanes) parts += l.pieces.empty() ? 0 : 1;
  op->future = std::make_shared<FutureState>(kind, parts);
  prepare(*op->future);
  op->future->set_bytes(op->bytes);
  Future f(op->future);
  transport_->submit(std::move(op));
  return f;
}

void EndpointImpl::check_post(const char* what) const {
  if (!kind_->capabilities().rma_post)
    throw Error(ErrorCode::kUnsupported,
                std::string(what) + ": transport " + transport_name_ + " lacks the rma_post capability (thin post path)");
  check_usable();
}

const RegionInfo& EndpointImpl::remote_locked(RemoteHandle remote, uint64_t offset, uint64_t length,
                                              const char* what) const {
  auto it = remote_.find(remote.id);
  if (it == remote_.end())
    throw Error(ErrorCode::kUnknownHandle, std::string(what) + ": remote region handle " + std::to_string(remote.id) +
                                               " is not advertised by peer " + peer_.engine_id);
  const RegionInfo& r = it->second.info;
  if (!in_bounds(offset, length, r.length))
    throw Error(ErrorCode::kOutOfRange, std::string(what) + ": remote region " + std::to_string(r.id) + ": offset " +
                                            std::to_string(offset) + " + length " + std::to_string(length) +
                                            " exceeds its " + std::to_string(r.length) + " bytes");
  if (!kind_->supports(r.location))
    throw Error(ErrorCode::kUnsupported, std::string(what) + ": transport " + transport_name_ +
                                             " cannot reach the peer's " + r.location.to_string() + " memory");
  return r;
}

PostWrite EndpointImpl::make_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote,
                                   uint64_t remote_offset, uint64_t length) {
  if (length == 0) throw Error(ErrorCode::kInvalidArgument, "post_write: zero length");
  PostWrite w;
  w.pin = pin_local(local, local_offset, length, "post_write", -1);
  w.src = w.pin.get()->base + local_offset;
  std::lock_guard<std::mutex> lk(peer_mu_);
  const RegionInfo& r = remote_locked(remote, remote_offset, length, "post_write");
  w.dst = Piece{const_cast<uint8_t*>(w.src), r.id, remote_offset, r.addr + remote_offset, length};
  return w;
}

PostSignal EndpointImpl::make_signal(RemoteHandle remote, uint64_t offset, uint64_t add) {
  if (offset % 8 != 0)
    throw Error(ErrorCode::kInvalidArgument, "post_signal: offset " + std::to_string(offset) + " is not 8-byte aligned");
  std::lock_guard<std::mutex> lk(peer_mu_);
  const RegionInfo& r = remote_locked(remote, offset, 8, "post_signal");
  return PostSignal{r.id, offset, r.addr + offset, add, r.location};
}

void EndpointImpl::post_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                              uint64_t length) {
  check_post("post_write");
  PostWrite w = make_write(local, local_offset, remote, remote_offset, length);
  std::lock_guard<std::mutex> lk(post_mu_);
  Status st = transport_->post_write(std::move(w), engine_->config().op_timeout);
  if (!st.ok()) throw Error(st.code, "post_write: " + st.message);
  counters_->posted(length);
}

void EndpointImpl::post_signal(RemoteHandle remote, uint64_t offset, uint64_t add) {
  check_post("post_signal");
  PostSignal s = make_signal(remote, offset, add);
  std::lock_guard<std::mutex> lk(post_mu_);
  Status st = transport_->post_signal(s, engine_->config().op_timeout);
  if (!st.ok()) throw Error(st.code, "post_signal: " + st.message);
  counters_->signalled();
}

PostBatchResult EndpointImpl::post_batch(std::span<const PostRequest> requests) {
  PostBatchResult res;
  if (requests.empty()) return res;
  auto what = [&](size_t i) { return requests[i].kind == PostRequest::Kind::kSignal ? "post_signal" : "post_write"; };
  // Built under post_mu_ (the posters' lock) so that the item vector is reused: no
  // allocation per batch in the steady state.
  std::lock_guard<std::mutex> lk(post_mu_);
  std::vector<PostItem>& items = batch_items_;
  items.clear();
  // The checks of the single calls, request by request: the requests before a bad one are
  // still posted, as they would have been one call at a time.
  Status bad;
  try {
    check_post(what(0));
    for (const PostRequest& r : requests) {
      PostItem it;
      if (r.kind == PostRequest::Kind::kSignal) {
        it.signal = true;
        it.sig = make_signal(r.remote, r.remote_offset, r.add);
      } else {
        it.write = make_write(r.local, r.local_offset, r.remote, r.remote_offset, r.length);
      }
      items.push_back(std::move(it));
    }
  } catch (const Error& e) {
    bad = e.status();
  }
  Status st;
  const size_t built = items.size();
  const size_t n = built ? transport_->post_batch(std::span<PostItem>(items.data(), built), engine_->config().op_timeout, &st) : 0;
  for (size_t i = 0; i < n; ++i) {
    if (items[i].signal)
      counters_->signalled();
    else
      counters_->posted(requests[i].length);
  }
  items.clear();  // unpins what was not posted
  res.posted = n;
  if (n < built)
    res.error = {st.code, std::string(what(n)) + ": " + st.message};
  else
    res.error = bad;
  return res;
}

void EndpointImpl::flush(std::chrono::milliseconds timeout) {
  if (!kind_->capabilities().rma_post)
    throw Error(ErrorCode::kUnsupported,
                "flush: transport " + transport_name_ + " lacks the rma_post capability (thin post path)");
  if (timeout.count() <= 0) timeout = engine_->config().op_timeout;
  check_usable();  // a failed endpoint says so even when nothing was left outstanding
  Status st = transport_->flush(timeout);
  if (!st.ok()) throw Error(st.code, "flush: " + st.message);
}

Future EndpointImpl::send(MemoryHandle h, uint64_t offset, uint64_t length, const OpOptions& options) {
  if (options.flags != 0 || options.cuda_stream) check_options(options, OpKind::kSend, "send");
  check_usable();
  auto op = std::make_shared<MessageOp>();
  op->options = options;
  op->pin = pin_local(h, offset, length, "send", -1);
  op->ptr = op->pin.get()->base + offset;
  op->length = length;
  op->future = std::make_shared<FutureState>(OpKind::kSend);
  prepare(*op->future);
  op->future->set_bytes(length);
  Future f(op->future);
  // The receiver matches by sequence number and requires them in order: number and hand
  // over together, or two threads sending at once reorder their messages on the wire.
  std::lock_guard<std::mutex> lk(send_mu_);
  op->seq = send_seq_.fetch_add(1, std::memory_order_relaxed);
  transport_->send(std::move(op));
  return f;
}

Future EndpointImpl::recv(MemoryHandle h, uint64_t offset, uint64_t length, const OpOptions& options) {
  if (options.flags != 0 || options.cuda_stream) check_options(options, OpKind::kRecv, "recv");
  check_usable();
  auto op = std::make_shared<MessageOp>();
  op->options = options;
  op->pin = pin_local(h, offset, length, "recv", -1);
  op->ptr = op->pin.get()->base + offset;
  op->length = length;
  op->future = std::make_shared<FutureState>(OpKind::kRecv);
  prepare(*op->future);
  Future f(op->future);
  matcher_.post_recv(std::move(op));
  return f;
}

Future EndpointImpl::imm_recv() {
  check_usable();
  auto f = matcher_.imm_recv();
  prepare(*f, /*count=*/false);  // may be complete already: the peer's imm came first
  return Future(std::move(f));
}

void EndpointImpl::prepare(FutureState& f, bool count) const {
  f.set_busy_wait(busy_wait_);
  f.set_progress(progress_);
  if (count) f.set_counters(counters_);
}

EndpointMetrics EndpointImpl::metrics() const {
  EndpointMetrics m;
  counters_->snapshot(m);
  m.endpoint = token_;
  m.peer_engine_id = peer_engine_id();
  m.transport = transport_name_;
  m.channels = channels_;
  m.connected = connected();
  if (transport_) {
    auto [replaced, retries] = transport_->failover_counts();
    m.channels_replaced = replaced;
    m.retries = retries;
  }
  return m;
}

void EndpointImpl::on_failure(const Status& why) {
  {
    std::lock_guard<std::mutex> lk(fail_mu_);
    if (failed_code_.load() != 0) return;
    failure_ = why;
    failed_code_.store(static_cast<int>(why.code) ? static_cast<int>(why.code) : 1, std::memory_order_release);
  }
  // A peer going away is routine (it may simply have exited); hostile or stuck peers are not.
  if (why.code == ErrorCode::kPeerLost || why.code == ErrorCode::kCancelled)
    SLUICE_LOG(kInfo, "endpoint to " << peer_engine_id() << " over " << transport_name_ << " closed: " << why.to_string());
  else
    SLUICE_LOG(kWarn, "endpoint to " << peer_engine_id() << " over " << transport_name_ << " failed: " << why.to_string());
  matcher_.fail_all(why);
}

void EndpointImpl::close(const Status& why) {
  // Everything pending fails with the endpoint's first failure: the watchdog may close an
  // endpoint concurrently with the user's own close(), which must still read as kCancelled.
  Status first;
  {
    std::lock_guard<std::mutex> lk(fail_mu_);
    if (failed_code_.load() == 0) {
      failure_ = why;
      failed_code_.store(static_cast<int>(why.code) ? static_cast<int>(why.code) : 1, std::memory_order_release);
    }
    first = failure_;
  }
  close_transport(first);
  matcher_.fail_all(first);
}

void EndpointImpl::check_progress(std::chrono::milliseconds timeout) {
  if (!transport_ || failed_code_.load(std::memory_order_acquire) != 0) return;
  const auto now = std::chrono::steady_clock::now();
  // A recv / imm_recv nothing matched for recv_timeout fails alone; the endpoint stays usable.
  const auto recv_timeout = engine_->config().recv_timeout;
  if (recv_timeout.count() > 0) matcher_.expire(now, recv_timeout);
  std::string what;
  if (transport_->expire_ops(now, timeout, &what) == 0) return;
  // The trigger is per operation, but an operation that timed out still fails the whole
  // endpoint: a peer that leaves one op unanswered for op_timeout is stuck or hostile, and
  // its stream (responses in order per channel) cannot be resynchronised anyway.
  // The transport's text says which operation and channel; the peer is named here, once for
  // every transport (issue 19: every timeout names the peer).
  Status why{ErrorCode::kTimeout, "endpoint to " + peer_engine_id() + " over " + transport_name_ + ": " + what};
  on_failure(why);
  close_transport(why);
}

}  // namespace sluice::detail

namespace sluice {

namespace {
detail::EndpointImpl& head(const std::shared_ptr<detail::EndpointImpl>& p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, "empty Endpoint (default-constructed)");
  return *p;
}
// The endpoint a call goes to (EndpointImpl::live): operations connect again after a
// reconnectable failure, queries only look.
struct Live {
  std::shared_ptr<detail::EndpointImpl> hold;
  detail::EndpointImpl* ep;
  Live(const std::shared_ptr<detail::EndpointImpl>& p, bool connect_again) : ep(&head(p).live(hold, connect_again)) {}
  detail::EndpointImpl* operator->() const { return ep; }
};
}  // namespace

Future Endpoint::read(const Batch& batch, const OpOptions& options) {
  return Live(impl_, true)->transfer(OpKind::kRead, batch, 0, options);
}
Future Endpoint::write(const Batch& batch, const OpOptions& options) {
  return Live(impl_, true)->transfer(OpKind::kWrite, batch, 0, options);
}
Future Endpoint::write_with_imm(const Batch& batch, uint32_t imm, const OpOptions& options) {
  return Live(impl_, true)->transfer(OpKind::kWriteImm, batch, imm, options);
}
Future Endpoint::send(MemoryHandle local, uint64_t offset, uint64_t length, const OpOptions& options) {
  return Live(impl_, true)->send(local, offset, length, options);
}
Future Endpoint::recv(MemoryHandle local, uint64_t offset, uint64_t length, const OpOptions& options) {
  return Live(impl_, true)->recv(local, offset, length, options);
}
Future Endpoint::imm_recv() { return Live(impl_, true)->imm_recv(); }
// The thin post path never connects again itself: a failure of earlier posts is reported by
// flush(), and a reconnection (by another operation) waits until flush() has reported it.
void Endpoint::post_write(MemoryHandle local, uint64_t local_offset, RemoteHandle remote, uint64_t remote_offset,
                          uint64_t length) {
  head(impl_).note_posts();
  Live(impl_, false)->post_write(local, local_offset, remote, remote_offset, length);
}
void Endpoint::post_signal(RemoteHandle remote, uint64_t offset, uint64_t add) {
  head(impl_).note_posts();
  Live(impl_, false)->post_signal(remote, offset, add);
}
PostBatchResult Endpoint::post_batch(std::span<const PostRequest> requests) {
  head(impl_).note_posts();
  return Live(impl_, false)->post_batch(requests);
}
void Endpoint::flush(std::chrono::milliseconds timeout) {
  Live live(impl_, false);
  try {
    live->flush(timeout);
  } catch (const Error&) {
    head(impl_).note_flushed();  // the failure was reported
    throw;
  }
  head(impl_).note_flushed();
}
std::optional<RemoteHandle> Endpoint::remote_region(const std::string& name) const {
  return Live(impl_, false)->remote_region(name);
}
std::vector<RegionInfo> Endpoint::remote_regions() const { return Live(impl_, false)->remote_regions(); }
RemoteHandle Endpoint::import_region(const std::string& descriptor) {
  return Live(impl_, false)->import_region(descriptor);
}
void Endpoint::refresh_remote_regions() {
  const bool reconnects = head(impl_).reconnects();
  try {
    Live(impl_, true)->refresh(reconnects);
  } catch (const Error& e) {
    // The target names a new engine, and the connection to the old one was failed with that
    // (refresh(true)): connect to the new one, whose regions then are the table.
    if (!reconnects || e.code() != ErrorCode::kPeerLost) throw;
    Live(impl_, true)->refresh();
  }
}
std::string Endpoint::transport() const { return Live(impl_, false)->transport_name(); }
Capabilities Endpoint::capabilities() const { return Live(impl_, false)->capabilities(); }
int Endpoint::channels() const { return Live(impl_, false)->channels(); }
std::string Endpoint::peer_engine_id() const { return Live(impl_, false)->peer_engine_id(); }
bool Endpoint::connected() const { return Live(impl_, false)->connected(); }
EndpointMetrics Endpoint::metrics() const { return Live(impl_, false)->metrics(); }
void Endpoint::close() { head(impl_).close_chain({ErrorCode::kCancelled, "endpoint closed"}); }

}  // namespace sluice

namespace sluice::detail {
void EndpointImpl::engine_forget() { engine_->forget(this); }
}  // namespace sluice::detail
