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
#include "core/params.hpp"
#include "cuda/staging.hpp"
#include "transport/common/same_host.hpp"
#include "transport/common/same_host_endpoints.hpp"
#include "transport/common/cma.hpp"
#include "transport/common/staging_endpoint.hpp"
#include "transport/shm/shm_endpoint.hpp"
#include "transport/shm/shm_test_stager.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::shm {
namespace {

// A word the peer reads to prove that cross-process access works between us (its address is
// told only over the authenticated socket).
alignas(64) volatile uint64_t g_probe_word = 0;

// Copies are memory-bandwidth bound: a few threads saturate what one host can move, and before
// the pool each endpoint had 2 copy workers (channels), so min(4, cores) keeps one peer's
// parallelism and bounds hundreds of peers' threads.
const Param<int> kCopyThreads{"shm.copy_threads", "SLUICE_SHM_COPY_THREADS", 0, int_in(0, 64),
                              "threads of the engine's shm copy pool (every shm endpoint's copies); 0 = min(4, cores)"};

int copy_threads(const EngineConfig& config) {
  int n = kCopyThreads.get(config);
  if (n > 0) return n;
  return static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));
}

std::mutex g_test_stager_mu;
std::shared_ptr<Stager> g_test_stager;  // set_test_stager()

std::shared_ptr<Stager> test_stager() {
  std::lock_guard<std::mutex> lk(g_test_stager_mu);
  return g_test_stager;
}

class ShmTransport final : public Transport, public Host {
 public:
  explicit ShmTransport(const EngineContext& ctx)
      : host_id_(ctx.host_id), engine_id_(ctx.engine_id), registry_(ctx.registry), copy_pool_(copy_threads(*ctx.config)) {
    if (g_probe_word == 0) g_probe_word = std::random_device{}() | 1;
    endpoints_.start("sluice-shm", engine_id_, [] {
      return nlohmann::json{{"probe_addr", reinterpret_cast<uint64_t>(&g_probe_word)},
                            {"probe_value", static_cast<uint64_t>(g_probe_word)}};
    });
  }
  ~ShmTransport() override {
    gate_->close();  // first: a describe answer still in flight no longer reaches us
    endpoints_.stop();
  }

  std::string name() const override { return "shm"; }
  int priority() const override { return 20; }
  // cuda memory on this side is staged through pinned host buffers (CUDA builds with a GPU),
  // by the StagingEndpoint in front of each endpoint (create_endpoint).
  bool supports(const Location& loc) const override { return loc.is_host() || staging::available(); }
  // Copies run on the owner's and this side's threads, not on a CUDA stream: no stream order.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cuda_memory = staging::available();
    c.imm = true;
    c.rma_post = true;  // shm_post.cpp
    c.signal = true;
    return c;
  }
  nlohmann::json local_address() const override { return {{"socket", endpoints_.name()}}; }

  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    std::string name = same_host::service_of(peer.transports, "shm");
    if (!same_host::service_usable(name, endpoints_.name(), "shm", why)) return false;
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
    std::string name = same_host::require_service(setup.peer.transports, "shm");
    auto ep = std::make_shared<ShmEndpoint>(setup, *this, name);
    endpoints_.add(setup.token, setup.active, ep);
    // Our own cuda pieces are staged by the adapter; without staging no cuda region reaches
    // us (supports()), so the adapter's indirection is left out. The socket service keeps
    // the ShmEndpoint itself: the peer's requests are the target side, not the adapter's.
    if (auto fake = test_stager()) return std::make_shared<StagingEndpoint>(std::move(ep), std::move(fake));
    if (!staging::available()) return ep;
    return std::make_shared<StagingEndpoint>(std::move(ep), cuda_stager());
  }

  // Host
  const Registry& registry() const override { return *registry_; }
  const std::string& engine_id() const override { return engine_id_; }
  int lease_fd() const override { return registry_->leases().ok() ? registry_->leases().memfd() : -1; }
  void forget(uint64_t) override { endpoints_.forget(); }
  CopyPool& copy_pool() override { return copy_pool_; }
  const std::shared_ptr<HostGate>& gate() override { return gate_; }

 private:
  std::shared_ptr<HostGate> gate_ = std::make_shared<HostGate>();
  std::string host_id_;
  std::string engine_id_;
  const Registry* registry_;
  CopyPool copy_pool_;  // outlives the endpoints' jobs: destroyed after endpoints_ stops
  same_host::Endpoints endpoints_;
};

}  // namespace

void set_test_stager(std::shared_ptr<Stager> stager) {
  std::lock_guard<std::mutex> lk(g_test_stager_mu);
  g_test_stager = std::move(stager);
}

SLUICE_REGISTER_TRANSPORT(shm, "shm", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  try {
    return std::make_unique<ShmTransport>(ctx);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
});

}  // namespace sluice::detail::shm
