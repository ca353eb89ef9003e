// rdma: RC queue pairs over libibverbs (loaded with dlopen), striped over every selected port.
// This file is the Transport (what the engine sees); the endpoint is in endpoint.hpp and the
// ports and their memory registrations in rails.hpp. See docs/rdma.md.

#include "core/params.hpp"
#include "core/log.hpp"
#include "transport/rdma/endpoint.hpp"
#include "transport/rdma/hca_filter.hpp"
#include "transport/rdma/rails.hpp"
#include "transport/transport.hpp"

namespace sluice::detail {
namespace {

using nlohmann::json;
using rdma::Rails;

// The rdma namespace of EngineConfig::options; the rest of rdma's parameters are next to
// their use in endpoint.cpp and verbs_loader.cpp.
const Param<std::string> kHca{"rdma.hca", "SLUICE_IB_HCA", "",
                              [](const std::string&, const std::string& text) {
                                rdma::HcaFilter::parse(text);  // throws naming rdma.hca / SLUICE_IB_HCA
                                return text;
                              },
                              "RDMA ports to stripe over, NCCL_IB_HCA syntax (mlx5, =mlx5_0,mlx5_1:1, ^mlx5_3); "
                              "empty = every active port"};
const Param<int> kGidIndex{"rdma.gid_index", "SLUICE_IB_GID_INDEX", -1, int_in(-1, 65535),
                           "RoCE GID index; -1 = the RoCE v2 GID of the netdev's IPv4 address"};

class RdmaTransport final : public Transport {
 public:
  RdmaTransport(std::shared_ptr<Rails> rails, const Registry* reg) : rails_(std::move(rails)), reg_(reg) {
    for (int r = 0; r < rails_->size(); ++r)
      if (rails_->at(r).attr().atomic_cap == IBV_ATOMIC_NONE) atomics_ = false;
  }
  std::string name() const override { return "rdma"; }
  // Above tcp, below shm: on one host shared memory is faster than the NIC loopback.
  int priority() const override { return 15; }
  bool supports(const Location&) const override { return true; }
  // cuda memory is registered with the NIC (dmabuf / peer memory). Work requests are posted
  // from the host, not ordered on a CUDA stream.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cuda_memory = true;
    c.imm = true;
    // The thin post path (post_path.cpp): writes and signals on QP 0; a signal is a remote
    // fetch-and-add, so only where every rail has atomics.
    c.rma_post = true;
    c.signal = atomics_;
    return c;
  }
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
    auto ep = std::make_shared<rdma::RdmaEndpoint>(rails_, reg_, setup, redialer_);
    rails_->add_listener(ep);
    rails_->add_rail_listener(ep);
    return ep;
  }

 private:
  std::shared_ptr<Rails> rails_;
  const Registry* reg_;
  bool atomics_ = true;
  // Dials replacement queue pairs (failover) for every endpoint of this engine.
  std::shared_ptr<Redialer> redialer_ = std::make_shared<Redialer>();
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(rdma, "rdma", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  const rdma::Verbs* v = rdma::Verbs::get(why);
  if (!v) return nullptr;
  const EngineConfig& c = *ctx.config;  // SLUICE_IB_HCA / SLUICE_IB_GID_INDEX already applied
  const int gid = kGidIndex.get(c);
  auto rails = Rails::open(v, kHca.get(c), gid >= 0 ? std::to_string(gid) : "", why);
  if (!rails) return nullptr;
  return std::make_unique<RdmaTransport>(std::move(rails), ctx.registry);
});

}  // namespace sluice::detail
