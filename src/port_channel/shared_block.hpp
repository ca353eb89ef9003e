// Memory the port channel shares between its proxy (a host thread) and its producers (host
// threads or GPU threads), in the two kinds the producers need.
#pragma once

#include <cstddef>

#include "sluice/port_channel.hpp"

namespace sluice::detail {

// Read by both sides: the FIFO slots, the published tail, FIFO and channel state. Plain
// aligned host memory for host producers; cudaHostAlloc'd mapped memory for GPU producers
// (host() for the proxy, producer() for kernels). Zero filled.
class SharedBlock {
 public:
  SharedBlock(size_t bytes, ProducerKind kind, int device);
  ~SharedBlock();
  SharedBlock(const SharedBlock&) = delete;
  SharedBlock& operator=(const SharedBlock&) = delete;
  void* host() const { return host_; }
  void* producer() const { return producer_; }

 private:
  void* host_ = nullptr;
  void* producer_ = nullptr;
  ProducerKind kind_;
};

// Touched by producers only (FIFO head, cached tail, the count wait() consumed): host memory
// for host producers, device memory for GPU producers (atomics there stay on the GPU).
// Zero filled.
class ProducerBlock {
 public:
  ProducerBlock(size_t bytes, ProducerKind kind, int device);
  ~ProducerBlock();
  ProducerBlock(const ProducerBlock&) = delete;
  ProducerBlock& operator=(const ProducerBlock&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  ProducerKind kind_;
};

}  // namespace sluice::detail
