// The target side of a post_signal that arrives as a request (tcp, shm and nvlink control
// frames): raise a 64-bit counter in a registered region, checked like any other target
// access (the region is registered, offset + 8 lies inside it, the offset is 8-byte aligned).
#pragma once

#include <cstdint>

#include "core/registry.hpp"
#include "sluice/error.hpp"

namespace sluice::detail {

// Host memory: one atomic add with release order (a waiter reading with acquire that sees
// the new value sees everything written before). CUDA memory (staged builds): read, add and
// write back through pinned memory; atomic against nothing but other signals that arrive the
// same way at this engine (they are applied under one lock).
Status apply_signal(const Registry& registry, uint64_t region, uint64_t offset, uint64_t add);

}  // namespace sluice::detail
