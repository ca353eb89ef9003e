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
