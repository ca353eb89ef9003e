#include "transport/shm/bulk_copy.hpp"

#include <cstdint>
#include <cstring>

// Sanitizer builds copy with memcpy, which ASan and TSan check; they see nothing of the
// vector stores below, so a copy out of bounds or racing would go unnoticed there.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SLUICE_BULK_STREAM 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SLUICE_BULK_STREAM 0
#endif
#endif
#if !defined(SLUICE_BULK_STREAM) && defined(__x86_64__)
#define SLUICE_BULK_STREAM 1
#endif
#ifndef SLUICE_BULK_STREAM
#define SLUICE_BULK_STREAM 0
#endif

#if SLUICE_BULK_STREAM
#include <immintrin.h>
#endif

namespace sluice::detail::shm {

#if SLUICE_BULK_STREAM
namespace {

// d is 32-byte aligned and n a multiple of 128.
__attribute__((target("avx2"))) void stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
}

// d is 16-byte aligned and n a multiple of 128 (SSE2 is in every x86-64).
void stream_sse2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
}

bool has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();  // may run before the CPU model is set up otherwise
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}

}  // namespace
#endif

void bulk_copy(void* dst, const void* src, size_t n, size_t stream_min) {
#if SLUICE_BULK_STREAM
  if (stream_min != 0 && n >= stream_min && n >= 256) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
    std::memcpy(d, s, head);
    const size_t body = (n - head) & ~size_t(127);
    if (has_avx2())
      stream_avx2(d + head, s + head, body);
    else
      stream_sse2(d + head, s + head, body);
    std::memcpy(d + head + body, s + head + body, n - head - body);
    _mm_sfence();  // the streamed lines are globally visible before anything we publish next
    return;
  }
#else
  (void)stream_min;
#endif
  std::memcpy(dst, src, n);
}

}  // namespace sluice::detail::shm
