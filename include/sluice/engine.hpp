// The engine: one per process. Owns the transports, the memory registry, the handshake
// listener and the progress threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sluice/config.hpp"
#include "sluice/endpoint.hpp"
#include "sluice/export.hpp"
#include "sluice/types.hpp"

namespace sluice {

namespace detail {
class EngineImpl;
}

// Memory the engine allocated: registered, and on the host backed by a memfd so that peers
// on the same host can map it and move bytes with plain loads and stores.
struct Allocation {
  MemoryHandle handle;
  void* ptr = nullptr;
  uint64_t length = 0;
  // The memfd behind a host allocation (-1 for device memory). Owned by the engine and
  // closed by free() or close(): do not close it. mmap(fd, MAP_SHARED) gives a second view
  // of the same pages that stays valid after free() (the Python binding hands that to
  // numpy); dup() it to keep the file itself.
  int fd = -1;
};

struct ConnectOptions {
  // Force a transport for this endpoint ("tcp", "shm", ...). Empty = the engine picks the
  // fastest one both sides have.
  std::string transport;
  std::optional<std::chrono::milliseconds> timeout;  // default: EngineConfig::connect_timeout
  // After the endpoint failed because its peer was lost or stopped answering (kPeerLost,
  // kTimeout), the next operation submitted on it first connects again to the same target
  // (the name through the directory, or the address), on the caller's thread, within
  // `timeout`. Operations pending at the failure still fail with it: none is retried. A peer
  // that restarted is a new engine: its regions have new handles (remote_region(name)), and
  // those of the old one are refused (kUnknownHandle), never mapped onto the new one's.
  // Failures of other kinds (kProtocol, a local close) are never reconnected. Endpoints from
  // accept() do not reconnect: their peer dials again. See docs/cluster.md.
  bool reconnect = true;
  // Transports the engine does not pick for this endpoint when it chooses (ignored when
  // `transport` forces one): e.g. a control channel of small host messages that should not
  // go over nvlink, which the engine ranks first on a GPU host. Last, so that aggregate
  // initialisation of the fields above keeps compiling.
  std::vector<std::string> avoid;
};

class SLUICE_API Engine {
 public:
  // Applies SLUICE_* environment overrides on top of `config` (EngineConfig::from_env).
  explicit Engine(EngineConfig config = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Register [ptr, ptr+length). Regions may overlap. `name` (optional, unique per engine)
  // lets peers find the region with Endpoint::remote_region(name).
  MemoryHandle register_memory(void* ptr, uint64_t length, Location location = Location::host(),
                               const std::string& name = "");
  // The region as a self-contained descriptor (what this engine's info says of it, and whose
  // it is), to hand to a connected peer in-band: Endpoint::import_region there makes it
  // addressable without a directory round trip (MSCCL++'s serialised RegisteredMemory). For
  // regions registered after the peer connected, e.g. a tensor's memory. kUnknownHandle.
  std::string region_descriptor(MemoryHandle handle) const;
  // Stop exposing the region. New operations naming it fail at once with kUnknownHandle;
  // the call blocks until operations already using it have finished (they are bounded by
  // the operation timeout), so the memory can be freed as soon as it returns.
  void unregister_memory(MemoryHandle handle);
  // Allocate registered memory (page aligned, zero filled). Freed by free().
  Allocation allocate(uint64_t length, Location location = Location::host(), const std::string& name = "");
  void free(const Allocation& allocation);

  // JSON describing this engine: host identity, engine id, listen address, each transport's
  // address and the registered regions.
  std::string local_info() const;
  // "host:port" of the handshake listener.
  std::string listen_address() const;
  // The transports this engine runs, fastest first.
  std::vector<std::string> transports() const;

  // Connect to a peer given its local_info() blob or its listener "host:port". Connecting to
  // a peer that already connected to us returns a new endpoint (each has its own channels).
  Endpoint connect(const std::string& blob_or_address, const ConnectOptions& options = {});
  // The endpoints that peers opened to us, in arrival order. Waits up to `timeout` for one.
  std::optional<Endpoint> accept(std::chrono::milliseconds timeout);

  // Fail every pending operation with kCancelled, close every endpoint and stop the threads.
  // Called by the destructor.
  void close();

  const EngineConfig& config() const;
  // Counters of every open endpoint (sluice/metrics.hpp), and the same as Prometheus text
  // (serve it from a /metrics handler).
  std::vector<EndpointMetrics> metrics() const;
  std::string metrics_text() const;
  detail::EngineImpl& impl() { return *impl_; }

 private:
  std::shared_ptr<detail::EngineImpl> impl_;
};

}  // namespace sluice
