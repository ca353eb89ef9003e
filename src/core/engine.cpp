#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

#include "bootstrap/messages.hpp"
#include "core/device_hooks.hpp"
#include "core/engine_impl.hpp"
#include "core/log.hpp"
#include "core/memfd.hpp"
#include "core/params.hpp"
#include "directory/directory_url.hpp"
#include "sluice/version.hpp"
#include "core/thread_name.hpp"

namespace sluice::detail {
namespace {

// Engine ids and endpoint tokens come from the kernel's generator: a token is what ties a
// same-host peer's proof to its hello, so it must not be predictable from published engine
// ids, and a forked child must not repeat its parent's sequence (a user-space generator
// copied by fork() does).
uint64_t random_u64() {
  uint64_t v = 0;
  while (v == 0)
    if (::getrandom(&v, sizeof(v), 0) != static_cast<ssize_t>(sizeof(v))) v = 0;
  return v;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string default_host_id() {
  // boot_id changes per boot and per VM; together with the hostname it tells whether two
  // engines share a kernel (which shm needs). The shm transport still probes access.
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  return std::string(host) + "/" + boot;
}

using bootstrap::MsgKind;
using nlohmann::json;

}  // namespace

EngineImpl::EngineImpl(EngineConfig config)
    : config_(EngineConfig::from_env(std::move(config))), directory_(make_directory(config_)) {
  log::set_level(config_.log_level);
  log_params(config_);
  registry_.set_lease_timeout(config_.op_timeout);
  // Pins are released when operations complete, which per-op deadlines bound by op_timeout;
  // the margin covers the watchdog period and the transport's close.
  registry_.set_pin_timeout(config_.op_timeout + std::chrono::milliseconds(5000));
  if (config_.channels < 1 || config_.channels > 64)
    throw Error(ErrorCode::kInvalidArgument, "channels must be 1..64, got " + std::to_string(config_.channels));
  engine_id_ = hex(random_u64());
  host_id_ = config_.host_id.empty() ? default_host_id() : config_.host_id;

  EngineContext ctx{&config_, &registry_, host_id_, engine_id_};
  std::vector<std::string> known;
  for (const auto& f : transport_factories()) known.push_back(f.name);
  for (const auto& want : config_.transports) {
    if (std::find(known.begin(), known.end(), want) == known.end()) {
      std::string list;
      for (auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw Error(ErrorCode::kInvalidArgument, "unknown transport '" + want + "' (built in: " + list + ")");
    }
  }
  std::string unavailable;
  for (const auto& f : transport_factories()) {
    if (!config_.transports.empty() &&
        std::find(config_.transports.begin(), config_.transports.end(), f.name) == config_.transports.end())
      continue;
    std::string why;
    auto t = f.make(ctx, &why);
    if (t) {
      transports_.push_back(std::move(t));
    } else {
      SLUICE_LOG(kInfo, "transport " << f.name << " unavailable: " << why);
      unavailable += "; " + f.name + ": " + why;
    }
  }
  if (transports_.empty())
    throw Error(ErrorCode::kNoDevice, "no transport can run on this host" + unavailable);
  std::stable_sort(transports_.begin(), transports_.end(),
                   [](const auto& a, const auto& b) { return a->priority() > b->priority(); });
}

EngineImpl::~EngineImpl() { close(); }

void EngineImpl::start() {
  listener_.start(config_.listen_host, config_.listen_port, [this](net::Socket s) { handle_connection(std::move(s)); },
                  config_.max_handshakes, config_.connect_timeout);
  watchdog_ = std::thread([this] {
    ::sluice::detail::name_this_thread("sluice-watchdog");
    watchdog();
  });
  publish();
  if (directory()->watch_period().count() > 0) name_watch_ = std::thread([this] {
      ::sluice::detail::name_this_thread("sluice-names");
      watch_names();
    });
  SLUICE_LOG(kInfo, "engine " << engine_id_ << " listening on " << listen_address());
}

std::shared_ptr<PeerDirectory> EngineImpl::directory() const {
  std::lock_guard<std::mutex> lk(dir_mu_);
  return directory_;
}

void EngineImpl::use_directory(std::shared_ptr<PeerDirectory> dir) {
  if (!dir) throw Error(ErrorCode::kInvalidArgument, "use_directory: no directory");
  {
    std::lock_guard<std::mutex> lk(dir_mu_);
    directory_ = std::move(dir);
  }
  publish();
}

void EngineImpl::publish() {
  auto dir = directory();
  if (!dir->wants_updates()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
  }
  dir->publish(info());
}

EngineInfo EngineImpl::lookup_peer(const std::string& ref, std::chrono::milliseconds timeout) {
  return directory()->lookup(ref, PeerDirectory::Clock::now() + timeout);
}

std::string EngineImpl::peer_ref(const EngineInfo& peer) const { return directory()->ref_for(peer); }

void EngineImpl::close() {
  std::vector<std::shared_ptr<EndpointImpl>> eps;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    cv_.notify_all();
  }
  directory()->withdraw(engine_id_);
  listener_.stop();
  if (watchdog_.joinable()) watchdog_.join();
  if (name_watch_.joinable()) name_watch_.join();
  {
    std::lock_guard<std::mutex> lk(mu_);
    eps.swap(endpoints_);
    for (auto& [t, p] : passive_) eps.push_back(p.ep);
    passive_.clear();
    accept_queue_.clear();
  }
  for (auto& ep : eps) ep->close({ErrorCode::kCancelled, "engine closed"});
  for (auto& e : registry_.entries()) {
    if (!e->owned) continue;
    try {
      withdraw_region(e->id);
    } catch (const Error& err) {
      // Still in use (remove() timed out): freeing it now could let a late copy land in
      // memory reused for something else, so it is leaked instead.
      if (err.code() == ErrorCode::kTimeout) {
        SLUICE_LOG(kWarn, "engine close: " << err.what() << "; its memory is not freed");
        continue;
      }
    }
    release_owned(*e);
  }
}

void EngineImpl::release_owned(const RegionEntry& e) {
  if (!e.location.is_host()) {
    if (auto* hooks = device_memory_hooks()) hooks->free(e.base);
    return;
  }
  ::munmap(e.base, e.length);
  if (e.memfd >= 0) ::close(e.memfd);
}

EngineInfo EngineImpl::info() const {
  EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = engine_id_;
  e.name = config_.name;
  e.host_id = host_id_;
  e.listen_host = config_.listen_host.empty() || config_.listen_host == "0.0.0.0" ? "127.0.0.1" : config_.listen_host;
  e.listen_port = listener_.port();
  for (const auto& t : transports_) e.transports[t->name()] = t->local_address();
  {
    std::lock_guard<std::mutex> lk(regions_mu_);
    for (const auto& r : registry_.entries()) {
      auto d = region_data_.find(r->id);
      if (d != region_data_.end()) e.regions.push_back({r->info(), d->second});
    }
  }
  std::sort(e.regions.begin(), e.regions.end(), [](auto& a, auto& b) { return a.info.id < b.info.id; });
  return e;
}

std::string EngineImpl::listen_address() const { return info().listen_address(); }

std::vector<std::string> EngineImpl::transport_names() const {
  std::vector<std::string> out;
  for (const auto& t : transports_) out.push_back(t->name());
  return out;
}

MemoryHandle EngineImpl::register_memory(void* ptr, uint64_t length, Location location, const std::string& name) {
  if (!location.is_host()) {
    // Without device support nothing could move this memory; accepting it would publish a
    // region no transport can serve.
    auto* hooks = device_memory_hooks();
    if (!hooks)
      throw Error(ErrorCode::kUnsupported,
                  "register_memory: " + location.to_string() + " memory needs the CUDA build (no device support here)");
    if (ptr && length) hooks->check(ptr, length, location.device);
  }
  return announce(registry_.add(ptr, length, location, name));
}

MemoryHandle EngineImpl::announce(MemoryHandle h) {
  std::map<std::string, json> data;
  auto e = registry_.find(h.id);
  if (!e) throw Error(ErrorCode::kUnknownHandle, "region " + std::to_string(h.id) + " was unregistered while registering");
  try {
    for (const auto& t : transports_) {
      json d = t->region_added(*e);
      if (!d.is_null()) data[t->name()] = std::move(d);
    }
  } catch (...) {
    // Nobody learned of the region: undo what the transports did and the registration.
    registry_.remove(h.id);
    for (const auto& t : transports_) t->region_removed(*e);
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(regions_mu_);
    region_data_[h.id] = std::move(data);
  }
  publish();
  return h;
}

std::shared_ptr<RegionEntry> EngineImpl::withdraw_region(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(regions_mu_);
    region_data_.erase(id);
  }
  publish();
  // Throws kUnknownHandle, or kTimeout when pins outlive pin_timeout: then the transports
  // keep the region reachable (the memory is still in use and is not freed either).
  auto e = registry_.remove(id);
  for (const auto& t : transports_) t->region_removed(*e);
  return e;
}

void EngineImpl::unregister_memory(MemoryHandle h) {
  auto e = registry_.find(h.id);
  if (e && e->owned)
    throw Error(ErrorCode::kInvalidArgument, "region " + std::to_string(h.id) + " was allocated by the engine: use free()");
  withdraw_region(h.id);
}

Allocation EngineImpl::allocate(uint64_t length, Location location, const std::string& name) {
  if (length == 0) throw Error(ErrorCode::kInvalidArgument, "allocate: zero length");
  if (!location.is_host()) {
    auto* hooks = device_memory_hooks();
    if (!hooks) throw Error(ErrorCode::kUnsupported, "allocate: " + location.to_string() + " memory needs the CUDA build");
    uint64_t size = 0;
    void* p = hooks->allocate(length, location.device, &size);
    try {
      auto h = announce(registry_.add(p, size, location, name, -1, /*owned=*/true));
      return {h, p, size};
    } catch (...) {
      hooks->free(p);
      throw;
    }
  }
  long page = ::sysconf(_SC_PAGESIZE);
  uint64_t size = (length + page - 1) / page * page;
  int fd = sealed_memfd("sluice", size);  // sealed: peers map it (core/memfd.hpp)
  if (fd < 0)
    throw Error(ErrorCode::kSystem, "memfd of " + std::to_string(size) + " bytes (create, size, seal): " + net::errno_text(errno));
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    throw Error(ErrorCode::kSystem, "mmap(" + std::to_string(size) + "): " + net::errno_text(err));
  }
  try {
    auto h = announce(registry_.add(p, size, location, name, fd, /*owned=*/true));
    return {h, p, size, fd};
  } catch (...) {
    ::munmap(p, size);
    ::close(fd);
    throw;
  }
}

void EngineImpl::free(const Allocation& a) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;  // close() already released every engine allocation
  }
  auto e = registry_.find(a.handle.id);
  if (!e || !e->owned || e->base != a.ptr)
    throw Error(ErrorCode::kUnknownHandle, "free: handle " + std::to_string(a.handle.id) + " is not an engine allocation");
  withdraw_region(a.handle.id);
  release_owned(*e);
}

Transport* EngineImpl::find_transport(const std::string& name) const {
  for (const auto& t : transports_)
    if (t->name() == name) return t.get();
  return nullptr;
}

Transport* EngineImpl::choose_transport(const EngineInfo& peer, const std::string& forced,
                                        const std::vector<std::string>& avoid) {
  std::string why_not;
  for (const auto& t : transports_) {
    if (!forced.empty() && t->name() != forced) continue;
    if (forced.empty() && std::find(avoid.begin(), avoid.end(), t->name()) != avoid.end()) {
      why_not += "; " + t->name() + ": avoided for this endpoint";
      continue;
    }
    if (!peer.transports.count(t->name())) {
      why_not += "; " + t->name() + ": the peer does not run it";
      continue;
    }
    std::string why;
    if (t->can_reach(peer, &why)) return t.get();
    why_not += "; " + t->name() + ": " + why;
    if (forced.empty()) SLUICE_LOG(kInfo, "transport " << t->name() << " cannot reach peer: " << why << "; trying the next");
  }
  if (!forced.empty() && !find_transport(forced))
    throw Error(ErrorCode::kUnsupported, "transport '" + forced + "' is not running in this engine");
  throw Error(ErrorCode::kUnsupported, "no common transport reaches peer " + peer.engine_id + why_not);
}

EngineImpl::Exchange EngineImpl::open_exchange(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  // One absolute deadline for the whole exchange (connect, request, reply): a peer that
  // trickles its reply cannot stretch it the way a per-recv() timeout could be.
  Exchange x;
  x.deadline = bootstrap::Clock::now() + timeout;
  x.sock = net::connect_tcp(host, port, timeout);
  return x;
}

std::shared_ptr<EndpointImpl> EngineImpl::connect(const std::string& target, const ConnectOptions& options,
                                                  std::shared_ptr<EndpointCounters> counters) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw Error(ErrorCode::kClosed, "connect: engine is closed");
  }
  auto timeout = options.timeout.value_or(config_.connect_timeout);
  EngineInfo peer;
  std::string ref;  // what refresh_remote_regions() asks the directory for
  auto first = target.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && target[first] == '{') {
    try {
      peer = EngineInfo::parse(target);
    } catch (const Error& e) {
      throw Error(ErrorCode::kInvalidArgument, std::string("connect: not a valid engine info blob: ") + e.what());
    }
    ref = peer_ref(peer);
  } else {
    // The directory's answer names the listener to dial: for the default one, the
    // "host:port" the user gave (never the address a peer's INFO reply claims: it could name
    // a third party, and we would send it our full info).
    peer = lookup_peer(target, timeout);
    ref = target;
  }
  // Hello and channels go to that listener.
  const std::string host = peer.listen_host;
  const uint16_t port = peer.listen_port;
  if (peer.engine_id == engine_id_)
    SLUICE_LOG(kDebug, "connecting to our own engine " << engine_id_ << " (loopback endpoint)");
  Transport* t = choose_transport(peer, options.transport, options.avoid);
  const uint64_t token = random_u64();
  const int channels = config_.channels;
  auto ep = std::make_shared<EndpointImpl>(shared_from_this(), t, peer, token, channels, std::move(counters));
  ep->set_peer_ref(ref);
  if (options.reconnect) ep->enable_reconnect(options);
  EndpointSetup setup{true, token, channels, peer, ep.get(), config_};
  ep->set_transport(t->create_endpoint(setup));

  // Captures by value: a transport keeps it to dial replacement channels later (tcp's
  // channel failover), from its own thread, possibly after this engine began closing.
  auto opener = [host, port, token, timeout, name = t->name()](int index, const json& hello) {
    Exchange x;
    x.deadline = bootstrap::Clock::now() + timeout;
    x.sock = net::connect_tcp(host, port, timeout);
    // The transport's own socket I/O after the attach uses the socket's timeout.
    net::set_io_timeout(x.sock.fd(), timeout);
    json body = hello;
    body["token"] = token;
    body["index"] = index;
    body["transport"] = name;
    bootstrap::send_msg(x.sock.fd(), MsgKind::kChannel, body, x.deadline);
    json reply = bootstrap::expect_reply(x.sock.fd(), "channel attach", x.deadline);
    return std::make_pair(std::move(x.sock), std::move(reply));
  };
  try {
    {
      Exchange x = open_exchange(host, port, timeout);
      bootstrap::send_msg(
          x.sock.fd(), MsgKind::kHello,
          {{"info", info().to_json()}, {"token", token}, {"transport", t->name()}, {"channels", channels}}, x.deadline);
      json reply = bootstrap::expect_reply(x.sock.fd(), "hello", x.deadline);
      EngineInfo replied = EngineInfo::from_json(bootstrap::require_object(reply, "info", "hello reply"));
      if (replied.engine_id != peer.engine_id)
        throw Error(ErrorCode::kProtocol, "hello reply comes from engine '" + replied.engine_id + "', expected '" +
                                              peer.engine_id + "' at " + host + ":" + std::to_string(port));
      ep->set_peer(std::move(replied));
    }
    ep->transport().connect(opener);
  } catch (...) {
    ep->close({ErrorCode::kCancelled, "connect failed"});
    throw;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) {
    ep->close({ErrorCode::kCancelled, "engine closed"});
    throw Error(ErrorCode::kClosed, "connect: engine closed while connecting");
  }
  endpoints_.push_back(ep);
  SLUICE_LOG(kInfo, "connected to " << peer.engine_id << " at " << host << ":" << port << " over " << t->name()
                                    << " with " << channels << " channel(s)");
  return ep;
}

std::shared_ptr<EndpointImpl> EngineImpl::accept(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return closed_ || !accept_queue_.empty(); });
  if (accept_queue_.empty()) return nullptr;
  auto ep = accept_queue_.front();
  accept_queue_.pop_front();
  return ep;
}

void EngineImpl::forget(EndpointImpl* ep) {
  std::lock_guard<std::mutex> lk(mu_);
  std::erase_if(endpoints_, [&](auto& e) { return e.get() == ep; });
  std::erase_if(accept_queue_, [&](auto& e) { return e.get() == ep; });
}

void EngineImpl::handle_connection(net::Socket sock) {
  listener_connections_.fetch_add(1);
  // The whole request must arrive before one deadline; the replies we send share it.
  auto deadline = bootstrap::Clock::now() + config_.connect_timeout;
  net::set_io_timeout(sock.fd(), config_.connect_timeout);
  std::pair<MsgKind, json> msg;
  try {
    bool silent = false;
    try {
      msg = bootstrap::recv_msg(sock.fd(), deadline, config_.max_handshake_bytes, &silent);
    } catch (const Error&) {
      // A connection closed before its first byte is a port probe or health check.
      if (silent) {
        SLUICE_LOG(kDebug, "listener: a connection closed without sending anything (port probe?)");
        return;
      }
      throw;
    }
  } catch (const Error& e) {
    refused("refused a connection", e.what());
    if (e.code() == ErrorCode::kProtocol) bootstrap::send_error(sock.fd(), static_cast<int>(e.code()), e.what());
    return;
  }
  try {
    switch (msg.first) {
      case MsgKind::kInfo:
        bootstrap::send_msg(sock.fd(), MsgKind::kReply, {{"info", info().to_json()}}, deadline);
        return;
      case MsgKind::kHello:
        handle_hello(sock, msg.second);
        return;
      case MsgKind::kChannel:
        handle_channel(sock, msg.second, deadline);
        return;
      default:
        throw Error(ErrorCode::kProtocol, "unexpected bootstrap message kind " + std::to_string(int(msg.first)));
    }
  } catch (const Error& e) {
    refused("refused a peer request", e.what());
    if (sock.valid()) bootstrap::send_error(sock.fd(), static_cast<int>(e.code()), e.what());
  } catch (const std::exception& e) {
    refused("refused a malformed peer request", e.what());
    if (sock.valid()) bootstrap::send_error(sock.fd(), static_cast<int>(ErrorCode::kProtocol), e.what());
  }
}

void EngineImpl::refused(const char* what, const std::string& why) {
  // Every refusal is worth a line, but a flood of hostile connections must not flood the log.
  uint64_t held = 0;
  if (refusal_log_.allow(&held))
    SLUICE_LOG(kWarn, "listener: " << what << ": " << why
                                   << (held ? " (" + std::to_string(held) + " more refusals since the last report)"
                                            : std::string()));
  else
    SLUICE_LOG(kDebug, "listener: " << what << ": " << why);
}

void EngineImpl::handle_hello(net::Socket& sock, const json& body) {
  using bootstrap::require_u64;
  EngineInfo peer = EngineInfo::from_json(bootstrap::require_object(body, "info", "hello"));
  uint64_t token = require_u64(body, "token", "hello");
  std::string name = bootstrap::require_string(body, "transport", "hello", 64);
  int channels = static_cast<int>(bootstrap::require_int(body, "channels", "hello", 1, 64));
  Transport* t = find_transport(name);
  if (!t) throw Error(ErrorCode::kUnsupported, "transport '" + name + "' is not running in engine " + engine_id_);
  {
    // Checked before the endpoint (and its transport resources) exist, and again below.
    std::lock_guard<std::mutex> lk(mu_);
    check_accept_room();
  }
  auto ep = std::make_shared<EndpointImpl>(shared_from_this(), t, peer, token, channels);
  EndpointSetup setup{false, token, channels, peer, ep.get(), config_};
  ep->set_transport(t->create_endpoint(setup));
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw Error(ErrorCode::kClosed, "engine is closing");
    if (passive_.count(token) ||
        std::any_of(endpoints_.begin(), endpoints_.end(), [&](auto& e) { return e->token() == token && e->accepted(); }))
      throw Error(ErrorCode::kProtocol, "hello: endpoint token reused");
    check_accept_room();
    passive_[token] = {ep, std::chrono::steady_clock::now()};
  }
  bootstrap::send_msg(sock.fd(), MsgKind::kReply, {{"info", info().to_json()}});
}

void EngineImpl::check_accept_room() const {
  // Half-open endpoints count too: each holds transport resources until it is accepted.
  size_t waiting = accept_queue_.size() + passive_.size();
  if (waiting >= static_cast<size_t>(std::max(config_.max_pending_accepts, 0)))
    throw Error(ErrorCode::kRemoteError, "too many endpoints waiting for accept() (" + std::to_string(waiting) +
                                             ", max_pending_accepts " +
                                             std::to_string(config_.max_pending_accepts) + ")");
}

void EngineImpl::handle_channel(net::Socket& sock, const json& body, bootstrap::Clock::time_point deadline) {
  uint64_t token = bootstrap::require_u64(body, "token", "channel attach");
  uint64_t index = bootstrap::require_u64(body, "index", "channel attach");
  // A replacement (tcp channel failover) names a live endpoint we accepted, by the token its
  // peer chose: 64 random bits that only the two engines know.
  const bool replace = body.is_object() && body.contains("replace") && body["replace"] == true;
  std::shared_ptr<EndpointImpl> ep;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (replace) {
      // Only an endpoint the peer dialed (its dialer replaces channels); handle_hello keeps
      // their tokens unique.
      for (auto& e : endpoints_)
        if (e->token() == token && e->accepted() && e->connected()) {
          if (ep) throw Error(ErrorCode::kProtocol, "channel replace: field 'token' names more than one endpoint");
          ep = e;
        }
    } else {
      auto it = passive_.find(token);
      if (it != passive_.end()) ep = it->second.ep;
    }
  }
  if (!ep && replace) throw Error(ErrorCode::kProtocol, "channel replace: field 'token' names no live endpoint");
  if (replace && !ep->transport().replaces_channels())
    throw Error(ErrorCode::kUnsupported, "channel replace: the endpoint's transport (" + ep->transport_name() +
                                             ") does not replace channels");
  if (!ep) throw Error(ErrorCode::kProtocol, "channel attach: field 'token' names no endpoint awaiting channels");
  if (index >= static_cast<uint64_t>(ep->channels()))
    throw Error(ErrorCode::kProtocol, "channel attach: field 'index' must be 0.." + std::to_string(ep->channels() - 1) +
                                          ", got " + std::to_string(index));
  // The transport decides and the engine answers: a refusal (attach() throws) goes back on
  // the socket from handle_connection(); the transport gets the socket only after its
  // reply has left, so nothing it starts on the socket can interleave with the reply.
  json reply = ep->transport().attach(static_cast<int>(index), body);
  bootstrap::send_msg(sock.fd(), MsgKind::kReply, reply, deadline);
  if (!ep->transport().adopt(static_cast<int>(index), std::move(sock))) return;
  if (replace) return;
  std::lock_guard<std::mutex> lk(mu_);
  passive_.erase(token);
  if (closed_) return;
  endpoints_.push_back(ep);
  accept_queue_.push_back(ep);
  cv_.notify_all();
  SLUICE_LOG(kInfo, "accepted an endpoint from " << ep->peer_engine_id() << " over " << ep->transport_name());
}

void EngineImpl::watchdog() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!closed_) {
    cv_.wait_for(lk, std::chrono::milliseconds(50));
    if (closed_) break;
    // A peer that said hello but never attached all its channels is dropped.
    std::vector<std::shared_ptr<EndpointImpl>> stale;
    auto now = std::chrono::steady_clock::now();
    for (auto it = passive_.begin(); it != passive_.end();) {
      if (now - it->second.since > 2 * config_.connect_timeout) {
        stale.push_back(it->second.ep);
        it = passive_.erase(it);
      } else {
        ++it;
      }
    }
    // Failed endpoints are not kept: those still waiting for accept() are closed and dropped
    // (a passive engine that never accepts would otherwise keep every closed peer's sockets),
    // and the engine lets go of those the user holds, so that they are released when the user
    // drops them, close() or not; they stay valid objects that report their failure.
    // Both are closed here, which releases their sockets and threads at once; closing is
    // idempotent and safe concurrently with the user's own close().
    std::vector<std::shared_ptr<EndpointImpl>> dead;
    std::erase_if(accept_queue_, [&](auto& e) {
      if (e->connected()) return false;
      dead.push_back(e);
      return true;
    });
    std::erase_if(endpoints_, [&](auto& e) {
      if (e->connected()) return false;
      dead.push_back(e);
      return true;
    });
    auto eps = endpoints_;
    lk.unlock();
    for (auto& ep : stale) {
      SLUICE_LOG(kWarn, "dropped a half-open endpoint from " << ep->peer_engine_id() << ": its channels never arrived");
      ep->close({ErrorCode::kTimeout, "channels never arrived"});
    }
    // close() keeps the endpoint's first failure as its status.
    for (auto& ep : dead) ep->close({ErrorCode::kPeerLost, "endpoint failed"});
    dead.clear();
    for (auto& ep : eps) ep->check_progress(config_.op_timeout);
    lk.lock();
  }
}

}  // namespace sluice::detail

namespace sluice {

Engine::Engine(EngineConfig config) : impl_(std::make_shared<detail::EngineImpl>(std::move(config))) { impl_->start(); }
Engine::~Engine() {
  if (impl_) impl_->close();
}
MemoryHandle Engine::register_memory(void* ptr, uint64_t length, Location location, const std::string& name) {
  return impl_->register_memory(ptr, length, location, name);
}
void Engine::unregister_memory(MemoryHandle handle) { impl_->unregister_memory(handle); }
Allocation Engine::allocate(uint64_t length, Location location, const std::string& name) {
  return impl_->allocate(length, location, name);
}
void Engine::free(const Allocation& allocation) { impl_->free(allocation); }
std::string Engine::local_info() const { return impl_->info().dump(); }
std::string Engine::region_descriptor(MemoryHandle handle) const {
  detail::EngineInfo e = impl_->info();
  for (const auto& r : e.regions)
    if (r.info.id == handle.id)
      return nlohmann::json{{"engine_id", e.engine_id}, {"region", detail::region_to_json(r)}}.dump();
  throw Error(ErrorCode::kUnknownHandle, "region_descriptor: no registered region " + std::to_string(handle.id));
}
std::string Engine::listen_address() const { return impl_->listen_address(); }
std::vector<std::string> Engine::transports() const { return impl_->transport_names(); }
Endpoint Engine::connect(const std::string& blob_or_address, const ConnectOptions& options) {
  return Endpoint(impl_->connect(blob_or_address, options));
}
std::optional<Endpoint> Engine::accept(std::chrono::milliseconds timeout) {
  auto ep = impl_->accept(timeout);
  if (!ep) return std::nullopt;
  return Endpoint(ep);
}
void Engine::close() { impl_->close(); }
const EngineConfig& Engine::config() const { return impl_->config(); }

}  // namespace sluice
