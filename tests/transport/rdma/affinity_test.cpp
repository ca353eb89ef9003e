// NIC-to-memory affinity (src/transport/rdma/affinity.*) against fake sysfs trees.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "transport/rdma/affinity.hpp"

namespace fs = std::filesystem;
using namespace sluice::detail::rdma;

namespace {

class FakeSys : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sluice-sysfs-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    // Two NUMA nodes, distance 10 local / 21 remote.
    node(0, "10 21");
    node(1, "21 10");
    // Socket 0: a PCIe switch with NIC mlx5_0 and GPU 0000:05:00.0 below it, NIC mlx5_1 on
    // another root port. Socket 1: NIC mlx5_2 and GPU 0000:85:00.0.
    pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0);
    pci("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0", 0);
    pci("pci0000:00/0000:00:03.0/0000:07:00.0", 0);
    pci("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
    pci("pci0000:80/0000:80:02.0/0000:85:00.0", 1);
    ib("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0");
    ib("mlx5_1", "pci0000:00/0000:00:03.0/0000:07:00.0");
    ib("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0");
    bus("0000:05:00.0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0");
    bus("0000:85:00.0", "pci0000:80/0000:80:02.0/0000:85:00.0");
    // A virtual device (SoftRoCE): no PCI parent, no NUMA node.
    fs::create_directories(root_ + "/devices/virtual/net/dummy0");
    fs::create_directories(root_ + "/class/infiniband/rxe0");
    fs::create_directory_symlink(root_ + "/devices/virtual/net/dummy0", root_ + "/class/infiniband/rxe0/device");
  }
  void TearDown() override { fs::remove_all(root_); }
  void node(int n, const char* dist) {
    fs::create_directories(root_ + "/devices/system/node/node" + std::to_string(n));
    std::ofstream(root_ + "/devices/system/node/node" + std::to_string(n) + "/distance") << dist << "\n";
  }
  void pci(const std::string& path, int numa) {
    fs::create_directories(root_ + "/devices/" + path);
    std::ofstream(root_ + "/devices/" + path + "/numa_node") << numa << "\n";
  }
  void ib(const std::string& name, const std::string& path) {
    fs::create_directories(root_ + "/class/infiniband/" + name);
    fs::create_directory_symlink(root_ + "/devices/" + path, root_ + "/class/infiniband/" + name + "/device");
  }
  void bus(const std::string& id, const std::string& path) {
    fs::create_directories(root_ + "/bus/pci/devices");
    fs::create_directory_symlink(root_ + "/devices/" + path, root_ + "/bus/pci/devices/" + id);
  }
  std::vector<Locality> nics(std::initializer_list<const char*> names) {
    std::vector<Locality> v;
    for (auto n : names) v.push_back(nic_locality(root_, n));
    return v;
  }
  std::string root_;
};

TEST_F(FakeSys, NicLocalityFromSysfs) {
  auto l = nic_locality(root_, "mlx5_2");
  EXPECT_EQ(l.numa, 1);
  EXPECT_NE(l.pci_path.find("0000:81:00.0"), std::string::npos) << l.pci_path;
  auto v = nic_locality(root_, "rxe0");
  EXPECT_EQ(v.numa, -1);
  EXPECT_TRUE(v.pci_path.empty()) << v.pci_path;
  EXPECT_EQ(nic_locality(root_, "no_such").numa, -1);
}

TEST_F(FakeSys, NumaDistanceAndPciHops) {
  EXPECT_EQ(numa_distance(root_, 0, 0), 10);
  EXPECT_EQ(numa_distance(root_, 0, 1), 21);
  EXPECT_EQ(numa_distance(root_, 3, 0), -1);
  EXPECT_EQ(pci_hops("/a/b/c/d", "/a/b/c/e"), 2);
  EXPECT_EQ(pci_hops("/a/b/c", "/a/b/c"), 0);
  EXPECT_EQ(pci_hops("/a/x/y", "/a/b"), 3);
}

TEST_F(FakeSys, HostMemoryPrefersNicsOnItsNumaNode) {
  auto n = nics({"mlx5_0", "mlx5_1", "mlx5_2"});
  Locality node1{1, ""};
  EXPECT_EQ(nearest_rails(root_, node1, n), 0b100u);
  Locality node0{0, ""};
  EXPECT_EQ(nearest_rails(root_, node0, n), 0b011u);
  Locality unknown;
  EXPECT_EQ(nearest_rails(root_, unknown, n), 0b111u);
}

TEST_F(FakeSys, GpuMemoryPrefersTheNicBehindTheSameSwitch) {
  auto n = nics({"mlx5_0", "mlx5_1", "mlx5_2"});
  auto gpu0 = pci_locality(root_, "00000000:05:00.0");  // CUDA's 8-digit domain form
  EXPECT_EQ(gpu0.numa, 0);
  EXPECT_EQ(nearest_rails(root_, gpu0, n), 0b001u);
  auto gpu1 = pci_locality(root_, "0000:85:00.0");
  EXPECT_EQ(nearest_rails(root_, gpu1, n), 0b100u);
}

TEST_F(FakeSys, VirtualOrSingleRailsAreAllPreferred) {
  Locality node0{0, ""};
  EXPECT_EQ(nearest_rails(root_, node0, nics({"rxe0"})), 0b1u);
  EXPECT_EQ(nearest_rails(root_, node0, nics({"rxe0", "rxe0"})), 0b11u);
  // Known NICs win over one whose place is unknown.
  EXPECT_EQ(nearest_rails(root_, node0, nics({"rxe0", "mlx5_1"})), 0b10u);
}

TEST(Affinity, NumaNodeOfHostMemory) {
  std::vector<char> v(4096, 1);
  int n = numa_node_of(v.data());
  EXPECT_GE(n, -1);  // -1 where get_mempolicy is unavailable (e.g. no NUMA support)
  if (n >= 0) EXPECT_TRUE(fs::exists("/sys/devices/system/node/node" + std::to_string(n)));
}

}  // namespace

namespace {

// On a host with GPUs: every GPU has a place in the PCIe tree, and the nearest-NIC choice over
// the host's real PCI network devices is a proper subset when they sit at different distances.
// Skips without a CUDA driver (CI); run on the GPU machine.
TEST(AffinityGpu, GpusHaveAPciPlaceAndANearestNic) {
  if (cuda_pci_bus_id(0).empty()) GTEST_SKIP() << "no CUDA driver or GPU here";
  // The host's PCI network devices stand in for NICs (the GPU machines have no RDMA NIC).
  std::vector<Locality> nics;
  std::vector<std::string> names;
  for (auto& d : fs::directory_iterator("/sys/class/net")) {
    Locality l;
    std::error_code ec;
    auto real = fs::canonical(d.path() / "device", ec);
    if (ec || real.string().find("/pci") == std::string::npos) continue;
    l.pci_path = real.string();
    std::ifstream in(real / "numa_node");
    in >> l.numa;
    nics.push_back(l);
    names.push_back(d.path().filename().string());
  }
  for (int g = 0; g < 16; ++g) {
    std::string id = cuda_pci_bus_id(g);
    if (id.empty()) break;
    Locality gpu = pci_locality("/sys", id);
    std::printf("      GPU %d: bus %s, numa %d, %s\n", g, id.c_str(), gpu.numa, gpu.pci_path.c_str());
    ASSERT_FALSE(gpu.pci_path.empty()) << "no sysfs device for bus id " << id;
    std::string lower = id.substr(id.size() - 7);
    for (auto& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    EXPECT_NE(gpu.pci_path.find(lower), std::string::npos) << gpu.pci_path;
    if (nics.empty()) continue;
    uint32_t mask = nearest_rails("/sys", gpu, nics);
    ASSERT_NE(mask, 0u);
    for (size_t i = 0; i < nics.size() && i < 32; ++i)
      std::printf("        %s %s: %d PCI hops%s\n", (mask >> i & 1) ? "*" : " ", names[i].c_str(),
                  pci_hops(gpu.pci_path, nics[i].pci_path), (mask >> i & 1) ? " (nearest)" : "");
  }
}

}  // namespace
