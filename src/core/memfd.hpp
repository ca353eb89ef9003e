// Engine-allocated shared memory: a memfd sized once and sealed against resizing.
#pragma once

#include <cstdint>

namespace sluice::detail {

// A memfd of exactly `bytes`, sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, or -1
// (errno set). Peers map such a descriptor and load from it: had it no shrink seal, its owner
// could truncate it under their mappings and their next access would raise SIGBUS. Peers
// refuse a descriptor without that seal (same_host::is_memfd).
int sealed_memfd(const char* name, uint64_t bytes);

}  // namespace sluice::detail
