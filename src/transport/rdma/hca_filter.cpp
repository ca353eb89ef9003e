#include "transport/rdma/hca_filter.hpp"

#include <cctype>

#include "sluice/error.hpp"

namespace sluice::detail::rdma {
namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

}  // namespace

HcaFilter HcaFilter::parse(const std::string& raw) {
  HcaFilter f;
  std::string text = trim(raw);
  if (!text.empty() && text[0] == '^') {
    f.exclude = true;
    text = text.substr(1);
  }
  if (!text.empty() && text[0] == '=') {
    f.exact = true;
    text = text.substr(1);
  }
  if (trim(text).empty()) {
    if (f.exclude || f.exact) throw Error(ErrorCode::kInvalidArgument, "rdma.hca (SLUICE_IB_HCA) '" + raw + "' names no device");
    return f;
  }
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = trim(text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    pos = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (item.empty()) throw Error(ErrorCode::kInvalidArgument, "rdma.hca (SLUICE_IB_HCA) '" + raw + "' has an empty entry");
    HcaEntry e;
    size_t colon = item.find(':');
    if (colon != std::string::npos) {
      std::string port = trim(item.substr(colon + 1));
      e.name = trim(item.substr(0, colon));
      if (port.empty() || port.size() > 3 ||
          port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) < 1)
        throw Error(ErrorCode::kInvalidArgument, "rdma.hca (SLUICE_IB_HCA) '" + raw + "': bad port '" + port + "' in '" + item + "'");
      e.port = std::stoi(port);
    } else {
      e.name = item;
    }
    if (e.name.empty()) throw Error(ErrorCode::kInvalidArgument, "rdma.hca (SLUICE_IB_HCA) '" + raw + "': entry '" + item + "' has no device name");
    f.entries.push_back(std::move(e));
  }
  return f;
}

bool HcaFilter::matches(const std::string& device, int port) const {
  if (entries.empty()) return true;
  bool hit = false;
  for (const auto& e : entries) {
    bool name_ok = exact ? device == e.name : device.compare(0, e.name.size(), e.name) == 0;
    if (name_ok && (e.port < 0 || e.port == port)) {
      hit = true;
      break;
    }
  }
  return exclude ? !hit : hit;
}

std::string HcaFilter::to_string() const {
  std::string s = std::string(exclude ? "^" : "") + (exact ? "=" : "");
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i) s += ",";
    s += entries[i].name;
    if (entries[i].port >= 0) s += ":" + std::to_string(entries[i].port);
  }
  return s;
}

}  // namespace sluice::detail::rdma
