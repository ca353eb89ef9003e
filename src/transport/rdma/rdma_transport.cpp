// rdma: RC queue pairs over libibverbs (loaded with dlopen), striped over every selected port.
// This file is the Transport (what the engine sees); the endpoint is in endpoint.hpp and the
// ports and their memory registrations in rails.hpp. See docs/rdma.md.

#include "core/log.hpp"
#include "transport/rdma/endpoint.hpp"
#include "transport/rdma/rails.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

using nlohmann::json;
using rdma::Rails;

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(std::shared_ptr<Rails> rails, const Registry* reg) : rails_(std::move(rails)), reg_(reg) {}
  std::string name() const override { return "rdma"; }
  // Above tcp, below shm: on one host shared memory is faster than the NIC loopback.
  int priority() const override { return 15; }
  bool supports(const Location&) const override { return true; }
  json local_address() const override { return rails_->address(); }
  // Every region is registered on every rail when the engine registers it; peers find its
  // rkeys (by rail) with the region in the info blob.
  json region_added(const RegionEntry& e) override {
    Status st;
    const rdma::RegionKeys* k = rails_->keys_for(*reg_, &e, &st);
    if (!k) {
      // Not fatal to the registration: other transports may move this memory. Peers get no
      // rkey for it over rdma, and local use reports the error.
      SLUICE_LOG(kInfo, "rdma: region " << e.id << " not registered with the NIC: " << st.message);
      return nullptr;
    }
    json keys = json::array();
    for (ibv_mr* mr : k->mrs) keys.push_back(mr->rkey);
    return keys;
  }
  void region_removed(const RegionEntry& e) override { rails_->forget(e.id); }
  bool can_reach(const EngineInfo& peer, std::string* why) override {
    auto it = peer.transports.find("rdma");
    if (it == peer.transports.end()) {
      if (why) *why = "peer has no rdma transport";
      return false;
    }
    std::string link = it->second.value("link", "");
    if (link != (rails_->ethernet() ? "eth" : "ib")) {
      if (why) *why = "peer's RDMA link layer (" + link + ") differs from ours";
      return false;
    }
    return true;
  }
  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    auto ep = std::make_shared<rdma::RdmaEndpoint>(rails_, reg_, setup);
    rails_->add_listener(ep);
    return ep;
  }

 private:
  std::shared_ptr<Rails> rails_;
  const Registry* reg_;
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(rdma, "rdma", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  const rdma::Verbs* v = rdma::Verbs::get(why);
  if (!v) return nullptr;
  const EngineConfig& c = *ctx.config;  // SLUICE_IB_HCA / SLUICE_IB_GID_INDEX already applied
  auto rails = Rails::open(v, c.rdma_devices, c.rdma_gid_index >= 0 ? std::to_string(c.rdma_gid_index) : "", why);
  if (!rails) return nullptr;
  return std::make_unique<RdmaTransport>(std::move(rails), ctx.registry);
});

}  // namespace sluice::detail
