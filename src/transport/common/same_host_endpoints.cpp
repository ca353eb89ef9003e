#include "transport/common/same_host_endpoints.hpp"

#include <unistd.h>

#include "core/log.hpp"
#include "sluice/error.hpp"

namespace sluice::detail::same_host {
namespace {

std::string string_field(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

void Endpoints::start(const std::string& prefix, const std::string& engine_id, std::function<nlohmann::json()> probe) {
  engine_id_ = engine_id;
  probe_ = std::move(probe);
  service_.start(prefix + "-" + engine_id,
                 [this](net::Socket& s, const PeerCred& c, const nlohmann::json& r, int fd) { serve(s, c, r, fd); });
}

void Endpoints::add(uint64_t token, bool active, const std::shared_ptr<ProvenEndpoint>& ep) {
  std::lock_guard<std::mutex> lk(mu_);
  (active ? active_ : passive_)[token] = ep;
}

void Endpoints::forget() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto* m : {&active_, &passive_}) std::erase_if(*m, [](auto& kv) { return kv.second.expired(); });
}

std::shared_ptr<ProvenEndpoint> Endpoints::find(uint64_t token, bool passive) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& m = passive ? passive_ : active_;
  auto it = m.find(token);
  return it == m.end() ? nullptr : it->second.lock();
}

// One request from the process the kernel named in `cred`; a refusal is answered with its
// reason and code (unless an endpoint already took the socket).
void Endpoints::serve(net::Socket& sock, const PeerCred& cred, const nlohmann::json& req, int fd) {
  try {
    handle(sock, cred, req, fd);
  } catch (const Error& e) {
    SLUICE_LOG(kDebug, "same-host socket " << name() << ": refused a request: " << e.what());
    if (sock.valid()) {
      try {
        send(sock.fd(), {{"error", e.what()}, {"code", static_cast<int>(e.code())}});
      } catch (const Error&) {
      }
    }
  }
  if (fd >= 0) ::close(fd);
}

void Endpoints::handle(net::Socket& sock, const PeerCred& cred, const nlohmann::json& req, int& fd) {
  std::string op = string_field(req, "op");
  if (op == "probe") {
    nlohmann::json answer = probe_ ? probe_() : nlohmann::json::object();
    answer["engine"] = engine_id_;
    send(sock.fd(), answer);
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
    ep->authenticate(sock, cred, std::exchange(fd, -1), string_field(req, "engine"));
    return;
  }
  if (op == "describe") {
    auto to_passive = req.find("to_passive");
    auto region = req.find("region");
    if (to_passive == req.end() || !to_passive->is_boolean() || region == req.end() || !region->is_number_unsigned())
      throw Error(ErrorCode::kProtocol, "describe needs a boolean 'to_passive' and an unsigned 'region'");
    auto ep = find(token, to_passive->get<bool>());
    if (!ep) throw Error(ErrorCode::kProtocol, "no endpoint for this token");
    int xfd = -1;
    nlohmann::json d = ep->describe_local(region->get<uint64_t>(), cred, &xfd);
    struct Close {
      int fd;
      ~Close() {
        if (fd >= 0) ::close(fd);
      }
    } close_xfd{xfd};
    send(sock.fd(), d, xfd);
    return;
  }
  throw Error(ErrorCode::kProtocol, "unknown same-host request '" + op + "'");
}

}  // namespace sluice::detail::same_host
