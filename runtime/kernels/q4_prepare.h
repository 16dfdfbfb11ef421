// A linear call's row preparation (q4_linear.h's Call::prepare, q8_linear.h's too): the activations quantized
// block by block and the LoRA's x · A, on every instruction-set path with the same bits as the portable loops.
//
// The portable loops are the arithmetic (q4_linear.h's header states it); the vector paths do exactly their
// operations lane by lane: the block's max |x| by max (exact, NaN skipped as `>` skips it: VMAXPS returns its
// second operand, the running max, when the first is NaN), q = x · (1 / xd) one multiply, clamped, rounded to
// nearest even (the default rounding mode, as nearbyint), NaN to 0; xa_j summed in order of k, a multiply then
// an add (no fused multiply-add). Scalar and one row at a time, they take about half of a many-row call.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace streamfuse::q4 {

constexpr int64_t QUANT_BLOCK = 32;  // q4_linear.h's BLOCK: inputs per activation scale
constexpr int64_t LORA_ROWS = 4;      // rows that share each column of A loaded

// The block's d and 1 / d from its max |x|.
inline void block_scale(float amax, float& d, float& inverse) {
  d = amax / 127.f;
  inverse = d != 0.f ? 1.f / d : 0.f;
}

// Block `at` (row-major [rows, blocks]) of xd, xs (and the integer sums, where asked) from its d and code sum.
inline void store_block(int64_t at, float d, int32_t sum, float* xd, float* xs, int32_t* sums) {
  xd[at] = d;
  xs[at] = d * static_cast<float>(sum);
  if (sums != nullptr) sums[at] = sum;
}

inline void quantize_portable(const float* x, int64_t rows, int64_t in_features, int8_t* xq, float* xd, float* xs,
                              int32_t* sums) {
  const int64_t blocks = in_features / QUANT_BLOCK;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * in_features + b * QUANT_BLOCK;
      float amax = 0.f, d, inverse;
      for (int64_t i = 0; i < QUANT_BLOCK; ++i) amax = std::fabs(v[i]) > amax ? std::fabs(v[i]) : amax;
      block_scale(amax, d, inverse);
      int32_t sum = 0;
      for (int64_t i = 0; i < QUANT_BLOCK; ++i) {
        float q = v[i] * inverse;
        q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
        const int32_t code = q == q ? static_cast<int32_t>(std::nearbyint(q)) : 0;
        xq[r * in_features + b * QUANT_BLOCK + i] = static_cast<int8_t>(code);
        sum += code;
      }
      store_block(r * blocks + b, d, sum, xd, xs, sums);
    }
  }
}

// Columns [first, last) of xa [rows, rank] = x · A, A [K, rank]: each sum in order of k, from 0.
inline void lora_columns_portable(const float* x, const float* a, int64_t rows, int64_t in_features, int64_t rank,
                                  int64_t first, int64_t last, float* xa) {
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = xa + r * rank;
    for (int64_t j = first; j < last; ++j) acc[j] = 0.f;
    for (int64_t k = 0; k < in_features; ++k) {
      const float value = x[r * in_features + k];
      const float* column = a + k * rank;
      for (int64_t j = first; j < last; ++j) acc[j] = acc[j] + value * column[j];
    }
  }
}

inline void lora_down_portable(const float* x, const float* a, int64_t rows, int64_t in_features, int64_t rank,
                               float* xa) {
  lora_columns_portable(x, a, rows, in_features, rank, 0, rank, xa);
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx512f,avx512bw"))) inline void quantize_avx512(const float* x, int64_t rows,
                                                                        int64_t in_features, int8_t* xq, float* xd,
                                                                        float* xs, int32_t* sums) {
  const int64_t blocks = in_features / QUANT_BLOCK;
  const __m512 high = _mm512_set1_ps(127.f), low = _mm512_set1_ps(-127.f), zero = _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * in_features + b * QUANT_BLOCK;
      const __m512 v[2] = {_mm512_loadu_ps(x + at), _mm512_loadu_ps(x + at + 16)};
      const __m512 amax = _mm512_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), zero), _mm512_max_ps(_mm512_abs_ps(v[1]), zero));
      float d, inverse;
      block_scale(_mm512_reduce_max_ps(amax), d, inverse);
      __m512i total = _mm512_setzero_si512();
      for (int half = 0; half < 2; ++half) {
        const __m512 q = _mm512_mul_ps(v[half], _mm512_set1_ps(inverse));
        const __mmask16 number = _mm512_cmp_ps_mask(q, q, _CMP_ORD_Q);
        const __m512 clamped = _mm512_max_ps(_mm512_min_ps(q, high), low);
        const __m512i code = _mm512_maskz_cvt_roundps_epi32(number, clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at + 16 * half), _mm512_cvtepi32_epi8(code));
        total = _mm512_add_epi32(total, code);
      }
      store_block(r * blocks + b, d, _mm512_reduce_add_epi32(total), xd, xs, sums);
    }
  }
}

__attribute__((target("avx2"))) inline void quantize_avx2(const float* x, int64_t rows, int64_t in_features,
                                                          int8_t* xq, float* xd, float* xs, int32_t* sums) {
  const int64_t blocks = in_features / QUANT_BLOCK;
  const __m256 high = _mm256_set1_ps(127.f), low = _mm256_set1_ps(-127.f), zero = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' 128-bit lanes back in order
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * in_features + b * QUANT_BLOCK;
      __m256 v[4], amax = zero;
      for (int part = 0; part < 4; ++part) {
        v[part] = _mm256_loadu_ps(x + at + 8 * part);
        amax = _mm256_max_ps(_mm256_and_ps(v[part], magnitude), amax);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, amax);
      float largest = lanes[0];
      for (int i = 1; i < 8; ++i) largest = lanes[i] > largest ? lanes[i] : largest;
      float d, inverse;
      block_scale(largest, d, inverse);
      __m256i code[4], total = _mm256_setzero_si256();
      for (int part = 0; part < 4; ++part) {
        const __m256 q = _mm256_mul_ps(v[part], _mm256_set1_ps(inverse));
        const __m256 number = _mm256_cmp_ps(q, q, _CMP_ORD_Q);
        const __m256 clamped = _mm256_max_ps(_mm256_min_ps(q, high), low);
        const __m256 rounded = _mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        code[part] = _mm256_cvtps_epi32(_mm256_and_ps(rounded, number));
        total = _mm256_add_epi32(total, code[part]);
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at), _mm256_permutevar8x32_epi32(bytes, order));
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), total);
      int32_t sum = 0;
      for (int i = 0; i < 8; ++i) sum += parts[i];
      store_block(r * blocks + b, d, sum, xd, xs, sums);
    }
  }
}

// x · A for R rows and C groups of 16 columns from column j (a group past the rank: masked off): R x C independent
// sums a step of k, so one row of a small rank is not bound by an add's latency, and each column is loaded once
// for the R rows.
template <int R, int C>
__attribute__((target("avx512f"), always_inline)) inline void lora_block_avx512(const float* x, const float* a,
                                                                                int64_t in_features, int64_t rank,
                                                                                int64_t j, float* xa) {
  __mmask16 lanes[C];
  __m512 acc[R][C];
  for (int c = 0; c < C; ++c) {
    const int64_t left = rank - j - 16 * c;
    lanes[c] = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : left > 0 ? (1u << left) - 1u : 0u);
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < in_features; ++k) {
    const float* row = a + k * rank + j;
    for (int c = 0; c < C; ++c) {
      const __m512 column = _mm512_maskz_loadu_ps(lanes[c], row + 16 * c);
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_mul_ps(_mm512_set1_ps(x[r * in_features + k]), column));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(xa + r * rank + j + 16 * c, lanes[c], acc[r][c]);
  }
}

__attribute__((target("avx512f"))) inline void lora_down_avx512(const float* x, const float* a, int64_t rows,
                                                                int64_t in_features, int64_t rank, float* xa) {
  int64_t r = 0;
  for (; r + LORA_ROWS <= rows; r += LORA_ROWS) {  // 4 rows x 32 columns: 8 sums in flight
    for (int64_t j = 0; j < rank; j += 32) lora_block_avx512<4, 2>(x + r * in_features, a, in_features, rank, j, xa + r * rank);
  }
  for (; r < rows; ++r) {  // 1 row x up to 96 columns: 6 sums in flight
    for (int64_t j = 0; j < rank; j += 96) {
      const float* row = x + r * in_features;
      switch ((rank - j + 15) / 16) {
        case 1: lora_block_avx512<1, 1>(row, a, in_features, rank, j, xa + r * rank); break;
        case 2: lora_block_avx512<1, 2>(row, a, in_features, rank, j, xa + r * rank); break;
        case 3: lora_block_avx512<1, 3>(row, a, in_features, rank, j, xa + r * rank); break;
        case 4: lora_block_avx512<1, 4>(row, a, in_features, rank, j, xa + r * rank); break;
        case 5: lora_block_avx512<1, 5>(row, a, in_features, rank, j, xa + r * rank); break;
        default: lora_block_avx512<1, 6>(row, a, in_features, rank, j, xa + r * rank); break;
      }
    }
  }
}

// AVX2: the same blocks of 8 columns; the columns past the last multiple of 8 by the portable loop's operations.
template <int R, int C>
__attribute__((target("avx2"), always_inline)) inline void lora_block_avx2(const float* x, const float* a,
                                                                           int64_t in_features, int64_t rank,
                                                                           int64_t j, float* xa) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < in_features; ++k) {
    const float* row = a + k * rank + j;
    for (int c = 0; c < C; ++c) {
      const __m256 column = _mm256_loadu_ps(row + 8 * c);
      for (int r = 0; r < R; ++r) {
        acc[r][c] = _mm256_add_ps(acc[r][c], _mm256_mul_ps(_mm256_set1_ps(x[r * in_features + k]), column));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(xa + r * rank + j + 8 * c, acc[r][c]);
  }
}

template <int R>
__attribute__((target("avx2"), always_inline)) inline void lora_rows_avx2(const float* x, const float* a,
                                                                          int64_t in_features, int64_t rank,
                                                                          float* xa) {
  const int64_t full = rank / 8 * 8;
  int64_t j = 0;
  if constexpr (R > 1) {  // R rows x 16 columns: 2R sums in flight
    for (; j + 16 <= full; j += 16) lora_block_avx2<R, 2>(x, a, in_features, rank, j, xa);
    for (; j < full; j += 8) lora_block_avx2<R, 1>(x, a, in_features, rank, j, xa);
  } else {  // 1 row x up to 48 columns: 6 sums in flight
    for (; j < full; j += 48) {
      switch ((full - j) / 8) {
        case 1: lora_block_avx2<1, 1>(x, a, in_features, rank, j, xa); break;
        case 2: lora_block_avx2<1, 2>(x, a, in_features, rank, j, xa); break;
        case 3: lora_block_avx2<1, 3>(x, a, in_features, rank, j, xa); break;
        case 4: lora_block_avx2<1, 4>(x, a, in_features, rank, j, xa); break;
        case 5: lora_block_avx2<1, 5>(x, a, in_features, rank, j, xa); break;
        default: lora_block_avx2<1, 6>(x, a, in_features, rank, j, xa); break;
      }
    }
  }
  lora_columns_portable(x, a, R, in_features, rank, full, rank, xa);
}

__attribute__((target("avx2"))) inline void lora_down_avx2(const float* x, const float* a, int64_t rows,
                                                           int64_t in_features, int64_t rank, float* xa) {
  int64_t r = 0;
  for (; r + LORA_ROWS <= rows; r += LORA_ROWS) lora_rows_avx2<4>(x + r * in_features, a, in_features, rank, xa + r * rank);
  for (; r < rows; ++r) lora_rows_avx2<1>(x + r * in_features, a, in_features, rank, xa + r * rank);
}
#endif

}  // namespace streamfuse::q4
