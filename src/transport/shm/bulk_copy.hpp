// Copies between a process's own memory and a peer's mapped memfd region (reads, mapped
// writes, offered SENDs, a received SEND's parts). From `stream_min` bytes on they use
// non-temporal stores: such a destination is almost never in this core's cache (it is a large
// buffer, and whoever reads it next is another process on another core), and a plain copy
// first reads every destination line it writes. One 1 MiB copy into a cold 64 MiB slot range
// on the 2-vCPU host: 88 us with memcpy (rep movsb), 49 us with AVX2 streaming stores, 56 us
// with SSE2 ones (docs/peers.md, "Streaming stores").
#pragma once

#include <cstddef>

namespace sluice::detail::shm {

// memcpy below `stream_min` bytes (or when it is 0, off x86-64, or in a sanitizer build); above, streaming stores
// (AVX2 when the CPU has it, else SSE2) followed by a store fence, so that whatever the caller
// publishes after this returns (a frame, a completion) is ordered after the bytes.
void bulk_copy(void* dst, const void* src, size_t n, size_t stream_min);

}  // namespace sluice::detail::shm
