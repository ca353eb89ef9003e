// Proof that a peer is a process on this host, for the transports that touch a peer's memory
// directly (shm; nvlink's host path). Nothing a peer *says* about itself (a pid, a descriptor
// number, an address) is trusted: each same-host transport runs a Unix-domain socket service
// in the abstract namespace, the kernel names the process at the other end (SO_PEERCRED), and
// descriptors a peer shares (its lease table, its memfd regions) travel as SCM_RIGHTS, so a
// peer can only hand over what it owns, with the access it has. Only processes in this
// network namespace on this kernel can connect to an abstract socket, so a remote peer can
// never pass the proof, whatever host id or pid its info blob claims. See docs/security.md.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "bootstrap/socket.hpp"

namespace sluice::detail::same_host {

using Clock = std::chrono::steady_clock;

struct PeerCred {
  pid_t pid = 0;
  uid_t uid = 0;
};

// The process at the other end of a connected Unix socket, as the kernel recorded it at
// connect()/listen() time. Throws Error(kSystem).
PeerCred peer_cred(int fd);

// Messages on the service socket: a 4-byte little-endian length, then that many bytes of JSON.
// At most one descriptor rides on the first byte of a message (SCM_RIGHTS).
constexpr uint32_t kMaxMessage = 64 << 10;
// Throws Error(kPeerLost) when the socket broke.
void send(int fd, const nlohmann::json& body, int pass_fd = -1);
// Reads one message before `deadline` (the whole message, however the peer trickles it).
// A descriptor that came with it is returned in *fd_out (-1 if none; extra ones are closed).
// Throws Error(kTimeout | kPeerLost | kProtocol).
nlohmann::json recv(int fd, Clock::time_point deadline, int* fd_out = nullptr);

// True if fd is a memfd (or other sealable shmem file) of at least min_bytes, sealed against
// shrinking (F_SEAL_SHRINK, as core/memfd.hpp makes them): the only kind of descriptor a peer
// may hand us to map. A regular file the peer opened read-only is refused before we ever map it
// writable, and a memfd its owner could truncate under our mapping (SIGBUS here) too.
bool is_memfd(int fd, uint64_t min_bytes);

// Connects to a service by its abstract name; throws Error(kUnsupported) naming the reason.
net::Socket connect(const std::string& name);

// The same-host service that `transport`'s address in a peer's info names ("" when none).
std::string service_of(const std::map<std::string, nlohmann::json>& transports, const char* transport);
// can_reach()'s common check: the peer names a service, and it is not this engine's `own`.
bool service_usable(const std::string& name, const std::string& own, const char* transport, std::string* why);
// create_endpoint()'s: the service, or Error(kProtocol) when the peer's info names none.
std::string require_service(const std::map<std::string, nlohmann::json>& transports, const char* transport);

// The active side's proof, shared by the same-host transports: connect to the peer's service,
// present the endpoint token (which ties the proof to the hello sent over TCP) with our lease
// table, and take the peer's. Whoever the kernel names at the other end is the peer.
struct Proof {
  net::Socket sock;   // authenticated; the transport may keep it as its control channel
  PeerCred cred;
  int lease_fd = -1;  // the peer's lease table, checked to be a memfd; the caller closes it
};
// `expect_engine` (unless empty) must be the engine id the answer names: a listener that
// relays our hello to another engine of this host is caught here. Throws Error: kUnsupported
// (no such socket here), kRemoteError (refused), kProtocol (no lease table, another engine),
// kTimeout, kPeerLost.
Proof prove(const std::string& name, uint64_t token, const std::string& engine_id, int our_lease_fd,
            const std::string& expect_engine, Clock::time_point deadline, const char* transport);

// One request to the peer that proved itself as `pid` (e.g. "describe"), on a fresh
// connection to its service that must be answered by that same process. Returns the reply
// (possibly {"error": ...}); a descriptor that came with it lands in *fd_out. Throws Error:
// kPeerLost when another process now serves the name, kTimeout, kProtocol.
nlohmann::json ask(const std::string& name, pid_t pid, const nlohmann::json& req, Clock::time_point deadline,
                   int* fd_out = nullptr);

// ask() in steps, for a caller that must not block (a reactor): ask_start() connects (a Unix
// connect never waits for the peer), checks that `pid` serves the name and sends req; then
// recv_some() reads what has arrived without blocking, true once the whole message is in buf
// (a descriptor that came with its first byte lands in *fd_slot, the caller's to close);
// parse_message() gives the body. Throw Error like ask().
net::Socket ask_start(const std::string& name, pid_t pid, const nlohmann::json& req);
bool recv_some(int fd, std::string& buf, int* fd_slot);
nlohmann::json parse_message(const std::string& buf);

// One listening abstract socket and the thread that serves it. Each connection carries one
// request, read within a short deadline and handled on the service thread (handlers answer
// at once and never block on the network), so a local client that stalls costs at most that
// deadline and never a thread.
class Service {
 public:
  // The handler may take `sock` (the shm control channel is such a socket); if it throws and
  // left the socket, the error goes back to the client. `fd` is a descriptor that came with
  // the request, or -1; the handler must close it.
  using Handler = std::function<void(net::Socket& sock, const PeerCred& cred, const nlohmann::json& req, int fd)>;

  Service() = default;
  ~Service() { stop(); }
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;
  // Listens on a fresh random abstract name built from `prefix`; throws Error(kSystem).
  void start(const std::string& prefix, Handler handler);
  void stop();
  const std::string& name() const { return name_; }

 private:
  void loop();

  std::string name_;
  Handler handler_;
  net::Socket listen_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace sluice::detail::same_host
