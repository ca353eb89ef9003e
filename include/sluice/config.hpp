// Engine options. Defaults suit a single host; every field can be overridden by a SLUICE_*
// environment variable, read when the Engine is created (never at static initialisation).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "sluice/export.hpp"

namespace sluice {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

struct SLUICE_API EngineConfig {
  // Transports this engine may use, by name ("shm", "tcp", later "rdma", "nvlink").
  // Empty = every transport available on this host.       env SLUICE_TRANSPORTS=tcp,shm
  std::vector<std::string> transports;
  // Channels per peer: TCP connections, shm workers, RDMA queue pairs.  env SLUICE_CHANNELS
  int channels = 2;
  // Handshake listener. Port 0 picks a free port.   env SLUICE_LISTEN=host:port
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // Host identity used to decide whether a peer is on the same host (shm).
  // Empty = derived from /etc/machine-id, hostname and boot id.   env SLUICE_HOST_ID
  std::string host_id;
  // Deadline for connecting and for the handshake.          env SLUICE_CONNECT_TIMEOUT_MS
  std::chrono::milliseconds connect_timeout{5000};
  // A pending operation that sees no progress from its peer for this long fails with
  // kTimeout; a peer silent this long is declared lost.   env SLUICE_OP_TIMEOUT_MS
  std::chrono::milliseconds op_timeout{30000};
  // Pieces larger than this are split; batches larger than stripe_threshold are striped over
  // channels.                     env SLUICE_CHUNK_SIZE, SLUICE_STRIPE_THRESHOLD
  uint64_t chunk_size = 4ull << 20;
  uint64_t stripe_threshold = 256ull << 10;
  // Bytes of unmatched incoming sends buffered before the peer is refused.
  uint64_t max_unexpected_bytes = 256ull << 20;  // env SLUICE_MAX_UNEXPECTED_BYTES
  // Unmatched incoming sends (of any size, zero-length included) buffered per endpoint before
  // the peer is refused.                          env SLUICE_MAX_UNEXPECTED_MESSAGES
  uint64_t max_unexpected_messages = 65536;
  // A recv() or imm_recv() that no message or imm matches for this long completes with
  // kTimeout (the endpoint stays usable). 0 = wait until the endpoint closes (opt-out).
  std::chrono::milliseconds recv_timeout{30000};  // env SLUICE_RECV_TIMEOUT_MS
  // Hostile-peer bounds on the handshake listener: connections being handshaken at once
  // (more are closed at accept), the largest handshake message body accepted, and endpoints
  // opened by peers that wait for accept() (more are refused until accept() takes some).
  int max_handshakes = 64;                        // env SLUICE_MAX_HANDSHAKES
  uint64_t max_handshake_bytes = 4ull << 20;      // env SLUICE_MAX_HANDSHAKE_BYTES
  int max_pending_accepts = 1024;                 // env SLUICE_MAX_PENDING_ACCEPTS
  // Read responses a peer may have queued on one channel without reading them; more fail the
  // endpoint (a peer that stops reading cannot pin regions or grow queues without bound).
  int max_queued_responses = 4096;                // env SLUICE_MAX_QUEUED_RESPONSES
  // RDMA ports to stripe over, in NCCL_IB_HCA syntax: "mlx5" (prefix), "=mlx5_0,mlx5_1:1"
  // (exact, optional port), "^mlx5_3" / "^=mlx5_3" (exclude). Empty = every active port.
  std::string rdma_devices;                       // env SLUICE_IB_HCA
  // RoCE GID index; -1 = the RoCE v2 GID of the netdev's IPv4 address.   env SLUICE_IB_GID_INDEX
  int rdma_gid_index = -1;
  // Future::wait() polls this long before sleeping. -1 = automatic: 0 on hosts with <= 2
  // hardware threads (a spinning waiter steals the progress threads' CPU), 20 us otherwise.
  int busy_wait_us = -1;                          // env SLUICE_BUSY_WAIT_US
  LogLevel log_level = LogLevel::kWarn;           // env SLUICE_LOG_LEVEL=error|warn|info|debug|trace

  // Returns `base` with every SLUICE_* variable that is set applied on top. Throws
  // Error(kInvalidArgument) naming the variable when one does not parse.
  static EngineConfig from_env(EngineConfig base);
};

inline EngineConfig env_config() { return EngineConfig::from_env(EngineConfig{}); }

}  // namespace sluice
