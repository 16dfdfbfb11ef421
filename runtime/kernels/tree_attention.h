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
// Arithmetic (the Python reference in runtime/tree_attention.py repeats it exactly): float32 throughout;
// a dot product over head_dim in LANES partial sums (lane l takes elements l, l + LANES, ...), then the
// partials added pairwise ((0+1)+(2+3))+((4+5)+(6+7)); exp as exp_poly below; no fused multiply-add
// (built with -ffp-contract=off).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace streamfuse {

constexpr int64_t LANES = 8;
constexpr int64_t MAX_DIM = 256;  // head_dim the kernel takes (SmolLM2: 64; Llama 3: 128)

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
};

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

// dot(q, keys[k], dim) for four keys side by side: four independent chains of additions, the same sums.
inline void dot4(const float* q, const float* const* keys, int64_t dim, float* out) {
  if (dim % LANES != 0) {
    for (int k = 0; k < 4; ++k) out[k] = dot(q, keys[k], dim);
    return;
  }
  Lanes l0 = {}, l1 = {}, l2 = {}, l3 = {};
  for (int64_t i = 0; i < dim; i += LANES) {
    const Lanes x = load(q + i);
    l0 += x * load(keys[0] + i);
    l1 += x * load(keys[1] + i);
    l2 += x * load(keys[2] + i);
    l3 += x * load(keys[3] + i);
  }
  out[0] = lane_sum(l0), out[1] = lane_sum(l1), out[2] = lane_sum(l2), out[3] = lane_sum(l3);
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
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < EXP_FLOOR ? 0.f : p * scale;
}

// One (row, head) task; scores is scratch of start + extra floats.
inline void attend_row(const TreeAttentionArgs& a, int64_t t, int64_t h, std::vector<float>& scores) {
  const int64_t group = a.heads / a.kv_heads, g = h / group, dim = a.dim;
  const float* q = a.query + (h * a.rows + t) * dim;
  const float* kc = a.k_cache + g * a.capacity * dim;
  const float* vc = a.v_cache + g * a.capacity * dim;
  const float* kx = a.k_extra + g * a.extra * dim;
  const float* vx = a.v_extra + g * a.extra * dim;
  const float* seen = a.visible + t * a.extra;
  scores.resize(a.start + a.extra);
  int64_t j = 0;
  for (; j + 4 <= a.start; j += 4) {
    const float* keys[4] = {kc + j * dim, kc + (j + 1) * dim, kc + (j + 2) * dim, kc + (j + 3) * dim};
    dot4(q, keys, dim, &scores[j]);
  }
  for (; j < a.start; ++j) scores[j] = dot(q, kc + j * dim, dim);
  float top = -INFINITY;
  for (j = 0; j < a.start; ++j) {
    scores[j] *= a.scale;
    top = scores[j] > top ? scores[j] : top;
  }
  for (int64_t x = 0; x < a.extra; ++x) {
    if (seen[x] == 0.f) continue;
    scores[a.start + x] = dot(q, kx + x * dim, dim) * a.scale;
    top = scores[a.start + x] > top ? scores[a.start + x] : top;
  }
  for (j = 0; j < a.start; ++j) scores[j] = exp_poly(scores[j] - top);
  // The numerator in registers-sized blocks: acc[c] holds out[c * LANES .. c * LANES + LANES), each element
  // summing p * v over the keys in order (a dim that is not a multiple of LANES finishes in `tail`).
  const int64_t blocks = dim / LANES, rest = dim - blocks * LANES;
  Lanes acc[MAX_DIM / LANES] = {};
  float tail[LANES] = {};
  float total = 0.f;
  auto add = [&](float p, const float* v) {
    total += p;
    for (int64_t c = 0; c < blocks; ++c) acc[c] += p * load(v + c * LANES);
    for (int64_t l = 0; l < rest; ++l) tail[l] += p * v[blocks * LANES + l];
  };
  for (j = 0; j < a.start; ++j) add(scores[j], vc + j * dim);
  for (int64_t x = 0; x < a.extra; ++x) {
    if (seen[x] != 0.f) add(exp_poly(scores[a.start + x] - top), vx + x * dim);
  }
  float* out = a.out + (t * a.heads + h) * dim;
  for (int64_t c = 0; c < blocks; ++c) {
    for (int64_t l = 0; l < LANES; ++l) out[c * LANES + l] = acc[c][l] / total;
  }
  for (int64_t l = 0; l < rest; ++l) out[blocks * LANES + l] = tail[l] / total;
}

// Tasks [begin, end) of rows * heads, task = t * heads + h.
inline void attend_tasks(const TreeAttentionArgs& a, int64_t begin, int64_t end) {
  std::vector<float> scores;
  for (int64_t task = begin; task < end; ++task) attend_row(a, task / a.heads, task % a.heads, scores);
}

}  // namespace streamfuse
