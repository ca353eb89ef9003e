// Small sysfs files (at most 4 KiB), read with read(2), not iostreams: this code also runs
// inside the torch backend's module, where `std::ifstream >> int` crashed on the H100
// machine's image (tcp_transport.cpp, sysctl_int). Empty when the file cannot be read.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <string>

namespace sluice::detail::rdma {

inline std::string read_sysfs_text(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::string out(4096, '\0');
  ssize_t n = ::read(fd, out.data(), out.size());
  ::close(fd);
  out.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return out;
}

// The file's first line, without its newline.
inline std::string read_sysfs_line(const std::string& path) {
  std::string t = read_sysfs_text(path);
  const size_t e = t.find('\n');
  if (e != std::string::npos) t.resize(e);
  return t;
}

}  // namespace sluice::detail::rdma
