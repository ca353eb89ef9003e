// Small value types shared by the whole public API.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sluice/export.hpp"

namespace sluice {

// Where a region lives: host memory or the memory of CUDA device N.
struct SLUICE_API Location {
  enum class Kind : uint8_t { kHost = 0, kCuda = 1 };
  Kind kind = Kind::kHost;
  int device = -1;  // CUDA ordinal for kCuda; -1 for host

  static Location host() { return {}; }
  static Location cuda(int device) { return {Kind::kCuda, device}; }
  // "host", "cpu", "cuda", "cuda:N"; throws Error(kInvalidArgument) otherwise.
  static Location parse(std::string_view text);
  std::string to_string() const;
  bool is_host() const { return kind == Kind::kHost; }
  bool operator==(const Location&) const = default;
};

// Handle of a region registered with the local engine. An integer id, never a pointer;
// 0 is never a valid handle.
struct MemoryHandle {
  uint64_t id = 0;
  bool operator==(const MemoryHandle&) const = default;
};

// Handle of a region registered with a peer engine, as the peer advertised it (its id in
// the peer's registry). Look one up by name with Endpoint::remote_region().
struct RemoteHandle {
  uint64_t id = 0;
  bool operator==(const RemoteHandle&) const = default;
};

// One piece of a batch: `length` bytes between local region + local_offset and
// remote region + remote_offset.
struct Assignment {
  MemoryHandle local;
  uint64_t local_offset = 0;
  RemoteHandle remote;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

using Batch = std::vector<Assignment>;

enum class OpKind : uint8_t { kRead = 0, kWrite = 1, kWriteImm = 2, kSend = 3, kRecv = 4, kImmRecv = 5 };
SLUICE_API std::string_view to_string(OpKind kind);

// Per-operation options, passed with the op all the way to the transport (never through
// thread state). The default value asks for nothing, so ops without options behave as before.
struct OpOptions {
  // A cudaStream_t (as void*): the op's copies are enqueued on this stream, after the work
  // already queued on it, and later work on it sees the data; the op's Future completes when
  // the copies have finished. nullptr: not stream-ordered. The legacy default stream, whose
  // handle is 0, is passed as cudaStreamLegacy (or cudaStreamPerThread). Only transports with
  // Capabilities::stream_ordered accept it (others throw kUnsupported at submit).
  void* cuda_stream = nullptr;
  // Reserved for per-op behaviour bits; none is defined yet, and a set bit throws
  // kInvalidArgument (so that a future flag is never silently ignored by an older library).
  uint32_t flags = 0;
};

// What a transport can do (Endpoint::capabilities()). Code above the engine chooses its path
// from these, never from the transport's name.
struct Capabilities {
  bool host_memory = false;  // moves host regions
  bool cuda_memory = false;  // moves cuda:N regions (directly, or staged through host memory)
  // Honours OpOptions::cuda_stream on read / write / write_with_imm.
  bool stream_ordered = false;
  // Honours OpOptions::cuda_stream on send / recv (no transport does yet).
  bool stream_ordered_messages = false;
  bool imm = false;       // write_with_imm / imm_recv
  bool signal = false;    // a remote 64-bit add (semaphore) on the thin post path
  bool rma_post = false;  // the thin post path (post a write, post a signal, flush)
  bool operator==(const Capabilities&) const = default;
};

// A region as a peer advertises it in its info blob.
struct RegionInfo {
  uint64_t id = 0;
  uint64_t addr = 0;    // the owner's virtual address (used by single-copy transports)
  uint64_t length = 0;
  Location location;
  std::string name;     // optional
  bool shareable = false;  // engine-allocated memfd memory that same-host peers may map
};

}  // namespace sluice
