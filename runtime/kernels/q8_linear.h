// The LM head on the GGUF's own Q8_0 blocks, row-invariant like q4_linear.h (whose activation quantization,
// tiles and paths it shares): y = x · W^T, w = d·q with q int8 and d fp16 per block of 32.
//
// Weights (runtime/ops/q8_linear.py pack()): codes [tiles, K/32, 512] int8, byte 64g + 4c + i of a tile-block holding
// column c's code k = 4g + i (g = 0..7), and scales [tiles, K/32, 16] float32 (the fp16 d, exact), separate so
// that the embedding gathers its rows from the same codes (a flat index per element, no copy). Row r, column n:
// acc = 0, then for each block b in order acc = acc + (d · xd) · float(Σ_i q_w,i · q_x,i); y = acc.
// AVX-512 VNNI takes q + 128 (the codes xor 0x80) as VPDPBUSD's unsigned side and subtracts 128 · Σ q_x; AVX2
// multiplies |q_w| by q_x with q_w's sign (VPSIGNB, pairs at most 2 · 128 · 127: no saturation): the same integers.
#pragma once

#include "q4_linear.h"

namespace streamfuse::q8 {

using q4::BLOCK;
using q4::TILE;
constexpr int64_t CODES_BYTES = TILE * BLOCK;  // 512 a tile-block

struct Args {
  const int8_t* xq;      // [rows, K]
  const float* xd;       // [rows, K / 32]
  const int32_t* xsum;   // [rows, K / 32] Σ q_x per block
  const int8_t* codes;   // [tiles, K / 32, 512]
  const float* scales;   // [tiles, K / 32, 16]
  float* out;            // [rows, N]
  int64_t rows, in_features, out_features;
};

inline void store(const Args& a, int64_t tile, int64_t r, const float* acc) {
  const int64_t n0 = tile * TILE, width = a.out_features - n0 < TILE ? a.out_features - n0 : TILE;
  for (int64_t c = 0; c < width; ++c) a.out[r * a.out_features + n0 + c] = acc[c];
}

inline void tiles_portable(const Args& a, int64_t first, int64_t last) {
  const int64_t blocks = a.in_features / BLOCK;
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r = 0; r < a.rows; ++r) {
      float acc[TILE] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* tile = a.codes + (t * blocks + b) * CODES_BYTES;
        const int8_t* xq = a.xq + r * a.in_features + b * BLOCK;
        const float xd = a.xd[r * blocks + b];
        for (int64_t c = 0; c < TILE; ++c) {
          int32_t sum = 0;
          for (int64_t k = 0; k < BLOCK; ++k) sum += tile[64 * (k / 4) + 4 * c + k % 4] * xq[k];
          acc[c] = acc[c] + (a.scales[(t * blocks + b) * TILE + c] * xd) * static_cast<float>(sum);
        }
      }
      store(a, t, r, acc);
    }
  }
}

#ifdef STREAMFUSE_X86
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,f16c"))) inline void tiles_avx512_vnni(
    const Args& a, int64_t first, int64_t last) {
  const int64_t blocks = a.in_features / BLOCK;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += q4::ROW_CHUNK) {
      const int64_t count = a.rows - r0 < q4::ROW_CHUNK ? a.rows - r0 : q4::ROW_CHUNK;
      __m512 acc[q4::ROW_CHUNK];
      for (int64_t r = 0; r < q4::ROW_CHUNK; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* tile = a.codes + (t * blocks + b) * CODES_BYTES;
        q4::prefetch_ahead(tile, CODES_BYTES);
        __m512i w[8];
        for (int g = 0; g < 8; ++g) w[g] = _mm512_xor_si512(_mm512_loadu_si512(tile + 64 * g), flip);
        const __m512 d = _mm512_loadu_ps(a.scales + (t * blocks + b) * TILE);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t at = (r0 + r) * blocks + b;
          const int8_t* xq = a.xq + (r0 + r) * a.in_features + b * BLOCK;
          __m512i sum = _mm512_setzero_si512();
          for (int g = 0; g < 8; ++g) {
            int32_t four;
            std::memcpy(&four, xq + 4 * g, 4);
            sum = _mm512_dpbusd_epi32(sum, w[g], _mm512_set1_epi32(four));
          }
          sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(a.xsum[at] * 128));
          const __m512 scaled = _mm512_mul_ps(d, _mm512_set1_ps(a.xd[at]));
          acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(scaled, _mm512_cvtepi32_ps(sum)));
        }
      }
      const int64_t width = a.out_features - t * TILE < TILE ? a.out_features - t * TILE : TILE;
      const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
      for (int64_t r = 0; r < count; ++r) {
        _mm512_mask_storeu_ps(a.out + (r0 + r) * a.out_features + t * TILE, mask, acc[r]);
      }
    }
  }
}

__attribute__((target("avx2,f16c"))) inline void tiles_avx2(const Args& a, int64_t first, int64_t last) {
  const int64_t blocks = a.in_features / BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = first; t < last; ++t) {
    for (int64_t r0 = 0; r0 < a.rows; r0 += q4::ROW_CHUNK) {
      const int64_t count = a.rows - r0 < q4::ROW_CHUNK ? a.rows - r0 : q4::ROW_CHUNK;
      __m256 acc[q4::ROW_CHUNK][2];
      for (int64_t r = 0; r < q4::ROW_CHUNK; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* tile = a.codes + (t * blocks + b) * CODES_BYTES;
        q4::prefetch_ahead(tile, CODES_BYTES);
        for (int half = 0; half < 2; ++half) {
          __m256i w[8], magnitude[8];
          for (int g = 0; g < 8; ++g) {
            w[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * g + 32 * half));
            magnitude[g] = _mm256_abs_epi8(w[g]);
          }
          const __m256 d = _mm256_loadu_ps(a.scales + (t * blocks + b) * TILE + 8 * half);
          for (int64_t r = 0; r < count; ++r) {
            const int64_t at = (r0 + r) * blocks + b;
            const int8_t* xq = a.xq + (r0 + r) * a.in_features + b * BLOCK;
            __m256i sum = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
              int32_t four;
              std::memcpy(&four, xq + 4 * g, 4);
              const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(four), w[g]);
              sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[g], x), ones));
            }
            const __m256 scaled = _mm256_mul_ps(d, _mm256_set1_ps(a.xd[at]));
            acc[r][half] = _mm256_add_ps(acc[r][half], _mm256_mul_ps(scaled, _mm256_cvtepi32_ps(sum)));
          }
        }
      }
      for (int64_t r = 0; r < count; ++r) {
        alignas(32) float lanes[TILE];
        _mm256_store_ps(lanes, acc[r][0]);
        _mm256_store_ps(lanes + 8, acc[r][1]);
        store(a, t, r0 + r, lanes);
      }
    }
  }
}
#endif

inline void run_tiles(const Args& a, int64_t path, int64_t first, int64_t last) {
#ifdef STREAMFUSE_X86
  if (path == q4::kAvx512Vnni) return tiles_avx512_vnni(a, first, last);
  if (path == q4::kAvx2) return tiles_avx2(a, first, last);
#endif
  tiles_portable(a, first, last);
}

// The tensors of a q8_tiles call as its wrapper got them; out null where the wrapper allocates it (q4::Rows).
struct Views {
  const View *x, *codes, *scales, *out;
};

struct Checked {
  q4::Rows shape;
  int64_t out_features;
};

// Whether a q8_tiles call is sound: x [.., K] float32, codes [ceil(N / 16) · K/32 · 512] int8, scales
// [ceil(N / 16) · K/32 · 16] float32, out [.., N] float32, all dense; q4::sizes_valid. Fills `call`, else `error`.
inline bool validate(const Views& in, int64_t out_features, Checked& call, Error& error) {
  constexpr const char* op = "q8_linear";
  int64_t codes = 0, scales = 0;
  if (!q4::rows_valid(op, *in.x, out_features, call.shape, error) ||
      !check_tensor(op, "codes", *in.codes, kInt8, 1, 1, error, &codes) ||
      !check_tensor(op, "scales", *in.scales, kFloat32, 1, 1, error, &scales) ||
      !q4::sizes_valid(op, call.shape.rows, call.shape.in_features, out_features, 0, error)) {
    return false;
  }
  const int64_t blocks = q4::tiles_of(out_features) * (call.shape.in_features / BLOCK);
  if (codes != blocks * CODES_BYTES || scales != blocks * TILE) {
    return error.set("%s: codes must hold ceil(out_features / 16) x in_features / 32 x 512 = %lld int8 and scales 16 "
                     "floats a block (%lld), got %lld and %lld", op, (long long)(blocks * CODES_BYTES),
                     (long long)(blocks * TILE), (long long)codes, (long long)scales);
  }
  if (!q4::out_valid(op, in.out, call.shape, error)) return false;
  call.out_features = out_features;
  return true;
}

// One call, as q4::Call: rows prepared (quantized) in parts, then tiles in parts.
class Call {
 public:
  Call(const float* x, const int8_t* codes, const float* scales, float* out, int64_t rows, int64_t in_features,
       int64_t out_features, int64_t path)
      : x_(x), path_(path), xq_(rows * in_features), xd_(rows * (in_features / BLOCK)), xs_(xd_.size()),
        xsum_(xd_.size()),
        args_{xq_.data(), xd_.data(), xsum_.data(), codes, scales, out, rows, in_features, out_features} {}

  // A validated call into `out` (the views' or the one its wrapper allocated); may throw std::bad_alloc.
  Call(const Views& in, const Checked& c, float* out, int64_t path)
      : Call(static_cast<const float*>(in.x->data), static_cast<const int8_t*>(in.codes->data),
             static_cast<const float*>(in.scales->data), out, c.shape.rows, c.shape.in_features, c.out_features,
             path) {}

  int64_t rows() const { return args_.rows; }
  int64_t tiles() const { return q4::tiles_of(args_.out_features); }

  void prepare(int64_t first, int64_t last) {
    const int64_t k = args_.in_features, blocks = k / BLOCK;
    q4::quantize_rows(x_ + first * k, last - first, k, xq_.data() + first * k, xd_.data() + first * blocks,
                      xs_.data() + first * blocks, path_, xsum_.data() + first * blocks);
  }

  void run(int64_t first, int64_t last) const { run_tiles(args_, path_, first, last); }

 private:
  const float* x_;
  int64_t path_;
  std::vector<int8_t> xq_;
  std::vector<float> xd_, xs_;
  std::vector<int32_t> xsum_;
  Args args_;
};

}  // namespace streamfuse::q8
