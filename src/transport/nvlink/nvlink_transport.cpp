// nvlink: peers on the same host with CUDA memory. The peer proves itself first, as in shm
// (transport/common/same_host.hpp): each engine serves an abstract Unix socket, the kernel
// names the process at the other end (SO_PEERCRED) and descriptors travel as SCM_RIGHTS.
// Nothing the info blob says about the peer's memory is used: each peer region is described
// by its owner over that socket when the peer's info names it, off the submitting threads
// (peer_view.cpp says when) ("describe": its address, length, lease slot,
// and for cuda memory its cudaIpc handle or, for cuMem allocations, the POSIX-fd export as a
// passed descriptor; for memfd host memory the memfd), then mapped once. Offsets are checked
// against the described region at every use. Bytes move with cudaMemcpyAsync on dedicated
// streams (the copy engine; an SM copy kernel for pieces up to SLUICE_NVLINK_SM_COPY_MAX, off
// by default: slower here). The pieces the core cut for stream transports are merged back
// into one copy per contiguous range. CUDA events signal completion: small ops are polled on
// the submitting thread, the rest by a poller thread. The peer's host memory is mapped
// (memfd) or read with process_vm_readv from the proven pid; writes into it that are not
// through a mapping are PULL_WRITEs its owner executes (as in shm); a local cuda side stages
// through host memory. The authenticated socket is the control
// channel (imm values, send rendezvous, signals into host memory); the listener's TCP
// channel only completes the endpoint. The thin post path is in post_path.cpp. Two engines
// of one process are peers too (the kernel then names this process): the answering engine
// describes its regions by address and they are used directly.
//
// This file holds the Transport (socket service, reachability, endpoint creation) and its
// registration; the endpoint is in endpoint.hpp and the files it names.
#include <chrono>
#include <memory>
#include <string>

#include "core/log.hpp"
#include "core/params.hpp"
#include "transport/nvlink/endpoint.hpp"
#include "transport/nvlink/local_pins.hpp"
#include "transport/transport.hpp"

namespace sluice::detail::nvlink {
namespace {

const Param<bool> kDisable{"nvlink.disable", "SLUICE_NVLINK_DISABLE", false, boolean(),
                           "do not start the nvlink transport"};

class NvlinkTransport final : public Transport, public NvlinkHost {
 public:
  explicit NvlinkTransport(const EngineContext& ctx) : host_id_(ctx.host_id), engine_id_(ctx.engine_id), registry_(ctx.registry) {
    endpoints_.start("sluice-nvl", engine_id_, nullptr);
  }
  ~NvlinkTransport() override { endpoints_.stop(); }

  std::string name() const override { return "nvlink"; }
  int priority() const override { return 30; }
  bool supports(const Location& loc) const override { return loc.is_host() || loc.kind == Location::Kind::kCuda; }
  // One-sided copies are enqueued on the op's cuda_stream when it has one (enqueue()); messages
  // go over the control socket and are not stream-ordered. The thin post path and its
  // signals: post_path.cpp.
  Capabilities capabilities() const override {
    Capabilities c;
    c.host_memory = true;
    c.cuda_memory = true;
    c.stream_ordered = true;
    c.imm = true;
    c.signal = true;
    c.rma_post = true;
    return c;
  }
  // No pid, no handles, no addresses: a peer learns about our memory only after proving itself.
  nlohmann::json local_address() const override { return {{"socket", endpoints_.name()}, {"devices", cu::device_count()}}; }

  bool can_reach(const EngineInfo& peer, std::string* why) override {
    if (peer.host_id != host_id_) {
      *why = "the peer is on another host";
      return false;
    }
    const auto& a = peer.transports.at("nvlink");
    auto devices = a.find("devices");
    if (devices == a.end() || !devices->is_number_integer() || devices->get<int64_t>() <= 0) {
      *why = "the peer has no CUDA device";
      return false;
    }
    std::string name = same_host::service_of(peer.transports, "nvlink");
    if (!same_host::service_usable(name, endpoints_.name(), "nvlink", why)) return false;
    try {
      net::Socket s = same_host::connect(name);
      (void)same_host::peer_cred(s.fd());
      same_host::send(s.fd(), {{"op", "probe"}});
      nlohmann::json r = same_host::recv(s.fd(), same_host::Clock::now() + std::chrono::seconds(2));
      if (string_field(r, "engine") != peer.engine_id) {
        *why = "the same-host socket named in the peer's info is served by another engine";
        return false;
      }
      return true;
    } catch (const Error& e) {
      *why = e.what();
      SLUICE_LOG(kInfo, "nvlink: " << *why << "; trying the next transport");
      return false;
    }
  }

  std::shared_ptr<TransportEndpoint> create_endpoint(const EndpointSetup& setup) override {
    std::string name = same_host::require_service(setup.peer.transports, "nvlink");
    auto ep = std::make_shared<NvlinkEndpoint>(setup, *this, name);
    endpoints_.add(setup.token, setup.active, ep);
    return ep;
  }

  // NvlinkHost
  const Registry& registry() const override { return *registry_; }
  const std::string& engine_id() const override { return engine_id_; }
  int lease_fd() const override { return registry_->leases().ok() ? registry_->leases().memfd() : -1; }
  void forget(uint64_t) override { endpoints_.forget(); }
  bool pin_local(const RegionEntry& e) override { return local_pins_.pin(e); }

  // No local op pins `e` any more: unlock it before the engine unmaps it.
  void region_removed(const RegionEntry& e) override { local_pins_.forget(e); }

 private:
  std::string host_id_;
  std::string engine_id_;
  const Registry* registry_;
  same_host::Endpoints endpoints_;
  LocalPins local_pins_;  // unlocked when the transport goes (its endpoints stopped in ~NvlinkTransport)
};

}  // namespace

SLUICE_REGISTER_TRANSPORT(nvlink, "nvlink", [](const EngineContext& ctx, std::string* why) -> std::unique_ptr<Transport> {
  if (kDisable.get(*ctx.config)) {
    *why = "disabled by nvlink.disable / SLUICE_NVLINK_DISABLE";
    return nullptr;
  }
  if (cu::device_count(why) == 0) return nullptr;
  try {
    return std::make_unique<NvlinkTransport>(ctx);
  } catch (const Error& e) {
    *why = e.what();
    return nullptr;
  }
});

}  // namespace sluice::detail::nvlink
