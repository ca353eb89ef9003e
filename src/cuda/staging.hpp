// Staging of CUDA memory through pinned host buffers, for transports that move bytes with
// the CPU (tcp, shm). No CUDA types here: the header is safe for any transport to include;
// without CUDA (stub build) every call throws kUnsupported.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "sluice/types.hpp"

namespace sluice::detail::staging {

inline bool is_device(const Location& loc) { return !loc.is_host(); }
// Whether this build and host can stage cuda memory at all (a CUDA build with a GPU).
bool available();
// Whether p is CUDA device memory (a pointer query; use on slow paths only).
bool is_device_ptr(const void* p);

// A pinned host buffer of at least n bytes (pooled; returned to the pool when released).
std::shared_ptr<uint8_t> pinned(uint64_t n);

// Synchronous copies between device memory and (preferably pinned) host memory. Throw Error.
void download(void* host, const void* device, uint64_t n);
void upload(void* device, const void* host, uint64_t n);

// Pinned host copy of n device bytes (download into a pooled pinned buffer).
std::shared_ptr<uint8_t> download_copy(const void* device, uint64_t n);

// Receive n bytes into device memory: `read(buf, k)` fills k bytes of a pinned chunk (false =
// the stream broke), each chunk is uploaded asynchronously while the next one is read
// (two chunks in flight). Returns false if a read failed; throws Error on CUDA errors.
bool receive(void* device, uint64_t n, const std::function<bool(void*, uint64_t)>& read);

}  // namespace sluice::detail::staging
