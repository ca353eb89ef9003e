// Splitting a batch into pieces and striping them over an endpoint's channels.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/inline_vec.hpp"

namespace sluice::detail {

// One contiguous transfer after validation: local address resolved, remote still by handle.
struct Piece {
  uint8_t* local = nullptr;
  uint64_t remote_id = 0;
  uint64_t remote_offset = 0;
  uint64_t remote_addr = 0;  // the peer's virtual address of remote_offset (single-copy transports)
  uint64_t length = 0;
};

struct Lane {
  InlineVec<Piece, 1> pieces;  // a small batch is one piece: no allocation for it
  uint64_t bytes = 0;
};

struct PlanOptions {
  int channels = 1;
  uint64_t chunk_size = 4ull << 20;       // no piece is longer than this
  uint64_t stripe_threshold = 256ull << 10;  // smaller batches stay on one channel
  uint64_t min_piece = 64ull << 10;       // striping never cuts pieces smaller than this
  unsigned rotate = 0;                    // channel that unstriped batches use (round robin)
};

// Returns `channels` lanes (some may be empty). Pieces keep batch order within each lane;
// every byte of the input appears exactly once.
std::vector<Lane> plan_batch(std::span<const Piece> batch, const PlanOptions& opt);

}  // namespace sluice::detail
