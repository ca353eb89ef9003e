// The reductions of the sluice backend's collectives, shared by the host algorithms
// (collectives.cpp) and the device path (device_reductions.cpp). Every reduction combines the
// contributions in rank order, so every rank, and both paths, produce the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace sluice::torch_backend {

using Red = c10d::ReduceOp::RedOpType;

// all_reduce: at most this many bytes, every rank gets every contribution and reduces locally;
// more, reduce-scatter (rank j owns chunk j) then all-gather. The host and the device paths
// must agree: a rank that stages a call meets peers that do not, message for message.
inline constexpr uint64_t kDirectAllreduceBytes = 64 << 10;

// all_reduce's chunk j of `numel` elements at world `n` for the reduce-scatter algorithm:
// [first, first + count). Chunks are ceil(numel / n) long; the last ones may be short or empty.
struct Chunk {
  int64_t first, count;
};
inline Chunk allreduce_chunk(int64_t numel, int n, int j) {
  const int64_t per = (numel + n - 1) / n;
  const int64_t lo = std::min(numel, per * j), hi = std::min(numel, per * (j + 1));
  return {lo, hi - lo};
}

// Refuses an op the backend does not support, or one `t`'s dtype does not allow, naming `what`.
void check_op(const at::Tensor& t, const c10d::ReduceOp& op, const char* what);

// acc = acc op x, in place (on acc's device, on the current stream for CUDA tensors).
void combine(at::Tensor& acc, const at::Tensor& x, Red op);

// dst = parts[0] op parts[1] op ... (rank order), where parts[self] is dst itself and the
// others are buffers this call may overwrite: the result builds in dst when it starts there,
// otherwise in parts[0], with no new tensor. AVG divides by `world` at the end.
void reduce_in_order(at::Tensor dst, std::vector<at::Tensor>& parts, Red op, int world, int self);

}  // namespace sluice::torch_backend
