// Device-side building blocks shared by the NVLink kernels (the AllGather, the stream-ordered
// point-to-point messages): flag stores and loads with the ordering a reader on another GPU
// needs, and a block-wide copy.
#pragma once

#include <cstdint>

namespace sluice::cuda::dev {

__device__ __forceinline__ void st_v4(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_release(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Copy n bytes with 16-byte vectors when both sides allow it; `cg` loads bypass L1.
__device__ __forceinline__ void block_copy(uint8_t* dst, const uint8_t* src, uint64_t n, bool cg) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) & 15) == 0) {
    auto* d4 = reinterpret_cast<uint4*>(dst);
    auto* s4 = reinterpret_cast<const uint4*>(src);
    uint64_t n16 = n / 16;
    uint64_t i = threadIdx.x;
    for (; i + 3 * blockDim.x < n16; i += 4 * blockDim.x) {
      uint4 a, b, c, e;
      if (cg) {
        a = __ldcg(s4 + i);
        b = __ldcg(s4 + i + blockDim.x);
        c = __ldcg(s4 + i + 2 * blockDim.x);
        e = __ldcg(s4 + i + 3 * blockDim.x);
      } else {
        a = s4[i];
        b = s4[i + blockDim.x];
        c = s4[i + 2 * blockDim.x];
        e = s4[i + 3 * blockDim.x];
      }
      d4[i] = a;
      d4[i + blockDim.x] = b;
      d4[i + 2 * blockDim.x] = c;
      d4[i + 3 * blockDim.x] = e;
    }
    for (; i < n16; i += blockDim.x) d4[i] = cg ? __ldcg(s4 + i) : s4[i];
  } else {
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = cg ? __ldcg(reinterpret_cast<const char*>(src) + i) : src[i];
  }
}

}  // namespace sluice::cuda::dev
