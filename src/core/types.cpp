#include "sluice/types.hpp"

#include <charconv>

#include "sluice/error.hpp"

namespace sluice {

Location Location::parse(std::string_view text) {
  if (text == "host" || text == "cpu") return host();
  if (text == "cuda") return cuda(0);
  if (text.substr(0, 5) == "cuda:") {
    int dev = -1;
    auto rest = text.substr(5);
    auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), dev);
    if (ec == std::errc() && p == rest.data() + rest.size() && dev >= 0) return cuda(dev);
  }
  throw Error(ErrorCode::kInvalidArgument,
              "location '" + std::string(text) + "' is not 'host' or 'cuda:N'");
}

std::string Location::to_string() const {
  return is_host() ? "host" : "cuda:" + std::to_string(device);
}

std::string_view to_string(OpKind kind) {
  switch (kind) {
    case OpKind::kRead: return "read";
    case OpKind::kWrite: return "write";
    case OpKind::kWriteImm: return "write_with_imm";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kImmRecv: return "imm_recv";
  }
  return "?";
}

}  // namespace sluice
