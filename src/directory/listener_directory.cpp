#include "directory/listener_directory.hpp"

#include <algorithm>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {

EngineInfo ListenerDirectory::lookup(const std::string& ref, Clock::time_point deadline) {
  auto [host, port] = split_host_port(ref);
  // One absolute deadline for the whole exchange (connect, request, reply): a peer that
  // trickles its reply cannot stretch it the way a per-recv() timeout could be.
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) throw Error(ErrorCode::kTimeout, "directory: no time left to ask " + ref + " for its info");
  net::Socket sock = net::connect_tcp(host, port, left);
  bootstrap::send_msg(sock.fd(), bootstrap::MsgKind::kInfo, nlohmann::json::object(), deadline);
  nlohmann::json reply = bootstrap::expect_reply(sock.fd(), "info query", deadline);
  EngineInfo info = EngineInfo::from_json(bootstrap::require_object(reply, "info", "info reply"));
  info.listen_host = host;
  info.listen_port = port;
  return info;
}

}  // namespace sluice::detail
