// The buffers of the native adapters and ceilings, backed as numpy backs the Python adapters'
// (numpy asks for transparent huge pages on arrays of 4 MiB and more): 2 MiB-aligned and
// madvise(MADV_HUGEPAGE), so that every engine and ceiling copies between the same kind of
// memory. It matters: process_vm_readv pins the pages it copies, one 4 KiB page at a time
// without huge pages, and the C++ adapter's CMA cells measured 1.6-2x slower on plain 4 KiB
// pages than the Python adapter's on numpy's (docs/peers.md, "The same memory for every
// engine"). PEERS_HUGEPAGES=0 turns it off here and in the Python adapters (common.py).
#pragma once

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static inline int peers_hugepages(void) {
  const char* v = getenv("PEERS_HUGEPAGES");
  return !(v && !strcmp(v, "0"));
}

// Zeroed (its pages made before any clock starts, as the engines' are); NULL on failure. free().
static inline void* peers_alloc(size_t n) {
  const size_t huge = (size_t)2 << 20, len = n ? (n + huge - 1) & ~(huge - 1) : huge;
  void* p = aligned_alloc(huge, len);
  if (!p) return NULL;
  if (peers_hugepages()) (void)madvise(p, len, MADV_HUGEPAGE);  // advice: no huge page is no error
  memset(p, 0, len);
  return p;
}
