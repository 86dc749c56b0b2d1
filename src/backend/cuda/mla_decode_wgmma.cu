// MLA decode attention on Hopper warpgroup MMAs (wgmma.cuh), absorbed form, for head groups of 64 (kvr 512, rope
// 64): V2 / V3's 128 heads, which every rank keeps under --enable-dp-attention, are compute-bound on mma.sync
// (mla_decode.cu: ~120 TFLOP/s), where 16-head groups (V2-Lite) are bound by the cache's bytes. CPU reference:
// cpu::mla_attention (absorbed branch).
//
// A block takes one item (a token's split of keys, MlaDecodeItem) for 64 heads; an item's head groups are
// consecutive blocks, so they run together and its tiles come from DRAM about once. Three warpgroups:
//  - the producer: its first warp copies tiles of 64 cache rows by TMA (a 2-d tensor map over the cache's rows, boxes
//    of a page's rows (pages of a multiple of 8 rows) or 64, 128-byte swizzle: wgmma's layout) into two stages, a
//    lane per box, or one box of 64 rows where the tile's pages are consecutive (a second map); each of a stage's
//    9 parts of 64 columns lands on its own mbarrier (S starts on the first part while the others land), and the
//    stage is handed back on one. It gives its registers away (setmaxnreg 40 / 232).
//  - consumer 0 holds Q (64 heads x 576, in shared memory), issues S = Q K^T (36 k-steps of m64n64k16), runs the
//    online softmax (log2 space), hands P (bf16, as its MMA fragments) and the rows' rescale to consumer 1 through
//    shared memory (two named barriers) and computes O's columns [0, 256) += P V (P from registers, V read
//    MN-major from the same tile). It issues tile kt's P V, then tile kt + 1's S, and hands tile kt back once its
//    P V is done.
//  - consumer 1 computes O's columns [256, 512) from the same P.
// The last tile's rows past the item's keys are zeroed before P V reads them (their P is zero, but the rows of an
// unwritten page may hold NaN). Splits write normalised partial outputs + log2-sum-exp as the other kernels do.
// An FP8 cache (E4M3 / E5M2 codes, any page size): the producer copies each key's 576-byte code row by a bulk copy
// into two FP8 stages (where the second bf16 stage was); both consumers make each tile into the one bf16 tile
// (exact values, rows past the keys zero) once both are done with the tile before, then go on as above without
// overlapping a tile's S with the previous P V.
// Measured (docs/perf.md, forty-fourth session): bound by the tiles' copies (a build without MMAs is as fast);
// copying each tile once into a cluster of the two head groups (TMA multicast) was slower, its blocks in lockstep.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>

#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_out.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/tma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace mlaserve::cuda {

namespace {

namespace dw {
constexpr int HB = 64, BN = 64, D = 576, KVR = 512, ROPE = 64, PARTS = D / 64, PART = 128;
constexpr int PART_BYTES = 64 * PART;           // 64 rows (heads or keys) of one 64-column part
constexpr int TILE_BYTES = PARTS * PART_BYTES;  // Q, or one stage of 64 cache rows: 73,728 bytes
constexpr int P_WORDS = 16;                     // a consumer thread's P fragments (2 rows x 32 keys' pairs)
constexpr int THREADS = 384;                    // 2 consumer warpgroups + the producer
constexpr int BARS = 2 * PARTS + 2;            // per stage and part: landed; per stage: read
constexpr size_t smem_bytes = 1024 + 3 * TILE_BYTES + 128 * P_WORDS * 4 + 3 * HB * sizeof(float) + BARS * 8;
static_assert(smem_bytes <= 232448, "one block per SM");
}  // namespace dw

// CODES: the cache's type (None: bf16 rows, copied by TMA; E4M3 / E5M2: FP8 code rows, see the FP8 path above).
template <CacheCodes CODES>
__global__ void __launch_bounds__(dw::THREADS, 1)
    mla_decode_wgmma_kernel(const MlaDecodeParams p, const __grid_constant__ CUtensorMap cache_map,
                            const __grid_constant__ CUtensorMap run_map, int box_rows, bool runs) {
  using namespace dw;
  constexpr bool FP8 = CODES != CacheCodes::None;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // [9 parts][64 heads][128 B]
  uint8_t* sK = sQ + TILE_BYTES;  // [2][9 parts][64 keys][128 B]; FP8: [9 parts][64 keys][128 B], then sF8
  uint8_t* sF8 = sK + TILE_BYTES;  // FP8: [2][64 keys][576 codes]
  uint32_t* sP = reinterpret_cast<uint32_t*>(sK + 2 * TILE_BYTES);        // [16 words][128 threads]
  float* sA = reinterpret_cast<float*>(sP + 128 * P_WORDS);               // [64] the rescale of o for sP's tile
  float* sM = sA + HB;                                                     // [64] final maxima, sums
  float* sL = sM + HB;
  uint64_t* full = reinterpret_cast<uint64_t*>(sL + HB);                   // [2][9] a stage's part landed (FP8: [2])
  uint64_t* empty = full + 2 * PARTS;                                      // [2] a stage read (8 consumer warps)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Blocks of one item's head groups are consecutive, so they run together and read its tiles from L2 once.
  const int groups = p.num_heads / HB;
  const MlaDecodeItem it = p.items[blockIdx.x / groups];
  const int h0 = static_cast<int>(blockIdx.x % groups) * HB;
  if (empty_split(p, it, h0, HB)) return;
  const int num_keys = it.key_end - it.key_begin;
  const int n_tiles = (num_keys + BN - 1) / BN;
  const int last_keys = num_keys - (n_tiles - 1) * BN;  // keys of the last tile (1..64)
  if (tid == 0) {
    for (int i = 0; i < 2 * PARTS; ++i) mbar_init(&full[i], 1);
    for (int i = 0; i < 2; ++i) mbar_init(&empty[i], 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= 8) {  // the producer: tile kt into stage kt % 2 once tile kt - 2 there was read
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (warp == 8) {
      const int32_t* ptab = p.page_table + static_cast<int64_t>(it.seq) * p.max_pages;
      const int ps = p.page_size;
      for (int kt = 0; kt < n_tiles; ++kt) {
        const int stage = kt & 1, key0 = it.key_begin + kt * BN;
        if constexpr (FP8) {  // a code row (576 bytes) per key by bulk copies, two per lane; none past the keys
          const int rows = min(BN, it.key_end - key0);
          if (kt >= 2) mbar_wait(&empty[stage], ((kt >> 1) - 1) & 1);
          if (lane == 0) mbar_expect_tx(&full[stage], static_cast<uint32_t>(rows * D));
          __syncwarp();
          for (int r = lane; r < rows; r += 32) {
            const int key = key0 + r;
            const int64_t slot = static_cast<int64_t>(ptab[key / ps]) * ps + key % ps;
            bulk_copy_g2s(sF8 + (stage * BN + r) * D, p.cache_f8 + slot * D, D, &full[stage]);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(&full[stage]);
          continue;
        }
        const int nbox = (min(BN, it.key_end - key0) + box_rows - 1) / box_rows;
        uint64_t* bars = full + stage * PARTS;
        if (kt >= 2) mbar_wait(&empty[stage], ((kt >> 1) - 1) & 1);
        if (lane == 0)
          for (int part = 0; part < PARTS; ++part) {  // (each part's phase ends once its bytes have landed)
            mbar_expect_tx(&bars[part], static_cast<uint32_t>(nbox * box_rows * PART));
            mbar_arrive(&bars[part]);
          }
        __syncwarp();
        uint8_t* dst = sK + stage * TILE_BYTES;
        const int key = key0 + lane * box_rows;
        const int slot = lane < nbox ? ptab[key / ps] * ps + key % ps : 0;  // (box_rows >= 8: at most 8 boxes)
        // A whole tile whose boxes are consecutive cache rows (pages handed out in order) is one box of 64 rows.
        const int slot0 = __shfl_sync(0xffffffffu, slot, 0);
        if (runs && nbox * box_rows == BN && __all_sync(0xffffffffu, lane >= nbox || slot == slot0 + lane * box_rows)) {
          if (lane == 0)
            for (int part = 0; part < PARTS; ++part)
              tma_load(dst + part * PART_BYTES, &run_map, part * 64, slot0, &bars[part]);
        } else if (lane < nbox) {
          for (int part = 0; part < PARTS; ++part)  // parts in order: S starts on the first while the rest land
            tma_load(dst + part * PART_BYTES + lane * box_rows * PART, &cache_map, part * 64, slot, &bars[part]);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int grp = warp >> 2, ct = tid & 127, g = lane >> 2, t4 = lane & 3;
  const int r0 = (warp & 3) * 16 + g, r1 = r0 + 8;  // this thread's rows of the head group
  const bool tail = last_keys < BN;

  float oa[64], ob[64];  // O's columns grp * 256 + [0, 128) and + [128, 256)
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) oa[i] = ob[i] = 0.0f;

  auto wait_part = [&](int kt, int part) {  // (FP8: the tile is whole once converted)
    if constexpr (!FP8) mbar_wait(&full[(kt & 1) * PARTS + part], (kt >> 1) & 1);
  };
  auto tile = [&](int kt) { return FP8 ? sK : sK + (kt & 1) * TILE_BYTES; };
  auto wait_values = [&](int kt) {  // this warpgroup's 4 value parts of tile kt
    for (int part = grp * 4; part < grp * 4 + 4; ++part) wait_part(kt, part);
  };
  auto release = [&](int kt) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[kt & 1]);
  };
  // The last tile's rows past the keys, in this warpgroup's 4 value parts: zeros.
  auto zero_tail = [&](int kt) {
    uint8_t* st = tile(kt) + grp * 4 * PART_BYTES;
    const int chunks = (BN - last_keys) * 8;  // 16-byte chunks per part
    for (int i = ct; i < 4 * chunks; i += 128) {
      const int part = i / chunks, rem = i % chunks;
      *reinterpret_cast<uint4*>(st + part * PART_BYTES + (last_keys + rem / 8) * PART + (rem % 8) * 16) =
          make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    named_bar_sync(3 + grp, 128);
  };
  // FP8: tile kt's codes made into the bf16 tile (their exact values; rows past the keys zero) by both consumer
  // warpgroups, once both are done with the tile before; the FP8 stage is handed back at once.
  auto convert = [&](int kt) {
    if (kt > 0) named_bar_sync(6, 256);  // both warpgroups' MMAs on tile kt - 1 are done
    mbar_wait(&full[kt & 1], (kt >> 1) & 1);
    const int rows = min(BN, it.key_end - (it.key_begin + kt * BN));
    const uint8_t* src = sF8 + (kt & 1) * BN * D;
    for (int c = tid; c < BN * (D / 16); c += 256) {
      const int r = c / (D / 16), cc = c % (D / 16);  // 16 codes: columns 16 cc .. 16 cc + 15
      uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
      if (r < rows) {
        const uint4 q = *reinterpret_cast<const uint4*>(src + r * D + cc * 16);
        cache_codes4_bf16(q.x, lo.x, lo.y, CODES);
        cache_codes4_bf16(q.y, lo.z, lo.w, CODES);
        cache_codes4_bf16(q.z, hi.x, hi.y, CODES);
        cache_codes4_bf16(q.w, hi.z, hi.w, CODES);
      }
      uint8_t* row = sK + (cc >> 2) * PART_BYTES + r * PART;
      const int ch = (cc & 3) * 2;  // the part's 16-byte chunks ch and ch + 1, swizzled
      *reinterpret_cast<uint4*>(row + ((ch ^ (r & 7)) << 4)) = lo;
      *reinterpret_cast<uint4*>(row + (((ch + 1) ^ (r & 7)) << 4)) = hi;
    }
    fence_proxy_async();
    release(kt);
    named_bar_sync(5, 256);  // the bf16 tile is whole
  };
  auto issue_pv = [&](int kt) {  // O[:, grp * 256 ...] += P V (P from registers, V MN-major: keys x columns)
    const uint32_t v_base = smem_addr(tile(kt)) + grp * 4 * PART_BYTES;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_m64n128k16_rs_mn(oa, pa[kk], wgmma_desc(v_base + kk * 16 * PART, PART_BYTES), 1);
      wgmma_m64n128k16_rs_mn(ob, pa[kk], wgmma_desc(v_base + 2 * PART_BYTES + kk * 16 * PART, PART_BYTES), 1);
    }
  };
  auto rescale = [&](float a0, float a1) {
    wgmma_scale_rows(oa, a0, a1);
    wgmma_scale_rows(ob, a0, a1);
  };
  // O rescaled, then tile kt's P V, waited for (the FP8 path and warpgroup 1: nothing to overlap it with).
  auto pv_step = [&](int kt, float a0, float a1) {
    rescale(a0, a1);
    wgmma_pin(oa);
    wgmma_pin(ob);
    wgmma_pin(pa);
    wgmma_fence();
    issue_pv(kt);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_pin(oa);
    wgmma_pin(ob);
    wgmma_pin(pa);
  };
  auto store = [&](float inv0, float inv1) {
    const int col = grp * 256 + 2 * t4;
    store_output<16>(p, it, h0, r0, col, HB, *reinterpret_cast<const float(*)[16][4]>(&oa), inv0, inv1);
    store_output<16>(p, it, h0, r0, col + 128, HB, *reinterpret_cast<const float(*)[16][4]>(&ob), inv0, inv1);
  };

  if (grp == 0) {
    // Q: 64 heads x [q_lat (512) | q_pe (64)], 72 chunks of 16 bytes per row, swizzled into 9 parts.
    for (int c = ct; c < HB * (D / 8); c += 128) {
      const int r = c / (D / 8), ch = c % (D / 8), col = ch * 8;
      const int64_t th = static_cast<int64_t>(it.token) * p.num_heads + h0 + r;
      const bf16* src = col < KVR ? p.q_lat + th * KVR + col : p.q + th * (p.nope + ROPE) + p.nope + (col - KVR);
      cp_async16(sQ + (ch >> 3) * PART_BYTES + r * PART + (((ch & 7) ^ (r & 7)) << 4), src, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_bar_sync(3, 128);

    const float scale = p.softmax_scale * kLog2e;
    const uint32_t q_base = smem_addr(sQ);
    float s[32];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // running maxima of the scaled scores, sums
    auto issue_s = [&](int kt) {
      const uint32_t k_base = smem_addr(tile(kt));
      const uint64_t qd = wgmma_desc(q_base, 16), kd = wgmma_desc(k_base, 16);  // + 32 bytes: + 2 in a descriptor
      wait_part(kt, 0);
      wgmma_m64n64k16_ss_first(s, qd, kd);
#pragma unroll
      for (int kk = 1; kk < 4; ++kk) wgmma_m64n64k16_ss(s, qd + 2 * kk, kd + 2 * kk, 1);
#pragma unroll 1
      for (int part = 1; part < PARTS; ++part) {  // (not unrolled: 36 descriptors would stay in registers)
        const uint64_t off = part * (PART_BYTES >> 4);
        wait_part(kt, part);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_m64n64k16_ss(s, qd + off + 2 * kk, kd + off + 2 * kk, 1);
      }
    };
    // Tile kt's S (in s) -> P (pa, and to warpgroup 1 with the rows' rescale); returns the rescale of o.
    auto softmax_send = [&](int kt) {
      if (tail && kt == n_tiles - 1) {  // keys past the item's end
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int k = 8 * j + 2 * t4;
          if (k >= last_keys) s[4 * j] = s[4 * j + 2] = -INFINITY;
          if (k + 1 >= last_keys) s[4 * j + 1] = s[4 * j + 3] = -INFINITY;
        }
      }
      float a0, a1;
      wgmma_online_softmax<BN>(s, scale, m0, m1, l0, l1, a0, a1);
      wgmma_pack_a<BN>(s, pa);
      if (kt > 0) named_bar_sync(2, 256);  // warpgroup 1 has read the previous tile's P
#pragma unroll
      for (int w = 0; w < P_WORDS; ++w) sP[w * 128 + ct] = pa[w >> 2][w & 3];
      if (t4 == 0) {
        sA[r0] = a0;
        sA[r1] = a1;
      }
      named_bar_arrive(1, 256);
      return make_float2(a0, a1);
    };
    if constexpr (FP8) {
      for (int kt = 0; kt < n_tiles; ++kt) {
        convert(kt);
        wgmma_run(s, [&] { issue_s(kt); });
        const float2 a = softmax_send(kt);
        pv_step(kt, a.x, a.y);
      }
    } else {
      // bf16: tile kt's P V issued, then tile kt + 1's S.
      if (tail && n_tiles == 1) {
        wait_values(0);
        zero_tail(0);
      }
      wgmma_run(s, [&] { issue_s(0); });
      for (int kt = 0; kt < n_tiles; ++kt) {
        const float2 a = softmax_send(kt);
        const float a0 = a.x, a1 = a.y;
        rescale(a0, a1);
        wgmma_pin(oa);
        wgmma_pin(ob);
        wgmma_pin(s);
        wgmma_pin(pa);
        wgmma_fence();
        issue_pv(kt);
        wgmma_commit();
        if (kt + 1 < n_tiles) {
          if (tail && kt + 1 == n_tiles - 1) {
            wait_values(kt + 1);
            zero_tail(kt + 1);
          }
          issue_s(kt + 1);
          wgmma_commit();
          wgmma_wait<1>();  // P V of tile kt (S of tile kt + 1 may still run)
        } else {
          wgmma_wait<0>();
        }
        wgmma_pin(oa);
        wgmma_pin(ob);
        wgmma_pin(pa);  // (read by the MMAs until here: not to be reused before)
        release(kt);
        wgmma_wait<0>();
        wgmma_pin(s);
      }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    named_bar_sync(2, 256);  // warpgroup 1 has read the last P
    if (t4 == 0) {
      sM[r0] = m0;
      sM[r1] = m1;
      sL[r0] = l0;
      sL[r1] = l1;
    }
    named_bar_arrive(1, 256);
    store(1.0f / l0, 1.0f / l1);
    if (it.partial >= 0 && t4 == 0) {
      float* lse = p.partial_lse + static_cast<int64_t>(it.partial) * p.num_heads + h0;
      lse[r0] = m0 + log2f(l0);
      lse[r1] = m1 + log2f(l1);
    }
    return;
  }

  // Warpgroup 1: O's columns [256, 512) from warpgroup 0's P; each tile's stage handed back as soon as its P V ends.
  for (int kt = 0; kt < n_tiles; ++kt) {
    if constexpr (FP8) convert(kt);
    named_bar_sync(1, 256);  // P of tile kt
#pragma unroll
    for (int w = 0; w < P_WORDS; ++w) pa[w >> 2][w & 3] = sP[w * 128 + ct];
    const float a0 = sA[r0], a1 = sA[r1];
    named_bar_arrive(2, 256);
    if constexpr (!FP8) {
      wait_values(kt);
      if (tail && kt == n_tiles - 1) zero_tail(kt);
    }
    pv_step(kt, a0, a1);
    if constexpr (!FP8) release(kt);
  }
  named_bar_sync(1, 256);  // the final sums
  store(1.0f / sL[r0], 1.0f / sL[r1]);
}

}  // namespace

cudaError_t mla_decode_wgmma_prepare() {
  static std::atomic<uint64_t> configured[3];  // per instantiation, one bit per device
  const int bytes = static_cast<int>(dw::smem_bytes);
  for (cudaError_t e : {set_max_dynamic_smem_once(mla_decode_wgmma_kernel<CacheCodes::None>, bytes, configured[0]),
                        set_max_dynamic_smem_once(mla_decode_wgmma_kernel<CacheCodes::E4M3>, bytes, configured[1]),
                        set_max_dynamic_smem_once(mla_decode_wgmma_kernel<CacheCodes::E5M2>, bytes, configured[2])})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

cudaError_t mla_decode_wgmma(const MlaDecodeParams& p, cudaStream_t stream, bool& launched) {
  launched = false;
  // (q's rope part is copied in 16-byte chunks: nope a multiple of 8)
  if (p.num_slots <= 0 || !(p.cache || p.cache_f8) || p.num_heads % dw::HB != 0 || p.kvr != dw::KVR ||
      p.rope != dw::ROPE || p.nope % 8 != 0 || p.page_size <= 0)
    return cudaSuccess;
  const CacheCodes codes = cache_codes(p.cache_f8, p.cache_e5m2);
  const unsigned grid = static_cast<unsigned>(p.num_items) * static_cast<unsigned>(p.num_heads / dw::HB);
  CUtensorMap map{}, run_map{};  // (an FP8 cache's rows are bulk copies: no map)
  int box_rows = 0;
  bool runs = false;
  if (codes == CacheCodes::None) {
    // A box is a page's rows (consecutive slots) within a 64-key tile; the splits start on 64-key bounds.
    box_rows = std::gcd(p.page_size, dw::BN);
    if (box_rows < 8) return cudaSuccess;
    const uint64_t dims[2] = {dw::D, static_cast<uint64_t>(p.num_slots)}, strides[1] = {dw::D * 2};
    const uint32_t box[2] = {64, static_cast<uint32_t>(box_rows)};
    if (encode_map<2>(map, p.cache, dims, strides, box) != cudaSuccess) return cudaSuccess;
    // Smaller pages: a second map whose box is a whole tile, for tiles over consecutive pages.
    const uint32_t run_box[2] = {64, dw::BN};
    runs = p.page_runs && box_rows < dw::BN && p.num_slots >= dw::BN &&
           encode_map<2>(run_map, p.cache, dims, strides, run_box) == cudaSuccess;
  }
  if (cudaError_t e = mla_decode_wgmma_prepare(); e != cudaSuccess) return e;
  launched = true;
  auto kernel = codes == CacheCodes::E4M3   ? mla_decode_wgmma_kernel<CacheCodes::E4M3>
                : codes == CacheCodes::E5M2 ? mla_decode_wgmma_kernel<CacheCodes::E5M2>
                                            : mla_decode_wgmma_kernel<CacheCodes::None>;
  kernel<<<grid, dw::THREADS, dw::smem_bytes, stream>>>(p, map, run_map, box_rows, runs);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
