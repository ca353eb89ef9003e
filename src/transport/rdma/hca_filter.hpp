// Device selection in NCCL_IB_HCA syntax (env SLUICE_IB_HCA):
//   "mlx5"            devices whose name starts with mlx5 (prefix match)
//   "=mlx5_0,mlx5_1"  exactly these names
//   "^mlx5_3"         every device except those starting with mlx5_3
//   "^=mlx5_3"        every device except exactly mlx5_3
// Each entry may carry ":port" (1-based) to restrict it to one port.
#pragma once

#include <string>
#include <vector>

namespace sluice::detail::rdma {

struct HcaEntry {
  std::string name;
  int port = -1;  // -1 = any port
};

struct HcaFilter {
  bool exclude = false;  // ^ : the entries are a deny list
  bool exact = false;    // = : names match exactly instead of by prefix
  std::vector<HcaEntry> entries;  // empty = every device

  // Throws sluice::Error(kInvalidArgument) on malformed text (empty name, bad port).
  static HcaFilter parse(const std::string& text);
  // Whether port `port` of device `device` is selected.
  bool matches(const std::string& device, int port) const;
  std::string to_string() const;
};

}  // namespace sluice::detail::rdma
