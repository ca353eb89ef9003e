// Engine options. Defaults suit a single host; every field and option can be overridden by a
// SLUICE_* environment variable, read when the Engine is created (never at static
// initialisation). docs/configuration.md lists every parameter (`sluice-bench --list-params`).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sluice/export.hpp"

namespace sluice {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

struct SLUICE_API EngineConfig {
  // Transports this engine may use, by name ("shm", "tcp", "rdma", "nvlink").
  // Empty = every transport available on this host.       env SLUICE_TRANSPORTS=tcp,shm
  std::vector<std::string> transports;
  // Channels per peer: TCP connections, RDMA queue pairs (shm copies run on a per-engine pool).  env SLUICE_CHANNELS
  int channels = 2;
  // Handshake listener. Port 0 picks a free port.   env SLUICE_LISTEN=host:port
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  // Host identity used to decide whether a peer is on the same host (shm).
  // Empty = derived from the hostname and the boot id.   env SLUICE_HOST_ID
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
  // Future::wait() polls this long before sleeping. -1 = automatic: 0 on hosts with <= 2
  // hardware threads (a spinning waiter steals the progress threads' CPU), 20 us otherwise.
  int busy_wait_us = -1;                          // env SLUICE_BUSY_WAIT_US
  LogLevel log_level = LogLevel::kWarn;           // env SLUICE_LOG_LEVEL=error|warn|info|debug|trace
  // Where engines publish themselves and find peers by name (docs/cluster.md): "" = nowhere,
  // a peer is named by its listener "host:port"; "etcd://h1:2379,h2:2379/prefix";
  // "redis://[:password@]host:6379/0?prefix=p".                   env SLUICE_DIRECTORY
  std::string directory;
  // This engine's name in the directory, what peers pass to connect(). Empty = its engine id.
  // Letters, digits, '.', '_', '-'; one live engine per name.    env SLUICE_NAME
  std::string name;
  // Per-transport options, "<transport>.<key>" -> value as text, e.g. {"rdma.hca", "mlx5_0"},
  // {"rdma.gid_index", "3"}. The transport that owns the namespace declares and parses them;
  // an unknown key, or a namespace no transport of this build owns, is kInvalidArgument.
  std::map<std::string, std::string> options;

  // Sets one parameter by its table name: a field ("channels", "chunk_size",
  // "connect_timeout_ms", ...) or an option ("rdma.hca"), parsing `value` exactly as its
  // SLUICE_* variable is parsed. Throws Error(kInvalidArgument) naming `key`.
  EngineConfig& set(const std::string& key, const std::string& value);
  // The parameter's value in this config, as text that set() accepts (an option that is not
  // set: its default).
  std::string get(const std::string& key) const;

  // Returns `base` with every SLUICE_* variable that is set applied on top (variables override
  // code), after checking every field and option. Throws Error(kInvalidArgument) naming the
  // variable, option key or field that does not parse or is out of range.
  static EngineConfig from_env(EngineConfig base);
};

// One row of the parameter table (what `sluice-bench --list-params` prints).
struct ParamInfo {
  std::string name;           // set()/options key: "channels", "rdma.hca"
  std::string env;            // "SLUICE_CHANNELS"
  std::string default_value;  // as text
  std::string doc;
  // "engine": per engine (EngineConfig, variable on top); "process": read from the variable
  // where it is used; "test": test-only knob read from the variable when an endpoint is created.
  std::string scope;
};
// Every parameter this build declares, sorted by name.
SLUICE_API std::vector<ParamInfo> list_params();

inline EngineConfig env_config() { return EngineConfig::from_env(EngineConfig{}); }

}  // namespace sluice
