// bulk_copy (src/transport/shm/bulk_copy.hpp): streaming stores from a threshold on, memcpy
// below it. Every byte of the destination is the source's, at any alignment of either side and
// any length around the vector widths, and nothing before or after the destination is touched.
#include "transport/shm/bulk_copy.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

using sluice::detail::shm::bulk_copy;

constexpr size_t kGuard = 192;

void check(size_t n, size_t dst_off, size_t src_off, size_t stream_min) {
  std::vector<uint8_t> src(n + src_off + 64), dst(n + dst_off + 2 * kGuard);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  std::fill(dst.begin(), dst.end(), 0xA5);
  bulk_copy(dst.data() + kGuard + dst_off, src.data() + src_off, n, stream_min);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(dst[kGuard + dst_off + i], src[src_off + i])
        << "byte " << i << " of " << n << " (dst +" << dst_off << ", src +" << src_off << ", stream_min " << stream_min << ")";
  for (size_t i = 0; i < kGuard + dst_off; ++i) ASSERT_EQ(dst[i], 0xA5) << "written before the destination";
  for (size_t i = kGuard + dst_off + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xA5) << "written past the destination";
}

TEST(BulkCopy, EveryLengthAndAlignmentAroundTheVectorWidths) {
  const size_t lengths[] = {0, 1, 31, 32, 127, 128, 255, 256, 257, 383, 4095, 4096, 65535, 65536, 65536 + 77};
  for (size_t stream_min : {size_t{0}, size_t{1}, size_t{256}, size_t{65536}})
    for (size_t n : lengths)
      for (size_t dst_off : {0, 1, 16, 31, 33})
        for (size_t src_off : {0, 3, 32})
          check(n, dst_off, src_off, stream_min);
}

TEST(BulkCopy, ALargeCopyThatStreams) {
  check((1 << 20) + 13, 7, 5, 64 << 10);
  check(4 << 20, 0, 0, 64 << 10);
}

}  // namespace
