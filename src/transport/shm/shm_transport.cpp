// shm: peers on the same host. Data moves in one copy: loads and stores through a mapping of
// the peer's engine-allocated (memfd) memory, else process_vm_readv. The peer is whoever the
// kernel says is at the other end of our Unix socket (same_host.hpp); see shm_endpoint.hpp for
// who copies what, and docs/security.md for the trust model.
#include <unistd.h>

#include <cstring>
#include <mutex>
#include <random>
#include <unordered_map>
#include <unordered_set>

#include "core/log.hpp"
#include "cuda/staging.hpp"
#include "transport/common/same_host.hpp"
#include "transport/shm/cma.hpp"
#include "transport/shm/shm_endpoint.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::shm {
namespace {

// A word the peer reads to prove that cross-process access works between us (its address is
// told only over the authenticated socket).
alignas(64) volatile uint64_t g_probe_word = 0;

std::string string_field(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

class ShmTransport final : public Transport, public Host {
 public:
  explicit ShmTransport(const EngineContext& ctx) : host_id_(ctx.host_id), engine_id_(ctx.engine_id), registry_(ctx.registry) {
    if (g_probe_word == 0) g_probe_word = std::random_device{}() | 1;
    service_.start("sluice-shm-" + engine_id_, [this](net::Socket& s, const same_host::PeerCred& c, const nlohmann::json& r,
                                                      int fd) { serve(s, c, r, fd); });
  }
  ~ShmTransport() override { service_.stop(); }

  std::string name() const override { return "shm"; }
  int priority() const override { return 20; }
  // cuda memory on this side is staged through pinned host buffers (CUDA builds with a GPU).
  bool supports(const Location& loc) const override { return loc.is_host() || staging::available(); }
  nlohmann::json local_address() const override { return {{"socket", service_.name()}}; }

  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    std::string name = string_field(peer.transports.at("shm"), "socket");
    if (name.empty()) {
      *why = "the peer's shm address names no same-host socket";
      return false;
    }
    if (name == service_.name()) {
      *why = "the peer's same-host socket is this engine's own";
      return false;
    }
    try {
      net::Socket s = same_host::connect(name);
      same_host::PeerCred cred = same_host::peer_cred(s.fd());
      same_host::send(s.fd(), {{"op", "probe"}});
      nlohmann::json r = same_host::recv(s.fd(), same_host::Clock::now() + std::chrono::seconds(2));
      uint64_t value = 0;
      int err = 0;
      if (!r["probe_addr"].is_number_unsigned() || !r["probe_value"].is_number_unsigned() ||
          !cma::probe(cred.pid, r["probe_addr"].get<uint64_t>(), &value, &err) || value != r["probe_value"].get<uint64_t>()) {
        *why = std::string("the kernel denies cross-process access (process_vm_readv: ") +
               (err ? std::strerror(err) : "wrong probe value") + ")";
        SLUICE_LOG(kInfo, "shm: " << *why << "; trying the next transport");
        return false;
      }
      return true;
    } catch (const Error& e) {
      *why = e.what();
      SLUICE_LOG(kInfo, "shm: " << *why << "; trying the next transport");
      return false;
    }
  }

  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto it = setup.peer.transports.find("shm");
    std::string name = it == setup.peer.transports.end() ? std::string() : string_field(it->second, "socket");
    if (name.empty()) throw Error(ErrorCode::kProtocol, "shm: the peer's info names no same-host socket");
    auto ep = std::make_shared<ShmEndpoint>(setup, *this, name);
    std::lock_guard<std::mutex> lk(mu_);
    (setup.active ? active_ : passive_)[setup.token] = ep;
    return ep;
  }

  // Host
  const Registry& registry() const override { return *registry_; }
  const std::string& engine_id() const override { return engine_id_; }
  int lease_fd() const override { return registry_->leases().ok() ? registry_->leases().memfd() : -1; }
  void forget(uint64_t token) override {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto* m : {&active_, &passive_}) {
      auto it = m->find(token);
      if (it != m->end() && it->second.expired()) m->erase(it);
    }
    // Drop other dead entries too (an endpoint that never closed, e.g. a refused handshake).
    for (auto* m : {&active_, &passive_}) std::erase_if(*m, [](auto& kv) { return kv.second.expired(); });
  }

 private:
  std::shared_ptr<ShmEndpoint> find(uint64_t token, bool passive) {
    std::lock_guard<std::mutex> lk(mu_);
    auto& m = passive ? passive_ : active_;
    auto it = m.find(token);
    return it == m.end() ? nullptr : it->second.lock();
  }

  // One request on our socket, from the process the kernel named in `cred`.
  void serve(net::Socket& sock, const same_host::PeerCred& cred, const nlohmann::json& req, int fd) {
    struct Guard {
      int fd;
      ~Guard() {
        if (fd >= 0) ::close(fd);
      }
    } guard{fd};
    std::string op = string_field(req, "op");
    if (op == "probe") {
      same_host::send(sock.fd(), {{"engine", engine_id_},
                                  {"probe_addr", reinterpret_cast<uint64_t>(&g_probe_word)},
                                  {"probe_value", static_cast<uint64_t>(g_probe_word)}});
      return;
    }
    auto token_it = req.find("token");
    if (token_it == req.end() || !token_it->is_number_unsigned())
      throw Error(ErrorCode::kProtocol, "same-host request without an unsigned 'token'");
    const uint64_t token = token_it->get<uint64_t>();
    if (op == "auth") {
      // The token of one of our own active endpoints means the connection loops back into this
      // engine (a peer's info named our own socket): never serve ourselves as a peer.
      if (find(token, /*passive=*/false)) throw Error(ErrorCode::kProtocol, "the connection loops back into this engine");
      auto ep = find(token, /*passive=*/true);
      if (!ep) throw Error(ErrorCode::kProtocol, "no endpoint is waiting for this token");
      ep->authenticate(sock, cred, std::exchange(guard.fd, -1));
      return;
    }
    if (op == "describe") {
      auto to_passive = req.find("to_passive");
      auto region = req.find("region");
      if (to_passive == req.end() || !to_passive->is_boolean() || region == req.end() || !region->is_number_unsigned())
        throw Error(ErrorCode::kProtocol, "describe needs a boolean 'to_passive' and an unsigned 'region'");
      auto ep = find(token, to_passive->get<bool>());
      if (!ep) throw Error(ErrorCode::kProtocol, "no endpoint for this token");
      int mfd = -1;
      nlohmann::json d;
      try {
        d = ep->describe_local(region->get<uint64_t>(), cred, &mfd);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kProtocol) throw;
        same_host::send(sock.fd(), {{"error", e.what()}});
        return;
      }
      Guard mguard{mfd};
      same_host::send(sock.fd(), d, mfd);
      return;
    }
    throw Error(ErrorCode::kProtocol, "unknown same-host request '" + op + "'");
  }

  std::string host_id_;
  std::string engine_id_;
  const Registry* registry_;
  same_host::Service service_;
  std::mutex mu_;
  std::unordered_map<uint64_t, std::weak_ptr<ShmEndpoint>> active_, passive_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(shm, "shm", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  try {
    return std::make_unique<ShmTransport>(ctx);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
});

}  // namespace sluice::detail::shm
