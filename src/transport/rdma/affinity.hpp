// Which NICs are near a region's memory: NUMA distance for host memory, PCIe distance for GPU
// memory, both read from sysfs (`root` is "/sys" outside tests). Used to stripe a region's
// transfers over the rails nearest to it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sluice::detail::rdma {

// Where a device or a piece of memory sits: its NUMA node (-1: unknown) and, for PCI devices,
// the resolved sysfs path of the device (e.g. /sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0).
struct Locality {
  int numa = -1;
  std::string pci_path;
};

// An RDMA device by its verbs name (/sys/class/infiniband/<name>/device). SoftRoCE and other
// virtual devices have no PCI parent: unknown locality.
Locality nic_locality(const std::string& root, const std::string& ibdev);
// A PCI device by bus id ("0000:3b:00.0"), e.g. a GPU.
Locality pci_locality(const std::string& root, const std::string& bus_id);
// The CUDA driver library (libcuda.so.1), loaded once with dlopen; nullptr without a driver.
void* cuda_driver();
// PCI bus id of CUDA device `ordinal` ("0000:3b:00.0" style, as the driver reports it) through
// the driver API, loaded with dlopen; "" without a driver or device.
std::string cuda_pci_bus_id(int ordinal);
// The NUMA node that holds the page at `addr` (get_mempolicy); -1 if unknown.
int numa_node_of(const void* addr);
// SLIT distance between two NUMA nodes (10 = same node); -1 if unknown.
int numa_distance(const std::string& root, int from, int to);
// How many PCI hops apart two sysfs device paths are (up to the common ancestor and down).
int pci_hops(const std::string& a, const std::string& b);
// The rails nearest to `mem` as a bit mask (bit i = nics[i]); every rail when their
// distances cannot be told apart (unknown locality or all equal).
uint32_t nearest_rails(const std::string& root, const Locality& mem, const std::vector<Locality>& nics);

}  // namespace sluice::detail::rdma
