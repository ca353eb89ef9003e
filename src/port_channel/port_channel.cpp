// The public ProxyService / PortChannel: thin forwards to ProxyCore.
#include "core/engine_impl.hpp"
#include "port_channel/proxy_core.hpp"
#include "sluice/engine.hpp"

namespace sluice {
namespace {
const detail::PortChannelRecord& need(const std::shared_ptr<detail::PortChannelRecord>& rec) {
  if (!rec) throw Error(ErrorCode::kInvalidArgument, "PortChannel: empty channel handle");
  return *rec;
}
}  // namespace

PortChannelDeviceHandle PortChannel::device_handle() const { return need(rec_).handle; }
uint32_t PortChannel::id() const { return need(rec_).id; }
Status PortChannel::status() const { return need(rec_).status(); }

ProxyService::ProxyService(Engine& engine, ProxyOptions options)
    : core_(std::make_shared<detail::ProxyCore>(engine.impl().registry(), options, engine.impl().config())) {}
ProxyService::~ProxyService() { core_->stop(); }

MemoryId ProxyService::add_memory(MemoryHandle local) { return core_->add_local(local); }
MemoryId ProxyService::add_memory(const Endpoint& ep, RemoteHandle remote) { return core_->add_remote(ep, remote); }
PortChannel ProxyService::add_channel(const Endpoint& ep, MemoryId dst, MemoryId src, RemoteSemaphore remote_sem,
                                      LocalSemaphore local_sem, int worker) {
  return PortChannel(core_->add_channel(ep, dst, src, remote_sem, local_sem, worker));
}
void ProxyService::start() { core_->start(); }
void ProxyService::stop() { core_->stop(); }
const ProxyOptions& ProxyService::options() const { return core_->options(); }
ProxyStats ProxyService::stats() const { return core_->stats(); }
size_t ProxyService::channels() const { return core_->channels(); }
size_t ProxyService::memories() const { return core_->memories(); }

}  // namespace sluice
