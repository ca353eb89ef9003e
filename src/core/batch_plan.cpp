#include "core/batch_plan.hpp"

#include <algorithm>

namespace sluice::detail {

std::vector<Lane> plan_batch(std::span<const Piece> batch, const PlanOptions& opt) {
  const int n = std::max(1, opt.channels);
  std::vector<Lane> lanes(n);
  uint64_t total = 0;
  for (const auto& p : batch) total += p.length;

  const bool stripe = n > 1 && total > opt.stripe_threshold;
  uint64_t piece = std::max<uint64_t>(opt.chunk_size, 1);
  if (stripe) {
    // Aim for several pieces per channel so channels finish together, but never cut below
    // min_piece (per-piece overhead) or above chunk_size.
    uint64_t share = (total + n * 4 - 1) / (n * 4);
    share = (share + 4095) & ~uint64_t(4095);
    piece = std::clamp<uint64_t>(share, std::min(opt.min_piece, piece), piece);
  }

  unsigned next = opt.rotate % n;
  for (const auto& p : batch) {
    uint64_t done = 0;
    do {
      uint64_t len = std::min(piece, p.length - done);
      Piece q = p;
      q.local = p.local + done;
      q.remote_offset = p.remote_offset + done;
      q.remote_addr = p.remote_addr ? p.remote_addr + done : 0;
      q.length = len;
      Lane& lane = lanes[next];
      lane.pieces.push_back(q);
      lane.bytes += len;
      done += len;
      if (stripe) next = (next + 1) % n;
    } while (done < p.length);
  }
  return lanes;
}

}  // namespace sluice::detail
