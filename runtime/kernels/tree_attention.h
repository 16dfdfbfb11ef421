// Exact attention over the used span of a KV cache, for one layer of a draft-tree step.
//
// Row t of head h attends the cache slots [0, start) and then the extra keys x whose visible[t, x] is
// nonzero (this call's own rows, or the streams' rows), in that order: cache first, extra keys by
// index. Two passes: the scores and their maximum, then exp(score - max) summed into the denominator and,
// times each key's value, into the numerator, one key after another. Work is split across rows and
// heads, never across keys, so a row's result depends only on its query and the keys it sees, in their
// order: the same bits in a 1-row and an M-row call, whatever the tree, the other rows and the threads.
// A chain node at depth d in a step sees exactly what plain decoding of its token sees (the cache, then
// its ancestors, which plain decoding would have committed at slots start.. start + d - 1), so SS equals
// plain decoding bit for bit. Cost: start + X keys per row, not the cache's capacity.
//
// Arithmetic (the Python reference in runtime/ops/tree_attention.py repeats it exactly): float32 throughout;
// a dot product over head_dim in LANES partial sums (lane l takes elements l, l + LANES, ...), then the
// partials added pairwise ((0+1)+(2+3))+((4+5)+(6+7)); exp as exp_poly below; no fused multiply-add
// (built with -ffp-contract=off). Each path (AttentionPath) makes these operations: the same bits on all.
//
// The cache lives in the engine: a call also STORES its first `store` extra rows into the cache at slots
// start.. of its layer (store_rows, after the attention, which never reads those slots), and commit_rows
// COMPACTS the previous step's accepted rows in place before a step's attention (the graphs order it
// first by feeding its output, a copy of start, to every attention call). So no K/V row leaves a call.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "boundary.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define STREAMFUSE_ATTENTION_X86 1
#endif

namespace streamfuse {

constexpr int64_t LANES = 8;

struct TreeAttentionArgs {
  const float* query;    // [heads, rows, dim]
  const float* k_cache;  // [kv_heads, capacity, dim]
  const float* v_cache;  // [kv_heads, capacity, dim]
  const float* k_extra;  // [kv_heads, extra, dim]
  const float* v_extra;  // [kv_heads, extra, dim]
  const float* visible;  // [rows, extra]: nonzero where row t sees extra key x
  float* out;            // [rows, heads, dim]
  int64_t heads, kv_heads, rows, dim, capacity, start, extra;
  float scale;
  int64_t path;  // AttentionPath, resolved (validate_attention sets the fastest this CPU runs)
};

// kAttentionGeneric: the 8 lanes below, one AVX2 register (or two SSE halves). kAttentionPairs: two queries' 8 lanes
// side by side in one AVX-512 register (scores, exps and values), each half the same operations in the same order:
// the same bits, half the vector instructions.
enum AttentionPath : int64_t { kAttentionAuto = 0, kAttentionGeneric = 1, kAttentionPairs = 2 };

// `wanted` if this CPU runs it (kAttentionAuto: the fastest, pairs only on non-AMD CPUs: a Zen 4 splits each
// 512-bit operation in two, so pairs would save it nothing), else -1.
inline int64_t resolve_attention_path(int64_t wanted) {
#ifdef STREAMFUSE_ATTENTION_X86
  __builtin_cpu_init();
  const bool pairs = __builtin_cpu_supports("avx512f");
  if (wanted == kAttentionAuto) return pairs && !__builtin_cpu_is("amd") ? kAttentionPairs : kAttentionGeneric;
#else
  const bool pairs = false;
  if (wanted == kAttentionAuto) return kAttentionGeneric;
#endif
  return wanted == kAttentionGeneric || (wanted == kAttentionPairs && pairs) ? wanted : -1;
}

// Eight float lanes (GCC vector extension: AVX, or two SSE halves); lane-wise + and * only.
typedef float Lanes __attribute__((vector_size(LANES * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float lane_sum(Lanes s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

// Lane l sums a[i] * b[i] over i = l, l + LANES, ... in order (a dim that is not a multiple of LANES ends
// in the first lanes), then the lanes are added pairwise.
inline float dot(const float* a, const float* b, int64_t dim) {
  Lanes lane = {};
  int64_t i = 0;
  for (; i + LANES <= dim; i += LANES) lane += load(a + i) * load(b + i);
  for (int64_t l = 0; i + l < dim; ++l) lane[l] += a[i + l] * b[i + l];
  return lane_sum(lane);
}

typedef int32_t Ints __attribute__((vector_size(LANES * sizeof(int32_t))));

// Pairs of neighbours: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (AVX's hadd).
inline Lanes pair_sums(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// lane_sum of eight vectors at once, the same additions in the same order: lane k of the result is
// lane_sum(v[k]). Two rounds of pair_sums leave ((0+1)+(2+3)) and ((4+5)+(6+7)) of each, then one add.
inline Lanes lane_sums(const Lanes* v) {
  const Lanes low = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
  const Lanes high = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

// dot(q, keys + k * dim, dim) for the eight consecutive keys k = 0..7, lane k of the result; dim is a
// multiple of LANES. Eight independent chains of additions, each the sums dot makes.
inline Lanes dot8(const float* q, const float* keys, int64_t dim) {
  Lanes acc[LANES] = {};
  for (int64_t i = 0; i < dim; i += LANES) {
    const Lanes x = load(q + i);
    for (int64_t k = 0; k < LANES; ++k) acc[k] += x * load(keys + k * dim + i);
  }
  return lane_sums(acc);
}

// exp(x) for x <= 0 in float32 operations only (no libm: the same bits on every machine and in the NumPy
// reference): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), a degree-6 polynomial for e^r, times
// 2^n; 0 below EXP_FLOOR. About 2 ulp from the true value.
constexpr float EXP_FLOOR = -87.0f;
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_POLY[7] = {1.0f, 1.0f, 0.5f, 0.166666672f, 0.0416666716f, 0.00833333377f, 0.00138888892f};

inline float exp_poly(float x) {
  const float clamped = x < EXP_FLOOR ? EXP_FLOOR : x;
  const float n = std::floor(clamped * LOG2E + 0.5f);
  const float r = (clamped - n * LN2_HI) - n * LN2_LO;
  float p = EXP_POLY[6];
  for (int c = 5; c >= 0; --c) p = p * r + EXP_POLY[c];
  // n is NaN only where x is (the result is NaN whatever the scale): 0 keeps the conversion defined.
  int32_t bits = ((n == n ? static_cast<int32_t>(n) : 0) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < EXP_FLOOR ? 0.f : p * scale;
}

// at[l] = exp_poly(at[l] - top) for the lanes of a vector V of floats (I: as many int32), the same operations lane
// by lane (floor as truncation corrected below: y < 2^23 here). Pointers in and out, no vector argument: one body
// for the 8 lanes and, inlined into an AVX-512 function, the 16.
template <typename V, typename I>
__attribute__((always_inline)) inline void exp_in_place(float* at, float top) {
  V x;
  std::memcpy(&x, at, sizeof(x));
  x = x - (top - V{});
  const V floor_ = EXP_FLOOR - V{};
  const V clamped = x < floor_ ? floor_ : x;
  const V y = clamped * LOG2E + 0.5f;
  const V truncated = __builtin_convertvector(__builtin_convertvector(y, I), V);
  const V n = truncated > y ? truncated - 1.0f : truncated;
  const V r = (clamped - n * LN2_HI) - n * LN2_LO;
  V p = EXP_POLY[6] - V{};
  for (int c = 5; c >= 0; --c) p = p * r + EXP_POLY[c];
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  const V result = x < floor_ ? V{} : p * (V)bits;  // a vector cast keeps the bits (GCC, clang)
  std::memcpy(at, &result, sizeof(result));
}

// Queries taken through the keys together (their scores and numerators in scratch), and values per block.
constexpr int64_t BATCH = 16, KEY_BLOCK = 32;

// total += p[k] and acc[c] += p[k] * values[k * dim + c * LANES ..] for k = 0..count-1 in order, c < B; the
// sums stay in registers across the keys (a runtime block count would keep them in memory: a store and a
// load on every key's chain).
template <int64_t B>
inline void accumulate_fixed(float& total, Lanes* acc_mem, const float* p, const float* values, int64_t count,
                             int64_t dim) {
  Lanes acc[B];
  float sum = total;
  for (int64_t c = 0; c < B; ++c) acc[c] = acc_mem[c];
  for (int64_t k = 0; k < count; ++k) {
    sum += p[k];
    for (int64_t c = 0; c < B; ++c) acc[c] += p[k] * load(values + k * dim + c * LANES);
  }
  for (int64_t c = 0; c < B; ++c) acc_mem[c] = acc[c];
  total = sum;
}

inline void accumulate(float& total, Lanes* acc, const float* p, const float* values, int64_t count,
                       int64_t blocks, int64_t dim) {
  if (blocks == 8) return accumulate_fixed<8>(total, acc, p, values, count, dim);    // head_dim 64
  if (blocks == 16) return accumulate_fixed<16>(total, acc, p, values, count, dim);  // head_dim 128
  for (int64_t k = 0; k < count; ++k) {
    total += p[k];
    for (int64_t c = 0; c < blocks; ++c) acc[c] += p[k] * load(values + k * dim + c * LANES);
  }
}

// Whether a row sees any of the eight extra keys from `seen`.
inline bool any_seen(const float* seen) {
  for (int64_t l = 0; l < LANES; ++l) {
    if (seen[l] != 0.f) return true;
  }
  return false;
}

// The scores of the extra keys a query sees into scores[x], eight keys at a time where it sees one of them and
// head_dim allows (dot8: the same sums as dot; a key it does not see gets a score nobody reads), and their max
// into top. A prefill chunk's rows see half its keys on average: one at a time, each cost far more than a cached one.
// from: the extra keys before it were scored already (kPairs: in whole blocks of eight, two queries at a time).
inline void extra_scores(const TreeAttentionArgs& a, const float* query, const float* kx, const float* seen,
                         float* scores, float& top, int64_t from = 0) {
  int64_t x = from;
  if (a.dim % LANES == 0) {
    for (; x + LANES <= a.extra; x += LANES) {
      if (!any_seen(seen + x)) continue;
      const Lanes score = dot8(query, kx + x * a.dim, a.dim) * a.scale;
      std::memcpy(scores + x, &score, sizeof(score));
    }
  }
  for (; x < a.extra; ++x) {
    if (seen[x] != 0.f) scores[x] = dot(query, kx + x * a.dim, a.dim) * a.scale;
  }
  for (x = 0; x < a.extra; ++x) {
    if (seen[x] != 0.f) top = scores[x] > top ? scores[x] : top;
  }
}

// exp(score - top) in place for the extra keys a query sees, eight at a time where it sees one of them
// (exp_in_place: exp_poly's bits lane by lane).
inline void extra_weights(int64_t extra, const float* seen, float top, float* scores) {
  int64_t x = 0;
  for (; x + LANES <= extra; x += LANES) {
    if (!any_seen(seen + x)) continue;
    exp_in_place<Lanes, Ints>(scores + x, top);
  }
  for (; x < extra; ++x) {
    if (seen[x] != 0.f) scores[x] = exp_poly(scores[x] - top);
  }
}

#ifdef STREAMFUSE_ATTENTION_X86
// --- kPairs: queries a and b in the low and high 8 lanes of one 16-lane register --------------------------------
typedef float Lanes16 __attribute__((vector_size(2 * LANES * sizeof(float))));
typedef int32_t Ints16 __attribute__((vector_size(2 * LANES * sizeof(int32_t))));

#define STREAMFUSE_PAIRS __attribute__((target("avx512f"), always_inline)) inline

STREAMFUSE_PAIRS Lanes16 both(Lanes a, Lanes b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// The 8 floats at p in both halves: one broadcast load (VBROADCASTF64X4 moves the bits as they are), no shuffle.
STREAMFUSE_PAIRS Lanes16 twice(const float* p) {
  return (Lanes16)_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p)));
}

// Eight floats at a and at b (Lanes in memory that a build without AVX aligns to 16 bytes only: moved with
// memcpy, never an aligned load; and no call to a function of the build's own target that takes or returns Lanes,
// whose ABI differs there).
STREAMFUSE_PAIRS Lanes16 both_at(const void* a, const void* b) {
  Lanes low, high;
  std::memcpy(&low, a, sizeof(low));
  std::memcpy(&high, b, sizeof(high));
  return both(low, high);
}

// The low half to a, the high half to b (8 floats each, any alignment).
STREAMFUSE_PAIRS void halves_to(Lanes16 v, void* a, void* b) {
  std::memcpy(a, &v, sizeof(Lanes));
  std::memcpy(b, reinterpret_cast<const char*>(&v) + sizeof(Lanes), sizeof(Lanes));
}

// pair_sums of each half: [pair_sums(a.low, b.low) | pair_sums(a.high, b.high)].
STREAMFUSE_PAIRS Lanes16 pair_sums16(Lanes16 a, Lanes16 b) {
  return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}

// lane_sums of each half.
STREAMFUSE_PAIRS Lanes16 lane_sums16(const Lanes16* v) {
  const Lanes16 low = pair_sums16(pair_sums16(v[0], v[1]), pair_sums16(v[2], v[3]));
  const Lanes16 high = pair_sums16(pair_sums16(v[4], v[5]), pair_sums16(v[6], v[7]));
  return __builtin_shufflevector(low, high, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(low, high, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}

// [dot8(a, keys, dim) | dot8(b, keys, dim)]: each key's lanes loaded once for both queries.
STREAMFUSE_PAIRS Lanes16 dot8_pair(const float* a, const float* b, const float* keys, int64_t dim) {
  Lanes16 acc[LANES] = {};
  for (int64_t i = 0; i < dim; i += LANES) {
    const Lanes16 x = both_at(a + i, b + i);
    for (int64_t k = 0; k < LANES; ++k) acc[k] += x * twice(keys + k * dim + i);
  }
  return lane_sums16(acc);
}

// The scores of cached keys [0, end) for queries q and q + 1 (end a multiple of LANES), eight keys at a time, and
// their maxima lane by lane into tops[q], tops[q + 1], as the generic loop makes them.
__attribute__((target("avx512f"))) inline void cache_scores_pair(const float* a, const float* b, const float* keys,
                                                                  int64_t end, int64_t dim, float scale,
                                                                  float* scores_a, float* scores_b, Lanes* tops) {
  Lanes16 top = both_at(tops, tops + 1);
  for (int64_t j = 0; j < end; j += LANES) {
    const Lanes16 score = dot8_pair(a, b, keys + j * dim, dim) * scale;
    halves_to(score, scores_a + j, scores_b + j);
    top = score > top ? score : top;
  }
  halves_to(top, tops, tops + 1);
}

// accumulate_fixed<B> for queries a and b over the same `count` value rows: each half the sums it makes alone.
template <int64_t B>
__attribute__((target("avx512f"))) inline void accumulate_pair(float* totals, Lanes* acc_a, Lanes* acc_b,
                                                                const float* p_a, const float* p_b,
                                                                const float* values, int64_t count, int64_t dim) {
  Lanes16 acc[B];
  float sum_a = totals[0], sum_b = totals[1];
  for (int64_t c = 0; c < B; ++c) acc[c] = both_at(acc_a + c, acc_b + c);
  for (int64_t k = 0; k < count; ++k) {
    sum_a += p_a[k];
    sum_b += p_b[k];
    // [p_a[k] x 8 | p_b[k] x 8]
    const Lanes16 p = (Lanes16)_mm512_shuffle_f32x4(_mm512_set1_ps(p_a[k]), _mm512_set1_ps(p_b[k]), 0);
    for (int64_t c = 0; c < B; ++c) acc[c] += p * twice(values + k * dim + c * LANES);
  }
  for (int64_t c = 0; c < B; ++c) halves_to(acc[c], acc_a + c, acc_b + c);
  totals[0] = sum_a;
  totals[1] = sum_b;
}

// exp(score - top) in place for the first scores, sixteen at a time (exp_in_place's operations lane by lane) -> how
// many it took (a multiple of 16).
__attribute__((target("avx512f"))) inline int64_t cache_weights16(float* scores, int64_t count, float top) {
  int64_t k = 0;
  for (; k + 2 * LANES <= count; k += 2 * LANES) exp_in_place<Lanes16, Ints16>(scores + k, top);
  return k;
}

// extra_scores' blocks of eight for queries a and b: where either sees one of the eight keys, both get the block's
// scores (a score a query does not see is never read) -> the first key it left (the blocks' end).
__attribute__((target("avx512f"))) inline int64_t extra_scores_pair(const TreeAttentionArgs& a, const float* qa,
                                                                     const float* qb, const float* kx,
                                                                     const float* seen_a, const float* seen_b,
                                                                     float* scores_a, float* scores_b) {
  int64_t x = 0;
  for (; x + LANES <= a.extra; x += LANES) {
    if (!any_seen(seen_a + x) && !any_seen(seen_b + x)) continue;
    halves_to(dot8_pair(qa, qb, kx + x * a.dim, a.dim) * a.scale, scores_a + x, scores_b + x);
  }
  return x;
}
#undef STREAMFUSE_PAIRS
#endif

struct Scratch {
  std::vector<float> scores;  // [queries, start + extra]
  std::vector<Lanes> acc;     // [queries, head_dim / LANES]: the numerators
};

// Queries [begin, end) of KV head g (query i: row i / group of head g * group + i % group), at most BATCH.
// Each cached key is loaded once for all of them (a step's rows and a KV group's heads read the same
// keys), while every query keeps its own sums in its own order: the bits it would get alone.
inline void attend_batch(const TreeAttentionArgs& a, int64_t g, int64_t begin, int64_t end, Scratch& s) {
  const int64_t group = a.heads / a.kv_heads, dim = a.dim, keys = a.start + a.extra, n = end - begin;
  const int64_t blocks = dim / LANES, rest = dim - blocks * LANES;
  // kPairs where a call reads cached keys (a prefill's first chunk, its own keys only, ran 3 % slower in pairs)
  const bool paired = a.path == kAttentionPairs && a.start > 0;
  const float* kc = a.k_cache + g * a.capacity * dim;
  const float* vc = a.v_cache + g * a.capacity * dim;
  const float* kx = a.k_extra + g * a.extra * dim;
  const float* vx = a.v_extra + g * a.extra * dim;
  const float* query[BATCH];
  const float* seen[BATCH];
  float top[BATCH], total[BATCH] = {}, tail[BATCH][LANES] = {};
  for (int64_t q = 0; q < n; ++q) {
    const int64_t t = (begin + q) / group, h = g * group + (begin + q) % group;
    query[q] = a.query + (h * a.rows + t) * dim;
    seen[q] = a.visible + t * a.extra;
    top[q] = -INFINITY;
  }
  s.scores.resize(n * keys);
  s.acc.assign(n * blocks, Lanes{});
  // Scores of the cache keys, eight keys at a time for every query where head_dim allows (dot8: the same sums
  // as dot), and each query's max.
  int64_t j = 0;
  if (dim % LANES == 0) {
    Lanes tops[BATCH];
    for (int64_t q = 0; q < n; ++q) tops[q] = top[q] - Lanes{};
    int64_t done = 0;  // queries [0, done) took the cached keys in pairs
#ifdef STREAMFUSE_ATTENTION_X86
    if (paired) {
      const int64_t whole = a.start - a.start % LANES;
      for (; done + 1 < n; done += 2) {
        float* scores = s.scores.data() + done * keys;
        cache_scores_pair(query[done], query[done + 1], kc, whole, dim, a.scale, scores, scores + keys, tops + done);
      }
    }
#endif
    for (; j + LANES <= a.start; j += LANES) {
      for (int64_t q = done; q < n; ++q) {
        const Lanes score = dot8(query[q], kc + j * dim, dim) * a.scale;
        std::memcpy(s.scores.data() + q * keys + j, &score, sizeof(score));
        tops[q] = score > tops[q] ? score : tops[q];
      }
    }
    for (int64_t q = 0; q < n; ++q) {
      for (int64_t l = 0; l < LANES; ++l) top[q] = tops[q][l] > top[q] ? tops[q][l] : top[q];
    }
  }
  for (int64_t q = 0; q < n; ++q) {
    float* scores = s.scores.data() + q * keys;
    for (int64_t k = j; k < a.start; ++k) {
      scores[k] = dot(query[q], kc + k * dim, dim) * a.scale;
      top[q] = scores[k] > top[q] ? scores[k] : top[q];
    }
    int64_t from = 0;
#ifdef STREAMFUSE_ATTENTION_X86
    if (paired && dim % LANES == 0 && q + 1 < n && q % 2 == 0) {  // q and q + 1 together
      from = extra_scores_pair(a, query[q], query[q + 1], kx, seen[q], seen[q + 1], scores + a.start,
                               scores + keys + a.start);
    } else if (paired && dim % LANES == 0 && q % 2 == 1) {
      from = a.extra - a.extra % LANES;  // scored beside q - 1
    }
#endif
    extra_scores(a, query[q], kx, seen[q], scores + a.start, top[q], from);
    extra_weights(a.extra, seen[q], top[q], scores + a.start);
    int64_t k = 0;
#ifdef STREAMFUSE_ATTENTION_X86
    if (paired) k = cache_weights16(scores, a.start, top[q]);
#endif
    for (; k + LANES <= a.start; k += LANES) {
      exp_in_place<Lanes, Ints>(scores + k, top[q]);
    }
    for (; k < a.start; ++k) scores[k] = exp_poly(scores[k] - top[q]);
  }
  // The denominators total[q] and the numerators: acc[q * blocks + c] holds query q's out[c * LANES ..
  // c * LANES + LANES), each element summing p * v over the keys in order (a dim that is not a multiple of
  // LANES finishes in tail[q]). A block of values stays in L1 while every query adds it.
  // Query q adds `count` keys' weights p and value rows v, in order.
  auto add = [&](int64_t q, const float* p, const float* v, int64_t count) {
    accumulate(total[q], s.acc.data() + q * blocks, p, v, count, blocks, dim);
    for (int64_t k = 0; k < count; ++k) {
      for (int64_t l = 0; l < rest; ++l) tail[q][l] += p[k] * v[k * dim + blocks * LANES + l];
    }
  };
  const bool pairs = paired && rest == 0 && (blocks == 8 || blocks == 16);
  for (int64_t first = 0; first < a.start; first += KEY_BLOCK) {
    const int64_t count = std::min(KEY_BLOCK, a.start - first);
    int64_t q = 0;
#ifdef STREAMFUSE_ATTENTION_X86
    for (; pairs && q + 1 < n; q += 2) {  // two queries at once over the same value rows
      const float* p = s.scores.data() + q * keys + first;
      Lanes* acc = s.acc.data() + q * blocks;
      if (blocks == 8) accumulate_pair<8>(total + q, acc, acc + blocks, p, p + keys, vc + first * dim, count, dim);
      if (blocks == 16) accumulate_pair<16>(total + q, acc, acc + blocks, p, p + keys, vc + first * dim, count, dim);
    }
#endif
    for (; q < n; ++q) add(q, s.scores.data() + q * keys + first, vc + first * dim, count);
  }
  int64_t added = 0;  // queries [0, added) added their extra keys two at a time
#ifdef STREAMFUSE_ATTENTION_X86
  for (; pairs && added + 1 < n; added += 2) {
    // Runs of keys where both, one or neither sees them, in order: each query still adds its keys in order.
    const int64_t q = added;
    const float *p = s.scores.data() + q * keys + a.start, *seen_a = seen[q], *seen_b = seen[q + 1];
    Lanes* acc = s.acc.data() + q * blocks;
    for (int64_t x = 0, end = 0; x < a.extra; x = end) {
      const bool sees_a = seen_a[x] != 0.f, sees_b = seen_b[x] != 0.f;
      for (end = x + 1; end < a.extra && (seen_a[end] != 0.f) == sees_a && (seen_b[end] != 0.f) == sees_b;) ++end;
      if (sees_a && sees_b && blocks == 8) {
        accumulate_pair<8>(total + q, acc, acc + blocks, p + x, p + keys + x, vx + x * dim, end - x, dim);
      } else if (sees_a && sees_b) {
        accumulate_pair<16>(total + q, acc, acc + blocks, p + x, p + keys + x, vx + x * dim, end - x, dim);
      } else if (sees_a || sees_b) {
        add(sees_a ? q : q + 1, (sees_a ? p : p + keys) + x, vx + x * dim, end - x);
      }
    }
  }
#endif
  for (int64_t q = 0; q < n; ++q) {
    // The extra keys it sees, in order, a run of consecutive ones at a time (a causal chunk's row: one run).
    const float* p = s.scores.data() + q * keys + a.start;
    for (int64_t x = 0, end = 0; q >= added && x < a.extra; x = end) {
      if (seen[q][x] == 0.f) {
        end = x + 1;
        continue;
      }
      for (end = x + 1; end < a.extra && seen[q][end] != 0.f;) ++end;
      add(q, p + x, vx + x * dim, end - x);
    }
    const int64_t t = (begin + q) / group, h = g * group + (begin + q) % group;
    float* out = a.out + (t * a.heads + h) * dim;
    for (int64_t c = 0; c < blocks; ++c) {
      for (int64_t l = 0; l < LANES; ++l) out[c * LANES + l] = s.acc[q * blocks + c][l] / total[q];
    }
    for (int64_t l = 0; l < rest; ++l) out[blocks * LANES + l] = tail[q][l] / total[q];
  }
}

// Tasks [begin, end) of kv_heads * rows * group, task = g * rows * group + i (query i of KV head g, as in
// attend_batch): a thread's share reads each KV head it touches once per BATCH queries. False if its scratch
// could not be allocated (nothing escapes: the engines call it from their thread pools).
inline bool attend_tasks(const TreeAttentionArgs& a, int64_t begin, int64_t end) noexcept {
  try {
    const int64_t per_head = a.rows * (a.heads / a.kv_heads);
    Scratch scratch;
    while (begin < end) {
      const int64_t g = begin / per_head, i = begin % per_head;
      const int64_t stop = std::min({end - begin, per_head - i, BATCH});
      attend_batch(a, g, i, i + stop, scratch);
      begin += stop;
    }
    return true;
  } catch (...) {
    return false;
  }
}

// Rows x in [0, store) of the extra keys and values into slots start + x of one layer's caches (pointers to
// [kv_heads, capacity, dim]), every KV head; rows past the capacity are dropped (a padded prefill chunk may
// run past the end). validate_attention checks 0 <= start <= capacity and 0 <= store <= extra.
inline void store_rows(float* k_cache, float* v_cache, const float* k_extra, const float* v_extra, int64_t kv_heads,
                       int64_t capacity, int64_t dim, int64_t start, int64_t extra, int64_t store) {
  const int64_t rows = std::min(store, capacity - start);
  if (rows <= 0) return;
  for (int64_t g = 0; g < kv_heads; ++g) {
    const size_t to = (g * capacity + start) * dim, from = g * extra * dim, bytes = rows * dim * sizeof(float);
    std::memcpy(k_cache + to, k_extra + from, bytes);
    std::memcpy(v_cache + to, v_extra + from, bytes);
  }
}


// --- validation: every wrapper (C ABI, ExecuTorch, ONNX Runtime) checks its tensors here before a kernel runs --

// The tensors of an attention call as its wrapper got them; out is null where the wrapper allocates it afterwards
// (ONNX Runtime), from AttentionCall::out_sizes.
struct AttentionViews {
  const View *query, *k_cache, *v_cache, *start, *k_extra, *v_extra, *visible, *out;
};

// A checked attention call: the kernel's arguments (the caches' pointers at `layer`; out is null where the views'
// out is), the store and out's shape.
struct AttentionCall {
  TreeAttentionArgs args;
  float *k_layer, *v_layer;  // the same layer, written by the store
  int64_t store;
  int64_t out_sizes[4];  // [1, rows, heads, dim]
};

// Whether an attention call is sound: query [1, heads, rows, dim], k_cache = v_cache [layers, kv_heads, capacity,
// dim], start [1] int64 in [0, capacity] (read only once its view is checked), k_extra = v_extra [1, kv_heads,
// extra, dim], visible [rows, extra], out [1, rows, heads, dim], all float32 but start and dense; heads a positive
// multiple of kv_heads; layer in [0, layers), store in [0, extra], scale finite. Fills `call`, else `error`.
inline bool validate_attention(const AttentionViews& in, int64_t layer, double scale, int64_t store,
                               AttentionCall& call, Error& error) {
  constexpr const char* op = "tree_attention";
  int64_t count = 0;
  if (!check_tensor(op, "query", *in.query, kFloat32, 4, 4, error) ||
      !check_tensor(op, "k_cache", *in.k_cache, kFloat32, 4, 4, error) ||
      !check_tensor(op, "v_cache", *in.v_cache, kFloat32, 4, 4, error) ||
      !check_tensor(op, "k_extra", *in.k_extra, kFloat32, 4, 4, error) ||
      !check_tensor(op, "v_extra", *in.v_extra, kFloat32, 4, 4, error) ||
      !check_tensor(op, "visible", *in.visible, kFloat32, 2, 2, error)) {
    return false;
  }
  if (!check_tensor(op, "start", *in.start, kInt64, 1, 1, error, &count)) return false;
  if (count != 1) return error.set("%s: start must hold one number ([1] int64), got %lld", op, (long long)count);
  const int64_t *q = in.query->sizes, *c = in.k_cache->sizes, *x = in.k_extra->sizes;
  if (q[0] != 1 || x[0] != 1) {
    return error.set("%s: query and k_extra must have a batch of 1 ([1, heads, rows, dim], [1, kv_heads, extra, "
                     "dim]), got %lld and %lld", op, (long long)q[0], (long long)x[0]);
  }
  if (!same_shape(*in.k_cache, *in.v_cache) || !same_shape(*in.k_extra, *in.v_extra)) {
    return error.set("%s: v_cache must have k_cache's shape and v_extra k_extra's", op);
  }
  const int64_t heads = q[1], rows = q[2], dim = q[3], kv_heads = c[1], capacity = c[2], extra = x[2];
  if (dim < 1 || c[3] != dim || x[3] != dim) {
    return error.set("%s: query, the caches and the extra keys must share one head_dim >= 1, got %lld, %lld and "
                     "%lld", op, (long long)dim, (long long)c[3], (long long)x[3]);
  }
  if (kv_heads < 1 || x[1] != kv_heads || heads < 1 || heads % kv_heads != 0) {
    return error.set("%s: heads (%lld) must be a positive multiple of kv_heads (the caches' %lld, the extra "
                     "keys' %lld)", op, (long long)heads, (long long)kv_heads, (long long)x[1]);
  }
  const int64_t* seen = in.visible->sizes;
  if (seen[0] != rows || seen[1] != extra) {
    return error.set("%s: visible must be [rows, extra] = [%lld, %lld], got [%lld, %lld]", op, (long long)rows,
                     (long long)extra, (long long)seen[0], (long long)seen[1]);
  }
  if (layer < 0 || layer >= c[0]) {
    return error.set("%s: layer %lld is outside the cache's %lld layers", op, (long long)layer, (long long)c[0]);
  }
  if (store < 0 || store > extra) {
    return error.set("%s: store %lld is outside [0, %lld] (the extra rows)", op, (long long)store, (long long)extra);
  }
  if (!(std::fabs(scale) <= FLT_MAX)) return error.set("%s: scale must be a finite float32", op);
  const int64_t start = *static_cast<const int64_t*>(in.start->data);
  if (start < 0 || start > capacity) {
    return error.set("%s: start %lld is outside the cache's %lld slots", op, (long long)start, (long long)capacity);
  }
  const int64_t out_sizes[4] = {1, rows, heads, dim};
  if (in.out != nullptr) {
    if (!check_tensor(op, "out", *in.out, kFloat32, 4, 4, error)) return false;
    const int64_t* o = in.out->sizes;
    if (o[0] != 1 || o[1] != rows || o[2] != heads || o[3] != dim) {
      return error.set("%s: out must be [1, rows, heads, dim] = [1, %lld, %lld, %lld], got [%lld, %lld, %lld, %lld]",
                       op, (long long)rows, (long long)heads, (long long)dim, (long long)o[0], (long long)o[1],
                       (long long)o[2], (long long)o[3]);
    }
  }
  static const int64_t fastest = resolve_attention_path(kAttentionAuto);
  const int64_t offset = layer * kv_heads * capacity * dim;  // < the cache's elements: no overflow
  float* k_layer = static_cast<float*>(in.k_cache->data) + offset;
  float* v_layer = static_cast<float*>(in.v_cache->data) + offset;
  call.args = {static_cast<const float*>(in.query->data), k_layer, v_layer,
               static_cast<const float*>(in.k_extra->data), static_cast<const float*>(in.v_extra->data),
               static_cast<const float*>(in.visible->data),
               in.out != nullptr ? static_cast<float*>(in.out->data) : nullptr,
               heads, kv_heads, rows, dim, capacity, start, extra, static_cast<float>(scale), fastest};
  call.k_layer = k_layer;
  call.v_layer = v_layer;
  call.store = store;
  std::copy(out_sizes, out_sizes + 4, call.out_sizes);
  return true;
}

// The store of a checked call (after its attention).
inline void store_rows(const AttentionCall& call) {
  const TreeAttentionArgs& a = call.args;
  store_rows(call.k_layer, call.v_layer, a.k_extra, a.v_extra, a.kv_heads, a.capacity, a.dim, a.start, a.extra,
             call.store);
}

// A checked commit_rows call: n = kept accepted nodes move to slots base = start - n.. of every layer and KV head.
struct CommitCall {
  float *k_cache, *v_cache;
  int64_t layers, kv_heads, capacity, dim, start, kept;
  const int64_t* accepted;
};

// accepted's first values, for a message: "[0, 3, 3, -1]" (at most 8, then "...").
struct AcceptedText {
  char text[160] = {};
  AcceptedText(const int64_t* accepted, int64_t count) {
    int used = std::snprintf(text, sizeof(text), "[");
    for (int64_t j = 0; j < count && j < 8 && used > 0 && used < 120; ++j) {
      used += std::snprintf(text + used, sizeof(text) - used, j ? ", %lld" : "%lld", (long long)accepted[j]);
    }
    if (used > 0 && used < 140) std::snprintf(text + used, sizeof(text) - used, count > 8 ? ", ...]" : "]");
  }
};

// Whether accepted [count] holds ascending nodes >= 0, then -1 padding, whose rows base + accepted[j] (base = start
// - n) all lie in the cache; *kept = n. Every comparison is between values already known in range: no sum wraps.
inline bool commit_valid(int64_t capacity, int64_t start, const int64_t* accepted, int64_t count, int64_t* kept,
                         Error& error) {
  constexpr const char* op = "commit_rows";
  int64_t n = 0;
  while (n < count && accepted[n] >= 0) ++n;
  *kept = n;
  for (int64_t j = n; j < count; ++j) {
    if (accepted[j] != -1) {
      return error.set("%s: accepted %s must be its nodes >= 0 first, then only -1 padding", op,
                       AcceptedText(accepted, count).text);
    }
  }
  for (int64_t j = 1; j < n; ++j) {
    if (accepted[j] <= accepted[j - 1]) {
      return error.set("%s: accepted %s's nodes must be strictly increasing", op, AcceptedText(accepted, count).text);
    }
  }
  if (start < 0 || start > capacity) {
    return error.set("%s: start %lld is outside the cache's %lld slots", op, (long long)start, (long long)capacity);
  }
  if (start < n) {
    return error.set("%s: start %lld is less than the %lld accepted nodes (base = start - n < 0)", op,
                     (long long)start, (long long)n);
  }
  const int64_t base = start - n;  // in [0, capacity]
  if (n > 0 && accepted[n - 1] >= capacity - base) {
    int64_t row = 0;
    if (__builtin_add_overflow(base, accepted[n - 1], &row)) row = INT64_MAX;
    return error.set("%s: accepted node %lld is row %lld, past the cache's %lld slots", op,
                     (long long)accepted[n - 1], (long long)row, (long long)capacity);
  }
  return true;
}

// Whether a commit_rows call is sound: k_cache = v_cache [layers, kv_heads, capacity, dim] float32, start [1] and
// accepted [count] int64 (read only once their views are checked), out (if given) [1] int64, all dense; then
// commit_valid. Fills `call`, else `error`.
inline bool validate_commit(const View& k_cache, const View& v_cache, const View& start, const View& accepted,
                            const View* out, CommitCall& call, Error& error) {
  constexpr const char* op = "commit_rows";
  int64_t starts = 0, count = 0, outs = 1;
  if (!check_tensor(op, "k_cache", k_cache, kFloat32, 4, 4, error) ||
      !check_tensor(op, "v_cache", v_cache, kFloat32, 4, 4, error) ||
      !check_tensor(op, "start", start, kInt64, 1, 1, error, &starts) ||
      !check_tensor(op, "accepted", accepted, kInt64, 1, 1, error, &count) ||
      (out != nullptr && !check_tensor(op, "out", *out, kInt64, 1, 1, error, &outs))) {
    return false;
  }
  if (!same_shape(k_cache, v_cache)) return error.set("%s: the caches must be [L, kv, C, d], both of one shape", op);
  if (starts != 1 || outs != 1) return error.set("%s: start and out must each hold one number ([1] int64)", op);
  const int64_t* c = k_cache.sizes;
  const int64_t first = *static_cast<const int64_t*>(start.data);
  const int64_t* nodes = static_cast<const int64_t*>(accepted.data);
  int64_t kept = 0;
  if (!commit_valid(c[2], first, nodes, count, &kept, error)) return false;
  call = {static_cast<float*>(k_cache.data), static_cast<float*>(v_cache.data), c[0], c[1], c[2], c[3], first, kept,
          nodes};
  return true;
}

// Slot base + j of every layer and KV head receives slot base + accepted[j], j = 0..n-1 ascending. accepted[j] >= j
// (strictly increasing from >= 0), so the source is never a slot already overwritten.
inline void commit_rows(const CommitCall& call) {
  const int64_t base = call.start - call.kept, dim = call.dim;
  // Nothing to move: return before the loop over every layer and head (an empty cache may claim 2^40 of them, and
  // may have no data to memcpy).
  if (call.kept == 0 || dim == 0) return;
  for (int64_t head = 0; head < call.layers * call.kv_heads; ++head) {
    for (float* cache : {call.k_cache, call.v_cache}) {
      float* slots = cache + (head * call.capacity + base) * dim;
      for (int64_t j = 0; j < call.kept; ++j) {
        if (call.accepted[j] != j) std::memcpy(slots + j * dim, slots + call.accepted[j] * dim, dim * sizeof(float));
      }
    }
  }
}

}  // namespace streamfuse
