// A 4-bit linear layer on the GGUF's own Q4_1 blocks whose every row has the same bits whatever else the call
// holds: y = x · W^T (+ (x · A) · U), W the Q4_1 weights, A and U the layer's unmerged LoRA (U = scaling · B^T).
//
// Weights (packed once at export by runtime/ops/q4_linear.py pack(), no re-quantization): TILE = 16 output columns
// by BLOCK = 32 inputs make one tile-block of 320 bytes, exactly the 16 GGUF blocks' bytes:
//   bytes [64j, 64j + 64), j = 0..3: byte 4c + i holds column c's code k = 4j + i in its low nibble and code
//     k = 4(j + 4) + i in its high nibble (so one 64-byte load unpacks into two groups of 4 inputs x 16 columns);
//   bytes [256, 288): the 16 columns' scales d (fp16); bytes [288, 320): their minimums m (fp16).
// Tile-blocks run block by block within a tile and tile after tile, so a thread streams its columns in order.
// A weight is w = d·q + m, q in 0..15.
//
// Activations are quantized once per call, row by row and block by block (llama.cpp's q8_1 idea):
//   xd = max|x| / 127, q = round-half-even(x · (1 / xd)) clamped to [-127, 127] (0 where xd is 0 or q is NaN),
//   xs = xd · Σ q.
// Row r, column n: acc = 0, then for each block b in order
//   acc = acc + ((d · xd) · float(Σ_i q_w,i · q_x,i) + m · xs)        (the integer sum is exact in any order)
// and y = acc + lora, lora = 0 then lora = lora + xa_j · U[j, n] for j in column n's segment's rank range in
// order, xa_j = Σ_k x_k · A[k, j] in order of k (fp32, from 0). Every float operation is a separate rounding
// (built with -ffp-contract=off, no fast-math), so the NumPy reference in runtime/ops/q4_linear.py repeats it bit for
// bit. Threads split the columns (tiles) only and every path (AVX-512 VNNI, AVX2, portable) computes the same
// integers and the same float operations lane by lane: a row's bits depend on nothing but that row, the weights
// and the LoRA.
//
// Segments (rank_splits): one node may hold several layers that read the same x (q / k / v, gate / up: packed by
// export/onnx_pack.py), each with its own LoRA. rank_splits [S, 2] int64 lists them in order as (tiles, rank):
// segment s owns the next tiles_s output tiles and the next rank_s columns of A, and U holds each segment's
// [tiles_s, rank_s, 16] block after the last (U [Σ tiles_s · rank_s, 16]: no zeros for the other layers' ranks).
// A column sums only its own segment's rank terms, in their order: exactly its own layer's sum (xa_j does not
// depend on the other columns of A). An unpacked layer is one segment, (tiles, rank).
// The former packed form (ranks side by side, U block-diagonal, one segment) gives the same bits wherever xa is
// finite: a term of another layer's rank is xa_j · 0 = ±0, and adding ±0 to the partial sum leaves a finite
// non-zero sum as it is and turns a +0 sum into +0 (+0 + -0 = +0 in round-to-nearest), so before a column's own
// terms the sum stays the +0 it starts from, and after them it is unchanged unless it is -0 (then +0 or -0 by
// xa_j's sign, and y = acc + lora differs only when acc is -0 too). Skipping them skips only that work (2/3 of a
// packed q / k / v's LoRA loop); an infinite or NaN xa_j, which made every column of the former form NaN
// (inf · 0), now reaches only its own layer's columns, as it does unpacked.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "boundary.h"
#include "q4_prepare.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STREAMFUSE_X86 1
#endif

namespace streamfuse::q4 {

constexpr int64_t BLOCK = 32, TILE = 16, TILE_BYTES = 320, SCALES_AT = 256, MINS_AT = 288;
static_assert(QUANT_BLOCK == BLOCK, "q4_prepare.h quantizes the blocks the tiles read");
constexpr int64_t ROW_CHUNK = 8;  // rows that share one unpacked tile-block in registers
constexpr int64_t MAX_SEGMENTS = 64;  // layers in one node (a packed one holds 2 or 3)
// Tile-blocks ahead that a path asks the memory for while it computes this one: a call streams its weights from
// memory once, and the hardware's prefetch alone leaves the cores waiting (all linears of a call, 2 threads,
// streamfuse q4-bench --scope call: 1 row 6.17 ms against 6.63 without, 4 rows 7.77 against 8.80; 4 to 16
// ahead are within 3 %).
constexpr int64_t PREFETCH = 8;

// Asks for the cache lines of the tile-block `PREFETCH` ahead of `tile` (a hint: never a fault, past the end too).
// Always inlined: otherwise GCC left it out of the AVX-512 rows below (seen in their disassembly).
__attribute__((always_inline)) inline void prefetch_ahead(const void* tile, int64_t bytes) {
#ifdef STREAMFUSE_X86
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(tile) + static_cast<uintptr_t>(PREFETCH * bytes);  // no pointer
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
#else
  (void)tile;
  (void)bytes;
#endif
}

enum Path : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512Vnni = 3 };

// One layer's part of a node (rank_splits' row, with where it starts): tiles [first_tile, first_tile + tiles),
// the rank columns [first_rank, first_rank + rank) of A (and of xa), U's elements from `up_at`.
struct Segment {
  int64_t first_tile, tiles, first_rank, rank, up_at;
};

struct Segments {
  int64_t count = 0;
  Segment at[MAX_SEGMENTS];
};

struct Args {
  const int8_t* xq;        // [rows, K] quantized activations
  const float* xd;         // [rows, K / 32] their block scales
  const float* xs;         // [rows, K / 32] xd · Σ q per block
  const uint8_t* weights;  // [tiles, K / 32, TILE_BYTES]
  const float* xa;         // [rows, rank] x · A, or null when rank is 0
  const float* up;         // [Σ tiles_s · rank_s, TILE] U by segment and tile
  float* out;              // [rows, N]
  int64_t rows, in_features, out_features, rank;
  const Segments* segments;
};

inline int64_t tiles_of(int64_t out_features) { return (out_features + TILE - 1) / TILE; }

// Tile t's LoRA: its segment's U block for t, its rank columns' offset in an xa row and their count.
struct TileLora {
  const float* up;
  int64_t first_rank, rank;
};

inline TileLora lora_of(const Args& a, int64_t t) {
  const Segment* s = a.segments->at;
  int64_t low = 0, high = a.segments->count - 1;  // the last segment whose first tile is <= t
  while (low < high) {
    const int64_t middle = (low + high + 1) / 2;
    if (s[middle].first_tile <= t) low = middle; else high = middle - 1;
  }
  const Segment& own = s[low];
  return {a.up + own.up_at + (t - own.first_tile) * own.rank * TILE, own.first_rank, own.rank};
}

// Whether a call's sizes are sound: every buffer's size follows from these, so the validators check the buffers
// against them (and the products below cannot overflow once these pass).
inline bool sizes_valid(const char* op, int64_t rows, int64_t in_features, int64_t out_features, int64_t rank,
                        Error& error) {
  if (rows < 0 || rows > (int64_t{1} << 20)) return error.set("%s: rows must be in [0, 2^20]", op);
  if (in_features <= 0 || in_features % BLOCK != 0 || in_features > (int64_t{1} << 20)) {
    return error.set("%s: in_features must be a positive multiple of 32, at most 2^20, got %lld", op,
                     (long long)in_features);
  }
  if (out_features <= 0 || out_features > (int64_t{1} << 24)) {
    return error.set("%s: out_features must be in [1, 2^24], got %lld", op, (long long)out_features);
  }
  if (rank < 0 || rank > 4096) return error.set("%s: the LoRA rank must be in [0, 4096]", op);
  if (rows * in_features > (int64_t{1} << 28) || rows * rank > (int64_t{1} << 28)) {
    return error.set("%s: a call's rows x in_features (or x rank) must be at most 2^28", op);  // its scratch
  }
  return true;
}

inline float half_to_float(uint16_t h) {  // exact; no F16C needed on the portable path
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Row by row, block by block: xq, xd, xs (and the integer sums, where asked) from x [rows, K] (see the top of the
// file), on `path`'s vector units (q4_prepare.h: the same bits on each).
inline void quantize_rows(const float* x, int64_t rows, int64_t in_features, int8_t* xq, float* xd, float* xs,
                          int64_t path, int32_t* sums = nullptr) {
#ifdef STREAMFUSE_X86
  if (path == kAvx512Vnni) return quantize_avx512(x, rows, in_features, xq, xd, xs, sums);
  if (path == kAvx2) return quantize_avx2(x, rows, in_features, xq, xd, xs, sums);
#endif
  quantize_portable(x, rows, in_features, xq, xd, xs, sums);
}

// xa [rows, rank] = x · A, A [K, rank]: each sum in order of k, from 0 (q4_prepare.h: the same bits on each path).
inline void lora_down(const float* x, const float* a, int64_t rows, int64_t in_features, int64_t rank, float* xa,
                      int64_t path) {
#ifdef STREAMFUSE_X86
  if (path == kAvx512Vnni) return lora_down_avx512(x, a, rows, in_features, rank, xa);
  if (path == kAvx2) return lora_down_avx2(x, a, rows, in_features, rank, xa);
#endif
  lora_down_portable(x, a, rows, in_features, rank, xa);
}

// Column c's code k of a tile-block (the layout at the top of the file).
inline int32_t code_at(const uint8_t* tile, int64_t c, int64_t k) {
  const int64_t group = k / 4, byte = 64 * (group % 4) + 4 * c + k % 4;
  return group < 4 ? tile[byte] & 0x0F : tile[byte] >> 4;
}

// The tile's output for row r: acc (TILE lanes) plus the LoRA, the first columns up to out_features stored.
inline void finish_tile(const Args& a, int64_t tile, int64_t r, const float* acc) {
  const int64_t n0 = tile * TILE, width = a.out_features - n0 < TILE ? a.out_features - n0 : TILE;
  float lora[TILE] = {};
  const TileLora own = lora_of(a, tile);
  const float* xa = a.xa + r * a.rank + own.first_rank;
  for (int64_t j = 0; j < own.rank; ++j) {
    for (int64_t c = 0; c < TILE; ++c) lora[c] = lora[c] + xa[j] * own.up[j * TILE + c];
  }
  for (int64_t c = 0; c < width; ++c) a.out[r * a.out_features + n0 + c] = acc[c] + lora[c];
}

inline void tiles_portable(const Args& a, int64_t first, int64_t last) {
  const int64_t blocks = a.in_features / BLOCK;
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r = 0; r < a.rows; ++r) {
      float acc[TILE] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tile = a.weights + (t * blocks + b) * TILE_BYTES;
        const int8_t* xq = a.xq + r * a.in_features + b * BLOCK;
        const float xd = a.xd[r * blocks + b], xs = a.xs[r * blocks + b];
        for (int64_t c = 0; c < TILE; ++c) {
          int32_t sum = 0;
          for (int64_t k = 0; k < BLOCK; ++k) sum += code_at(tile, c, k) * xq[k];
          uint16_t d16, m16;
          std::memcpy(&d16, tile + SCALES_AT + 2 * c, 2);
          std::memcpy(&m16, tile + MINS_AT + 2 * c, 2);
          const float product = (half_to_float(d16) * xd) * static_cast<float>(sum);
          acc[c] = acc[c] + (product + half_to_float(m16) * xs);
        }
      }
      finish_tile(a, t, r, acc);
    }
  }
}

#ifdef STREAMFUSE_X86
typedef int32_t __attribute__((may_alias, aligned(1))) Unaligned32;

// AVX-512 VNNI, rows [r0, r0 + R) of tile t through every block, R fixed so that their sums stay in registers:
// each tile-block's 8 groups of 4 inputs x 16 columns unpacked once into zmm registers, then per row 8 VPDPBUSD
// (u8 codes x s8 activations, in two chains joined by one exact integer add) and the block's float epilogue on
// 16 lanes. Its 7 vector operations a row and block share the VPDPBUSD's two ports: they, not the dot
// products, bound the rows (docs/benchmarks.md).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,f16c"), always_inline)) inline void rows_avx512_vnni(
    const Args& a, int64_t t, int64_t r0) {
  const int64_t blocks = a.in_features / BLOCK, k = a.in_features;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* tile = a.weights + t * blocks * TILE_BYTES;
  const int8_t* xq = a.xq + r0 * k;
  const float* xd = a.xd + r0 * blocks;
  const float* xs = a.xs + r0 * blocks;
  for (int64_t b = 0; b < blocks; ++b, tile += TILE_BYTES, xq += BLOCK, ++xd, ++xs) {
    prefetch_ahead(tile, TILE_BYTES);
    __m512i w[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(tile + 64 * j);
      w[j] = _mm512_and_si512(packed, low);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + SCALES_AT)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + MINS_AT)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * k;
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int g = 0; g < 8; g += 2) {
        const __m512i first = _mm512_set1_epi32(*reinterpret_cast<const Unaligned32*>(x + 4 * g));
        const __m512i second = _mm512_set1_epi32(*reinterpret_cast<const Unaligned32*>(x + 4 * g + 4));
        even = _mm512_dpbusd_epi32(even, w[g], first);
        odd = _mm512_dpbusd_epi32(odd, w[g + 1], second);
      }
      const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * blocks]));
      const __m512 product = _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)));
      const __m512 offset = _mm512_mul_ps(m, _mm512_set1_ps(xs[r * blocks]));
      acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(product, offset));
    }
  }
  const TileLora own = lora_of(a, t);
  const int64_t width = a.out_features - t * TILE < TILE ? a.out_features - t * TILE : TILE;
  const __mmask16 store = static_cast<__mmask16>((1u << width) - 1u);
  // The rows' LoRA sums side by side, j outer: R independent chains (one row's alone waits on each add).
  const float* xa = a.xa + r0 * a.rank + own.first_rank;
  __m512 lora[R];
  for (int r = 0; r < R; ++r) lora[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < own.rank; ++j) {
    const __m512 up = _mm512_loadu_ps(own.up + j * TILE);
    for (int r = 0; r < R; ++r) lora[r] = _mm512_add_ps(lora[r], _mm512_mul_ps(_mm512_set1_ps(xa[r * a.rank + j]), up));
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(a.out + (r0 + r) * a.out_features + t * TILE, store, _mm512_add_ps(acc[r], lora[r]));
  }
}

// Tiles [first, last): each tile's rows in chunks of ROW_CHUNK, the last chunk by its own size.
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,f16c"))) inline void tiles_avx512_vnni(
    const Args& a, int64_t first, int64_t last) {
  static_assert(ROW_CHUNK == 8, "one case per chunk size below");
  for (int64_t t = first; t < last; ++t) {
    int64_t r0 = 0;
    for (; r0 + ROW_CHUNK <= a.rows; r0 += ROW_CHUNK) rows_avx512_vnni<8>(a, t, r0);
    switch (a.rows - r0) {
      case 7: rows_avx512_vnni<7>(a, t, r0); break;
      case 6: rows_avx512_vnni<6>(a, t, r0); break;
      case 5: rows_avx512_vnni<5>(a, t, r0); break;
      case 4: rows_avx512_vnni<4>(a, t, r0); break;
      case 3: rows_avx512_vnni<3>(a, t, r0); break;
      case 2: rows_avx512_vnni<2>(a, t, r0); break;
      case 1: rows_avx512_vnni<1>(a, t, r0); break;
      default: break;
    }
  }
}

// AVX2: a tile's 16 columns as two halves of 8 lanes; the same integers (VPMADDUBSW makes pairs of at most
// 2·15·127 in magnitude, no saturation, and VPMADDWD by ones sums them to the groups of 4) and the same float
// operations lane by lane.
__attribute__((target("avx2,f16c"))) inline void tiles_avx2(const Args& a, int64_t first, int64_t last) {
  const int64_t blocks = a.in_features / BLOCK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += ROW_CHUNK) {
      const int64_t count = a.rows - r0 < ROW_CHUNK ? a.rows - r0 : ROW_CHUNK;
      __m256 acc[ROW_CHUNK][2];
      for (int64_t r = 0; r < ROW_CHUNK; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* tile = a.weights + (t * blocks + b) * TILE_BYTES;
        prefetch_ahead(tile, TILE_BYTES);
        for (int half = 0; half < 2; ++half) {
          __m256i w[8];
          for (int j = 0; j < 4; ++j) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * j + 32 * half));
            w[j] = _mm256_and_si256(packed, low);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
          }
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + SCALES_AT + 16 * half)));
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + MINS_AT + 16 * half)));
          for (int64_t r = 0; r < count; ++r) {
            const int8_t* xq = a.xq + (r0 + r) * a.in_features + b * BLOCK;
            __m256i sum = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
              int32_t four;
              std::memcpy(&four, xq + 4 * g, 4);
              const __m256i pairs = _mm256_maddubs_epi16(w[g], _mm256_set1_epi32(four));
              sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
            }
            const int64_t at = (r0 + r) * blocks + b;
            const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(a.xd[at]));
            const __m256 product = _mm256_mul_ps(scaled, _mm256_cvtepi32_ps(sum));
            const __m256 offset = _mm256_mul_ps(m, _mm256_set1_ps(a.xs[at]));
            acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_add_ps(product, offset));
          }
        }
      }
      const TileLora own = lora_of(a, t);
      const float* xa = a.xa + r0 * a.rank + own.first_rank;
      __m256 lora[ROW_CHUNK][2];  // the rows' sums side by side, j outer (as the AVX-512 rows)
      for (int64_t r = 0; r < count; ++r) lora[r][0] = lora[r][1] = _mm256_setzero_ps();
      for (int64_t j = 0; j < own.rank; ++j) {
        const __m256 up[2] = {_mm256_loadu_ps(own.up + j * TILE), _mm256_loadu_ps(own.up + j * TILE + 8)};
        for (int64_t r = 0; r < count; ++r) {
          const __m256 scale = _mm256_set1_ps(xa[r * a.rank + j]);
          for (int half = 0; half < 2; ++half) {
            lora[r][half] = _mm256_add_ps(lora[r][half], _mm256_mul_ps(scale, up[half]));
          }
        }
      }
      for (int64_t r = 0; r < count; ++r) {
        alignas(32) float lanes[TILE];
        _mm256_store_ps(lanes, _mm256_add_ps(acc[r][0], lora[r][0]));
        _mm256_store_ps(lanes + 8, _mm256_add_ps(acc[r][1], lora[r][1]));
        const int64_t width = a.out_features - t * TILE < TILE ? a.out_features - t * TILE : TILE;
        std::memcpy(a.out + (r0 + r) * a.out_features + t * TILE, lanes, width * sizeof(float));
      }
    }
  }
}
#endif

// The fastest path this CPU runs (kAuto), or `wanted` if it runs it, else kPortable's answer: -1.
inline int64_t resolve_path(int64_t wanted) {
#ifdef STREAMFUSE_X86
  __builtin_cpu_init();
#ifdef __clang__  // clang (14) cannot ask for f16c here; every AVX2 CPU has it (Haswell, Excavator and later)
  const bool avx2 = __builtin_cpu_supports("avx2");
#else
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vnni") && avx2;
  const bool has[] = {true, true, avx2, avx512};
  if (wanted == kAuto) return avx512 ? kAvx512Vnni : avx2 ? kAvx2 : kPortable;
#else
  const bool has[] = {true, true, false, false};
  if (wanted == kAuto) return kPortable;
#endif
  return wanted >= kPortable && wanted <= kAvx512Vnni && has[wanted] ? wanted : -1;
}

// Tiles [first, last) of the output on `path` (a resolved one).
inline void run_tiles(const Args& a, int64_t path, int64_t first, int64_t last) {
#ifdef STREAMFUSE_X86
  if (path == kAvx512Vnni) return tiles_avx512_vnni(a, first, last);
  if (path == kAvx2) return tiles_avx2(a, first, last);
#endif
  tiles_portable(a, first, last);
}

// --- validation: every wrapper (C ABI, ExecuTorch, ONNX Runtime) checks its tensors here before a kernel runs --

// A call's x [.., K] (rank 1 to 4; its rows are all dims but the last) and out [.., N] (x's dims but the last, then
// N): out's shape for a wrapper that allocates it (out null in the views).
struct Rows {
  int64_t rows = 0, in_features = 0;
  int32_t out_rank = 0;
  int64_t out_sizes[4] = {};
};

inline bool rows_valid(const char* op, const View& x, int64_t out_features, Rows& shape, Error& error) {
  if (!check_tensor(op, "x", x, kFloat32, 1, 4, error)) return false;
  shape.rows = 1;
  for (int32_t i = 0; i + 1 < x.rank; ++i) {
    shape.rows *= x.sizes[i];  // at most x's elements
    shape.out_sizes[i] = x.sizes[i];
  }
  shape.in_features = x.sizes[x.rank - 1];
  shape.out_rank = x.rank;
  shape.out_sizes[x.rank - 1] = out_features;
  return true;
}

// Whether out (null: the wrapper allocates it) is a dense float32 tensor of the shape Rows computed.
inline bool out_valid(const char* op, const View* out, const Rows& shape, Error& error) {
  if (out == nullptr) return true;
  if (!check_tensor(op, "out", *out, kFloat32, shape.out_rank, shape.out_rank, error)) return false;
  for (int32_t i = 0; i < shape.out_rank; ++i) {
    if (out->sizes[i] != shape.out_sizes[i]) {
      return error.set("%s: out must have x's shape with out_features (%lld) last", op,
                       (long long)shape.out_sizes[shape.out_rank - 1]);
    }
  }
  return true;
}

// The tensors of a q4_linear call as its wrapper got them; out null where the wrapper allocates it (Rows).
struct Views {
  const View *x, *weights, *lora_a, *lora_up, *rank_splits, *out;
};

struct Checked {
  Rows shape;
  int64_t out_features, rank;
  Segments segments;  // rank_splits' rows as read once here: the kernel never reads the tensor again
};

// Whether rank_splits [S, 2] int64 (1 <= S <= MAX_SEGMENTS) splits the node's `tiles` and A's `rank` columns:
// every segment at least one tile and a rank >= 0, both summing to the whole. Fills `segments` and `up_rows`
// (U's rows: Σ tiles_s · rank_s, at most tiles · rank).
inline bool segments_valid(const char* op, const View& splits, int64_t tiles, int64_t rank, Segments& segments,
                           int64_t& up_rows, Error& error) {
  if (!check_tensor(op, "rank_splits", splits, kInt64, 2, 2, error)) return false;
  const int64_t count = splits.sizes[0];
  if (splits.sizes[1] != 2 || count < 1 || count > MAX_SEGMENTS) {
    return error.set("%s: rank_splits must be [segments, 2] (tiles, rank) rows, 1 to %lld of them, got [%lld, %lld]",
                     op, (long long)MAX_SEGMENTS, (long long)count, (long long)splits.sizes[1]);
  }
  const int64_t* row = static_cast<const int64_t*>(splits.data);
  int64_t tile = 0, column = 0;
  up_rows = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t own_tiles = row[2 * s], own_rank = row[2 * s + 1];
    if (own_tiles < 1 || own_tiles > tiles - tile) {
      return error.set("%s: rank_splits' tiles must be >= 1 each and sum to ceil(out_features / 16) = %lld, row %lld "
                       "has %lld", op, (long long)tiles, (long long)s, (long long)own_tiles);
    }
    if (own_rank < 0 || own_rank > rank - column) {
      return error.set("%s: rank_splits' ranks must be >= 0 each and sum to lora_a's %lld columns, row %lld has %lld",
                       op, (long long)rank, (long long)s, (long long)own_rank);
    }
    segments.at[s] = {tile, own_tiles, column, own_rank, up_rows * TILE};
    tile += own_tiles;
    column += own_rank;
    up_rows += own_tiles * own_rank;  // at most tiles · rank <= 2^20 · 4096
  }
  if (tile != tiles || column != rank) {
    return error.set("%s: rank_splits must cover every tile and rank column: its rows sum to %lld tiles and rank "
                     "%lld, the node has %lld and %lld", op, (long long)tile, (long long)column, (long long)tiles,
                     (long long)rank);
  }
  segments.count = count;
  return true;
}

// Whether a q4_linear call is sound: x [.., K] float32, weights [ceil(N / 16), K / 32, 320] uint8, lora_a [K, r],
// rank_splits [S, 2] int64 (segments_valid), lora_up [Σ tiles_s · rank_s, 16] float32, out [.., N] float32, all
// dense; sizes_valid. Fills `call`, else `error`.
inline bool validate(const Views& in, int64_t out_features, Checked& call, Error& error) {
  constexpr const char* op = "q4_linear";
  if (!rows_valid(op, *in.x, out_features, call.shape, error) ||
      !check_tensor(op, "weights", *in.weights, kUint8, 3, 3, error) ||
      !check_tensor(op, "lora_a", *in.lora_a, kFloat32, 2, 2, error) ||
      !check_tensor(op, "lora_up", *in.lora_up, kFloat32, 2, 2, error)) {
    return false;
  }
  const int64_t depth = call.shape.in_features, rank = in.lora_a->sizes[1];
  if (!sizes_valid(op, call.shape.rows, depth, out_features, rank, error)) return false;
  const int64_t tiles = tiles_of(out_features), blocks = depth / BLOCK;
  const int64_t *w = in.weights->sizes, *up = in.lora_up->sizes;
  if (w[0] != tiles || w[1] != blocks || w[2] != TILE_BYTES) {
    return error.set("%s: the packed weights must be [ceil(out_features / 16), in_features / 32, 320] = [%lld, %lld, "
                     "320] bytes, got [%lld, %lld, %lld]", op, (long long)tiles, (long long)blocks, (long long)w[0],
                     (long long)w[1], (long long)w[2]);
  }
  if (in.lora_a->sizes[0] != depth) {
    return error.set("%s: the LoRA's A must be [in_features, rank] = [%lld, r], got [%lld, %lld]", op,
                     (long long)depth, (long long)in.lora_a->sizes[0], (long long)rank);
  }
  int64_t up_rows = 0;
  if (!segments_valid(op, *in.rank_splits, tiles, rank, call.segments, up_rows, error)) return false;
  if (up[0] != up_rows || up[1] != TILE) {
    return error.set("%s: the LoRA's U must be [Σ tiles · rank over rank_splits, 16] = [%lld, 16], got [%lld, %lld]",
                     op, (long long)up_rows, (long long)up[0], (long long)up[1]);
  }
  if (!out_valid(op, in.out, call.shape, error)) return false;
  call.out_features = out_features;
  call.rank = rank;
  return true;
}

// One call: its rows prepared (quantized, x · A), then its tiles. Both phases split into independent parts, rows
// then columns, that a wrapper hands to its threads in any grouping: a row's bits never depend on the grouping.
class Call {
 public:
  // A validated call into `out` (the views' or the one its wrapper allocated); may throw std::bad_alloc.
  Call(const Views& in, const Checked& c, float* out, int64_t path)
      : x_(static_cast<const float*>(in.x->data)), lora_a_(static_cast<const float*>(in.lora_a->data)), path_(path),
        segments_(c.segments), xq_(c.shape.rows * c.shape.in_features),
        xd_(c.shape.rows * (c.shape.in_features / BLOCK)), xs_(xd_.size()), xa_(c.shape.rows * c.rank),
        args_{xq_.data(), xd_.data(), xs_.data(), static_cast<const uint8_t*>(in.weights->data), xa_.data(),
              static_cast<const float*>(in.lora_up->data), out, c.shape.rows, c.shape.in_features, c.out_features,
              c.rank, &segments_} {}

  Call(const Call&) = delete;  // args_ points into this object
  Call& operator=(const Call&) = delete;

  int64_t rows() const { return args_.rows; }
  int64_t tiles() const { return tiles_of(args_.out_features); }

  void prepare(int64_t first, int64_t last) {
    const int64_t k = args_.in_features, blocks = k / BLOCK;
    quantize_rows(x_ + first * k, last - first, k, xq_.data() + first * k, xd_.data() + first * blocks,
                  xs_.data() + first * blocks, path_);
    if (args_.rank > 0) {
      lora_down(x_ + first * k, lora_a_, last - first, k, args_.rank, xa_.data() + first * args_.rank, path_);
    }
  }

  void run(int64_t first, int64_t last) const { run_tiles(args_, path_, first, last); }

 private:
  const float* x_;
  const float* lora_a_;
  int64_t path_;
  Segments segments_;
  std::vector<int8_t> xq_;
  std::vector<float> xd_, xs_, xa_;
  Args args_;
};

// A prepared call's tiles on `threads` std::threads in contiguous shares (the C ABIs; the engines' wrappers use
// their own thread pools). Any `Call` with tiles() and run(first, last); false if a share failed.
template <typename C>
bool run_on_threads(const C& call, int64_t threads) {
  return run_shares(call.tiles(), threads, [&call](int64_t first, int64_t last) { call.run(first, last); });
}

}  // namespace streamfuse::q4
