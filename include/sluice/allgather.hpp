// Intra-node low-latency AllGather over NVLink (CUDA builds; throws kNoDevice without a GPU).
//
// One object per rank, built with the largest per-rank message (max_tokens x token_bytes).
// Construction allocates the only device memory it will ever use: a receive buffer the peers
// write into. Exchange handle() strings between ranks (any bootstrap: torch.distributed,
// files, the engine's endpoints), pass all of them to connect(), then call all_gather() as
// often as needed. Calls allocate nothing, are stream ordered and can be captured into CUDA
// graphs. Every rank must issue the same sequence of calls with the same sizes, and the calls
// of one rank must be ordered (one stream, or streams ordered by events).
//
// Data moves as NVLink stores from the sender's SMs into the receivers' buffers: up to
// ll_max_bytes() per rank with the LL protocol (flag-in-data 16-byte packets, no fences), above
// it in chunks published with release/acquire flags, the receiver copying each chunk out as
// soon as it lands.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sluice/export.hpp"

namespace sluice::cuda {

enum class DType : int { kUInt8 = 0, kInt8, kFloat16, kBFloat16, kFloat32, kInt32, kInt64, kFloat64 };
SLUICE_API size_t dtype_size(DType t);

class SLUICE_API AllGather {
 public:
  // max_tokens x token_bytes: the largest message one rank contributes, in bytes.
  AllGather(uint64_t max_tokens, uint64_t token_bytes, DType dtype, int world_size, int rank, int device);
  ~AllGather();
  AllGather(const AllGather&) = delete;
  AllGather& operator=(const AllGather&) = delete;

  // Opaque, printable: this rank's receive buffer for the peers.
  std::string handle() const;
  // handles[r] = rank r's handle() (this rank's own entry is ignored).
  void connect(const std::vector<std::string>& handles);
  // A simple bootstrap instead of connect(): rank 0 listens on root ("host:port"), the others
  // connect to it (retrying until the timeout), handles are exchanged, then connect().
  void bootstrap(const std::string& root, std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // out[r * count + i] = rank r's in[i] for count elements of dtype; `stream` is a
  // cudaStream_t (nullptr = the legacy default stream).
  void all_gather(const void* in, void* out, uint64_t count, void* stream);
  // Same with a byte count.
  void all_gather_bytes(const void* in, void* out, uint64_t bytes, void* stream);

  // Bound of every wait for a peer's data inside the kernels (0, the default: wait as long as
  // it takes). A wait that runs out sets a flag and the kernel returns with the output
  // incomplete; timed_out() then says so (after a stream synchronize) and the object must not
  // be used again. Takes effect for calls issued (or captured) after it.
  void set_timeout(std::chrono::milliseconds timeout);
  bool timed_out() const;

  uint64_t max_bytes() const;
  uint64_t ll_max_bytes() const;
  int world_size() const;
  int rank() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace sluice::cuda
