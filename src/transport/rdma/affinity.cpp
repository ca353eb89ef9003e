#include "transport/rdma/affinity.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <sstream>

#include "transport/rdma/sysfs.hpp"

namespace sluice::detail::rdma {
namespace {

std::string read_text(const std::string& path) { return read_sysfs_text(path); }

// The file's first whitespace-separated word.
std::string read_word(const std::string& path) {
  const std::string t = read_text(path);
  const size_t b = t.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = t.find_first_of(" \t\r\n", b);
  return t.substr(b, e == std::string::npos ? std::string::npos : e - b);
}

std::string resolve(const std::string& path) {
  char buf[PATH_MAX];
  if (!::realpath(path.c_str(), buf)) return "";
  return buf;
}

int read_numa(const std::string& dir) {
  std::string s = read_word(dir + "/numa_node");
  if (s.empty()) return -1;
  int n = std::atoi(s.c_str());
  return n >= 0 ? n : -1;
}

Locality device_dir_locality(const std::string& dir) {
  Locality l;
  std::string real = resolve(dir);
  if (real.empty()) return l;
  l.numa = read_numa(real);
  // Only PCI devices carry a PCIe position; a virtual device's path says nothing.
  if (real.find("/pci") != std::string::npos) l.pci_path = real;
  return l;
}

std::vector<std::string> components(const std::string& p) {
  std::vector<std::string> out;
  std::stringstream ss(p);
  std::string c;
  while (std::getline(ss, c, '/'))
    if (!c.empty()) out.push_back(c);
  return out;
}

}  // namespace

Locality nic_locality(const std::string& root, const std::string& ibdev) {
  return device_dir_locality(root + "/class/infiniband/" + ibdev + "/device");
}

Locality pci_locality(const std::string& root, const std::string& bus_id) {
  std::string id = bus_id;
  for (auto& ch : id) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // CUDA reports 8-digit domains ("00000000:3b:00.0"); sysfs uses 4.
  if (id.size() > 12 && id.find(':') == 8) id = id.substr(4);
  return device_dir_locality(root + "/bus/pci/devices/" + id);
}

void* cuda_driver() {
  static void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return lib;
}

std::string cuda_pci_bus_id(int ordinal) {
  void* cuda = cuda_driver();
  if (!cuda || ordinal < 0) return "";
  using Init = int (*)(unsigned);
  using Get = int (*)(int*, int);
  using BusId = int (*)(char*, int, int);
  auto init = reinterpret_cast<Init>(::dlsym(cuda, "cuInit"));
  auto get = reinterpret_cast<Get>(::dlsym(cuda, "cuDeviceGet"));
  auto bus = reinterpret_cast<BusId>(::dlsym(cuda, "cuDeviceGetPCIBusId"));
  int dev = 0;
  char buf[32] = {};
  if (!init || !get || !bus || init(0) != 0 || get(&dev, ordinal) != 0 || bus(buf, sizeof buf, dev) != 0) return "";
  return buf;
}

int numa_node_of(const void* addr) {
#ifdef SYS_get_mempolicy
  int node = -1;
  // MPOL_F_NODE | MPOL_F_ADDR: the node holding the page at addr.
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(addr), 1 | 2) == 0) return node;
#endif
  (void)addr;
  return -1;
}

int numa_distance(const std::string& root, int from, int to) {
  if (from < 0 || to < 0) return -1;
  const std::string t = read_text(root + "/devices/system/node/node" + std::to_string(from) + "/distance");
  std::vector<int> d;
  const char* p = t.c_str();
  for (;;) {  // the integers up to the first thing that is not one
    char* end = nullptr;
    long x = std::strtol(p, &end, 10);
    if (end == p) break;
    d.push_back(static_cast<int>(x));
    p = end;
  }
  if (to < static_cast<int>(d.size())) return d[to];
  return from == to ? 10 : -1;
}

int pci_hops(const std::string& a, const std::string& b) {
  auto ca = components(a), cb = components(b);
  size_t common = 0;
  while (common < ca.size() && common < cb.size() && ca[common] == cb[common]) ++common;
  return static_cast<int>((ca.size() - common) + (cb.size() - common));
}

uint32_t nearest_rails(const std::string& root, const Locality& mem, const std::vector<Locality>& nics) {
  const uint32_t all = nics.size() >= 32 ? 0xffffffffu : (1u << nics.size()) - 1;
  if (nics.size() <= 1) return all;
  // Score each rail; lower is nearer. PCIe distance when both ends are PCI devices (GPU memory),
  // else the NUMA distance (host memory), else unknown.
  std::vector<long> score(nics.size(), -1);
  for (size_t i = 0; i < nics.size() && i < 32; ++i) {
    const Locality& n = nics[i];
    if (!mem.pci_path.empty() && !n.pci_path.empty()) {
      score[i] = pci_hops(mem.pci_path, n.pci_path);
    } else if (mem.numa >= 0 && n.numa >= 0) {
      int d = numa_distance(root, mem.numa, n.numa);
      score[i] = d >= 0 ? d : (mem.numa == n.numa ? 10 : 20);
    }
  }
  long best = LONG_MAX;
  for (size_t i = 0; i < score.size() && i < 32; ++i)
    if (score[i] >= 0) best = std::min(best, score[i]);
  if (best == LONG_MAX) return all;  // nothing known
  uint32_t mask = 0;
  for (size_t i = 0; i < score.size() && i < 32; ++i)
    if (score[i] == best) mask |= 1u << i;
  return mask;
}

}  // namespace sluice::detail::rdma
