// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors for 128-byte-swizzled tiles and the
// m64n128k16 / m64n64k16 bf16 -> f32 instructions the kernels need. A warpgroup is 4 consecutive warps (128
// threads); every thread of it issues each instruction. Accumulator layout per warp (warp w % 4 of the group holds
// rows 16w..16w+15): for each 8-column chunk j, d[4j + 0..1] are row g, columns 8j + 2t + 0..1 and d[4j + 2..3] row
// g + 8 (g = lane / 4, t = lane % 4), as mma.sync's m16n8 fragments; a register A operand of 16 columns is mma.sync's
// m16k16 A fragment. Registers an MMA in flight reads or writes must not be touched before its wait (wgmma_pin).
//
// Tile layout in shared memory (what the descriptors describe): a part of 64 bf16 columns holds each row's 128 bytes
// at row * 128, its 16-byte chunk c stored at chunk c ^ (row % 8) (the hardware's 128-byte swizzle; every part starts
// 1024-byte aligned). K-major operands (rows = M or N, the 64 columns = K) step K by 16 with +32 bytes inside a part,
// and the next 64 K columns are the next part. An MN-major B (rows = K, columns = N) steps K by 16 rows (+2,048
// bytes) and N by 64 with the leading byte offset (the distance between parts).
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

// A 128-byte-swizzled descriptor: start address, leading byte offset, stride byte offset (8 rows: 1,024 bytes).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_address, uint32_t lbo_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulators across an async MMA's issue or wait.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N, int M>
__device__ __forceinline__ void wgmma_pin(uint32_t (&a)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// issue() (the wgmma instructions writing d) as one group, waited for: d pinned on both sides.
template <int N, class Issue>
__device__ __forceinline__ void wgmma_run(float (&d)[N], Issue&& issue) {
  wgmma_pin(d);
  wgmma_fence();
  issue();
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_pin(d);
}

// An accumulator's rows g and g + 8 (the layout above) times a0 and a1: an online softmax's rescale of O.
__device__ __forceinline__ void wgmma_scale_rows(float (&d)[64], float a0, float a1) {
#pragma unroll
  for (int i = 0; i < 64; i += 4) {
    d[i] *= a0;
    d[i + 1] *= a0;
    d[i + 2] *= a1;
    d[i + 3] *= a1;
  }
}

// One step of an online softmax (log2 space) over an S accumulator of N columns (the layout above; masked entries
// already -inf, at least one finite per row): m0 / m1, the running maxima of the scaled scores of rows g and g + 8,
// and l0 / l1, this thread's running sums of their exponentials, updated; S made into the probabilities in place;
// a0 / a1 the factors O's rows are to be rescaled by.
template <int N>
__device__ __forceinline__ void wgmma_online_softmax(float (&s)[N / 2], float scale, float& m0, float& m1, float& l0,
                                                     float& l1, float& a0, float& a1) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
  const float mn0 = fmaxf(m0, mx0 * scale), mn1 = fmaxf(m1, mx1 * scale);
  a0 = ex2_approx(m0 - mn0);
  a1 = ex2_approx(m1 - mn1);
  m0 = mn0;
  m1 = mn1;
  float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    s[4 * j] = ex2_approx(fmaf(s[4 * j], scale, -mn0));
    s[4 * j + 1] = ex2_approx(fmaf(s[4 * j + 1], scale, -mn0));
    s[4 * j + 2] = ex2_approx(fmaf(s[4 * j + 2], scale, -mn1));
    s[4 * j + 3] = ex2_approx(fmaf(s[4 * j + 3], scale, -mn1));
    rs0 += s[4 * j] + s[4 * j + 1];
    rs1 += s[4 * j + 2] + s[4 * j + 3];
  }
  l0 = l0 * a0 + rs0;
  l1 = l1 * a1 + rs1;
}

// The probabilities of an S accumulator of N columns as bf16 A fragments, one per 16 columns (for P V).
template <int N>
__device__ __forceinline__ void wgmma_pack_a(const float (&s)[N / 2], uint32_t (&pa)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk) {
    pa[kk][0] = pack_bf16x2(s[8 * kk], s[8 * kk + 1]);
    pa[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

#define MLASERVE_WG_D8(i)                                                                                     \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define MLASERVE_WG_D64                                                                                        \
  MLASERVE_WG_D8(0), MLASERVE_WG_D8(8), MLASERVE_WG_D8(16), MLASERVE_WG_D8(24), MLASERVE_WG_D8(32),            \
      MLASERVE_WG_D8(40), MLASERVE_WG_D8(48), MLASERVE_WG_D8(56)
#define MLASERVE_WG_W8(i)                                                                                     \
  "=f"(d[i]), "=f"(d[i + 1]), "=f"(d[i + 2]), "=f"(d[i + 3]), "=f"(d[i + 4]), "=f"(d[i + 5]), "=f"(d[i + 6]), \
      "=f"(d[i + 7])
#define MLASERVE_WG_W32 MLASERVE_WG_W8(0), MLASERVE_WG_W8(8), MLASERVE_WG_W8(16), MLASERVE_WG_W8(24)
#define MLASERVE_WG_D32 MLASERVE_WG_D8(0), MLASERVE_WG_D8(8), MLASERVE_WG_D8(16), MLASERVE_WG_D8(24)
#define MLASERVE_WG_R32                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MLASERVE_WG_R64                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "    \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (+)= A * B^T: A [64 x 16] and B [128 x 16], both K-major in shared memory. accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MLASERVE_WG_R64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : MLASERVE_WG_D64
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (+)= A * B: A [64 x 16] in registers (a warp's m16k16 fragment), B [16 x 128] MN-major in shared memory.
__device__ __forceinline__ void wgmma_m64n128k16_rs_mn(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                                       int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MLASERVE_WG_R64
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : MLASERVE_WG_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d (+)= A * B^T: A [64 x 16] and B [64 x 16], both K-major in shared memory. accumulate = 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MLASERVE_WG_R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : MLASERVE_WG_D32
      : "l"(a), "l"(b), "r"(accumulate));
}
// d = A * B^T, as above with nothing accumulated: d is only written (no copies of its old values are kept alive).
__device__ __forceinline__ void wgmma_m64n64k16_ss_first(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " MLASERVE_WG_R32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : MLASERVE_WG_W32
      : "l"(a), "l"(b));
}

#undef MLASERVE_WG_D8
#undef MLASERVE_WG_D32
#undef MLASERVE_WG_W8
#undef MLASERVE_WG_W32
#undef MLASERVE_WG_R32
#undef MLASERVE_WG_D64
#undef MLASERVE_WG_R64

}  // namespace mlaserve::cuda
