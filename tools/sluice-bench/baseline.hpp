// Ceilings measured in the same run as the engine: what the hardware path gives with no
// engine in the way. Each one runs its peer in a forked child.
#pragma once

#include <cstdint>

namespace bench {

// Raw loopback TCP stream: one connection, blocking write() of `chunk` bytes until `total`
// bytes are sent, receiver acks at the end. Both sides walk `footprint`-byte buffers (the
// memory the engine's batches touch), so both run in the same cache/DRAM regime. MB/s (1e6).
double tcp_stream_mbps(uint64_t chunk, uint64_t total, uint64_t footprint);
// Raw socket ping-pong of `size` bytes; returns the mean round trip in microseconds.
double tcp_pingpong_us(uint64_t size, int iterations);
// process_vm_readv of `size` bytes (one iovec per call) from a child's buffer of `footprint`
// bytes, walking it like the engine's batches do (so both see the same cache/DRAM regime). MB/s.
double cma_read_mbps(uint64_t size, uint64_t footprint, int iterations);
// Single-thread memcpy of `size`-byte pieces walking two `footprint`-byte buffers. MB/s.
double memcpy_mbps(uint64_t size, uint64_t footprint, int iterations);

}  // namespace bench
