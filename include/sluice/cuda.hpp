// GPU helpers (present when libsluice was built with CUDA; on a CPU-only build or a host
// without a GPU, device_count() is 0 and the stream-ordered calls throw kNoDevice).
//
// Stream ordering: the *_on_stream calls enqueue the copies of a read / write on the caller's
// CUDA stream (cudaStream_t passed as void*), so they start after the work already queued on
// it and later work on that stream sees the data. The returned Future completes when the
// copies have finished. They are shorthands for Endpoint::read / write / write_with_imm with
// OpOptions::cuda_stream set; here a null stream means CUDA's legacy default stream (handle 0).
// Only endpoints whose transport has Capabilities::stream_ordered accept them (today nvlink);
// others throw kUnsupported.
#pragma once

#include <cstdint>
#include <string>

#include "sluice/endpoint.hpp"
#include "sluice/export.hpp"

namespace sluice::cuda {

// Usable CUDA devices (0 without a driver or GPU).
SLUICE_API int device_count();
// Why device_count() is 0 ("" when it is not).
SLUICE_API std::string unavailable_reason();
// Whether this build of libsluice has CUDA support at all.
SLUICE_API bool built_with_cuda();
// Whether `stream` (a cudaStream_t; nullptr = the legacy default stream) is being captured into
// a CUDA graph. Safe to call during a capture (cudaStreamIsCapturing); false without CUDA or
// when the query fails.
SLUICE_API bool stream_capturing(void* stream);

// The CUDA allocation that holds `ptr` (device memory only): its base, size, device and the
// driver's buffer id, which a new allocation never repeats even at the same address. Code
// that caches registrations per allocation (the torch backend) checks the id before reusing
// one: an allocation freed and another made at its address is a different buffer. False when
// `ptr` is not device memory (host memory, no GPU, or a build without CUDA).
struct Allocation {
  void* base = nullptr;
  uint64_t size = 0;
  int device = -1;
  uint64_t buffer_id = 0;
};
SLUICE_API bool allocation_of(const void* ptr, Allocation* out);

SLUICE_API Future read_on_stream(Endpoint& ep, const Batch& batch, void* stream);
SLUICE_API Future write_on_stream(Endpoint& ep, const Batch& batch, void* stream);
SLUICE_API Future write_with_imm_on_stream(Endpoint& ep, const Batch& batch, uint32_t imm, void* stream);

}  // namespace sluice::cuda
