// The kernels' tables of sound and unsound calls, built with AddressSanitizer and UndefinedBehaviorSanitizer
// (tests/fuzz/run.sh sanitize): every sound call runs on buffers of exactly its size (its threads agreeing bit for
// bit; the attention, q4 and q8 on every instruction-set path this CPU has, all agreeing bit for bit; the store and
// commit_rows equal to plain loops), and every unsound one is refused by its validator with the message named, the
// cases the review of the C++ ops found among them. Exit status 1 with each failure on stderr.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

#include "../../runtime/kernels/q8_linear.h"
#include "../../runtime/kernels/tree_attention.h"
#include "fuzz_common.h"

namespace {

using namespace streamfuse;

int failures = 0, passed = 0;

void expect(bool condition, const std::string& what) {
  if (condition) {
    ++passed;
  } else {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

// Values for buffers: a fixed pseudo-random byte stream (fuzz::Bytes reads it as the fuzzer's input).
struct Values {
  std::vector<uint8_t> bytes;
  fuzz::Bytes in;
  explicit Values(uint32_t seed) : bytes(make(seed)), in(bytes.data(), bytes.size()) {}
  static std::vector<uint8_t> make(uint32_t seed) {
    std::vector<uint8_t> out(1 << 20);
    for (auto& b : out) {
      seed = seed * 1664525u + 1013904223u;
      b = static_cast<uint8_t>(seed >> 24);
      b = b < 12 ? 12 : b;  // no special values: the comparisons below are of finite numbers
    }
    return out;
  }
};

// --- tree attention --------------------------------------------------------------------------------------------
struct Attention {
  int64_t layers = 2, kv = 2, heads = 4, rows = 3, dim = 20, capacity = 24, extra = 3, start = 9, layer = 1,
          store = 2;
  double scale = 0.3;
  fuzz::Tensor t[8];  // query, k_cache, v_cache, start, k_extra, v_extra, visible, out

  void shape() {
    t[0].shape(kFloat32, {1, heads, rows, dim});
    t[1].shape(kFloat32, {layers, kv, capacity, dim});
    t[2].shape(kFloat32, {layers, kv, capacity, dim});
    t[3].shape(kInt64, {1});
    t[4].shape(kFloat32, {1, kv, extra, dim});
    t[5].shape(kFloat32, {1, kv, extra, dim});
    t[6].shape(kFloat32, {rows, extra});
    t[7].shape(kFloat32, {1, rows, heads, dim});
  }

  void allocate(Values& values) {
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    if (t[3].view.data != nullptr && t[3].view.dtype == kInt64 && fuzz::span(t[3].view) > 0) {
      *t[3].as<int64_t>() = start;
    }
    if (t[6].view.data != nullptr && t[6].view.dtype == kFloat32) {  // a tree: row r sees extra keys x <= r
      const int64_t keys = extra > 0 ? extra : 1;
      for (int64_t i = 0; i < fuzz::span(t[6].view); ++i) t[6].as<float>()[i] = i % keys <= i / keys;
    }
  }

  bool validate(AttentionCall& call, Error& error) const {
    const AttentionViews in{&t[0].view, &t[1].view, &t[2].view, &t[3].view, &t[4].view, &t[5].view, &t[6].view,
                            &t[7].view};
    return validate_attention(in, layer, scale, store, call, error);
  }
};

bool attend_on(const AttentionCall& call, int64_t threads) {
  std::atomic<bool> ok{true};
  const bool ran = run_shares(call.args.rows * call.args.heads, threads, [&](int64_t begin, int64_t end) {
    if (!attend_tasks(call.args, begin, end)) ok = false;
  });
  return ran && ok;
}

void sound_attention() {
  // (heads, kv, rows, dim, capacity, start, extra, store, layers, layer)
  const int64_t cases[][10] = {
      {4, 2, 3, 20, 24, 9, 3, 2, 2, 1},   {6, 2, 7, 64, 48, 40, 7, 7, 1, 0}, {1, 1, 1, 8, 8, 0, 1, 1, 1, 0},
      {3, 3, 0, 5, 10, 10, 2, 2, 3, 2},   {2, 1, 2, 3, 0, 0, 2, 0, 1, 0},    {8, 2, 16, 64, 40, 33, 16, 12, 2, 0},
      {2, 2, 2, 128, 20, 20, 0, 0, 1, 0}, {4, 4, 5, 1, 6, 6, 5, 5, 1, 0},
  };
  for (const auto& c : cases) {
    Values values(static_cast<uint32_t>(c[0] * 131 + c[3]));
    Attention a;
    a.heads = c[0], a.kv = c[1], a.rows = c[2], a.dim = c[3], a.capacity = c[4], a.start = c[5], a.extra = c[6];
    a.store = c[7], a.layers = c[8], a.layer = c[9];
    a.shape();
    a.allocate(values);
    const std::string name = "attention heads " + std::to_string(c[0]) + " dim " + std::to_string(c[3]);
    AttentionCall call{};
    Error error;
    expect(a.validate(call, error), name + ": refused: " + error.text());
    if (error.text()[0] != '\0') continue;
    const int64_t out_elements = fuzz::span(a.t[7].view);
    std::vector<float> one(out_elements);
    expect(attend_on(call, 1), name + ": one thread failed");
    if (out_elements) std::memcpy(one.data(), a.t[7].view.data, out_elements * sizeof(float));
    expect(attend_on(call, 3), name + ": three threads failed");
    expect(out_elements == 0 || std::memcmp(one.data(), a.t[7].view.data, out_elements * sizeof(float)) == 0,
           name + ": three threads' bits differ from one's");
    for (int64_t path = kAttentionGeneric; path <= kAttentionPairs; ++path) {  // every path this CPU runs
      if (resolve_attention_path(path) != path) continue;
      call.args.path = path;
      expect(attend_on(call, 2), name + ": path " + std::to_string(path) + " failed");
      expect(fuzz::same_bits(one.data(), a.t[7].as<float>(), out_elements),
             name + ": path " + std::to_string(path) + "'s bits differ from the resolved path's");
    }
    // the store: slots start.. of the layer take extra rows [0, min(store, capacity - start))
    const std::vector<float> k_before(a.t[1].as<float>(), a.t[1].as<float>() + fuzz::span(a.t[1].view));
    store_rows(call);
    const int64_t stored = std::min(a.store, a.capacity - a.start);
    bool right = true;
    for (int64_t l = 0; l < a.layers; ++l) {
      for (int64_t g = 0; g < a.kv; ++g) {
        for (int64_t s = 0; s < a.capacity; ++s) {
          for (int64_t d = 0; d < a.dim; ++d) {
            const int64_t at = ((l * a.kv + g) * a.capacity + s) * a.dim + d;
            const bool written = l == a.layer && s >= a.start && s < a.start + stored;
            const float want = written ? a.t[4].as<float>()[(g * a.extra + s - a.start) * a.dim + d] : k_before[at];
            right = right && std::memcmp(&want, a.t[1].as<float>() + at, 4) == 0;
          }
        }
      }
    }
    expect(right, name + ": the store wrote other slots than its own");
  }
}

// A change to a sound call and the message its validator must give.
struct Unsound {
  const char* what;
  std::function<void(Attention&)> change;
  const char* message;
};

void unsound_attention() {
  const int64_t huge = int64_t{1} << 62;
  const Unsound cases[] = {
      {"v_cache smaller than k_cache", [](Attention& a) { a.t[2].shape(kFloat32, {2, 2, 12, 20}); },
       "v_cache must have k_cache's shape"},
      {"v_extra of other KV heads", [](Attention& a) { a.t[5].shape(kFloat32, {1, 1, 3, 20}); },
       "v_extra k_extra's"},
      {"heads fewer than kv_heads", [](Attention& a) { a.heads = 1; a.t[0].shape(kFloat32, {1, 1, 3, 20}); },
       "heads (1) must be a positive multiple of kv_heads"},
      {"heads not a multiple", [](Attention& a) { a.t[0].shape(kFloat32, {1, 3, 3, 20}); }, "multiple of kv_heads"},
      {"no KV heads", [](Attention& a) {
         for (int i : {1, 2}) a.t[i].shape(kFloat32, {2, 0, 24, 20});
         for (int i : {4, 5}) a.t[i].shape(kFloat32, {1, 0, 3, 20});
       }, "multiple of kv_heads"},
      {"visible of other rows", [](Attention& a) { a.t[6].shape(kFloat32, {2, 3}); }, "visible must be [rows, extra]"},
      {"visible's extra", [](Attention& a) { a.t[6].shape(kFloat32, {3, 4}); }, "visible must be [rows, extra]"},
      {"out of one element", [](Attention& a) { a.t[7].shape(kFloat32, {1}); }, "out must be a rank-4 float32"},
      {"out of other heads", [](Attention& a) { a.t[7].shape(kFloat32, {1, 3, 2, 20}); },
       "out must be [1, rows, heads, dim]"},
      {"out of int64", [](Attention& a) { a.t[7].shape(kInt64, {1, 3, 4, 20}); }, "out must be a rank-4 float32"},
      {"start empty", [](Attention& a) { a.t[3].shape(kInt64, {0}); }, "start must hold one number"},
      {"start of two", [](Attention& a) { a.t[3].shape(kInt64, {2}); }, "start must hold one number"},
      {"start int32", [](Attention& a) { a.t[3].shape(kInt32, {1}); },
       "start must be a rank-1 int64 tensor, got rank 1 int32"},
      {"start past the cache", [](Attention& a) { a.start = 25; }, "start 25 is outside the cache's 24 slots"},
      {"start negative", [](Attention& a) { a.start = -1; }, "start -1 is outside"},
      {"start the least int64", [](Attention& a) { a.start = INT64_MIN; }, "is outside the cache's 24 slots"},
      {"query batch 2", [](Attention& a) { a.t[0].shape(kFloat32, {2, 4, 3, 20}); }, "must have a batch of 1"},
      {"k_extra batch 2", [](Attention& a) {
         for (int i : {4, 5}) a.t[i].shape(kFloat32, {2, 2, 3, 20});
       }, "must have a batch of 1"},
      {"layer past the cache", [](Attention& a) { a.layer = 2; }, "layer 2 is outside the cache's 2 layers"},
      {"layer negative", [](Attention& a) { a.layer = -1; }, "layer -1 is outside"},
      {"store past the extra rows", [](Attention& a) { a.store = 4; }, "store 4 is outside [0, 3] (the extra rows)"},
      {"store negative", [](Attention& a) { a.store = -1; }, "store -1 is outside"},
      {"head_dim differs", [](Attention& a) {
         for (int i : {4, 5}) a.t[i].shape(kFloat32, {1, 2, 3, 19});
       }, "share one head_dim"},
      {"query rank 3", [](Attention& a) { a.t[0].shape(kFloat32, {4, 3, 20}); }, "query must be a rank-4 float32"},
      {"k_cache float64", [](Attention& a) { a.t[1].view.dtype = kFloat64; }, "k_cache must be a rank-4 float32"},
      {"k_cache strided", [](Attention& a) { a.t[1].view.strides[2] = 40; }, "k_cache must be contiguous"},
      {"visible transposed", [](Attention& a) {
         a.t[6].shape(kFloat32, {3, 3});
         std::swap(a.t[6].view.strides[0], a.t[6].view.strides[1]);
       }, "visible must be contiguous"},
      {"query without data", [](Attention& a) { a.t[0].detached = true; }, "query has elements but no data"},
      {"sizes whose product wraps", [](Attention& a) { a.t[1].shape(kFloat32, {huge, 4, 2, 2}); },
       "k_cache has more than 2^40 elements"},
      {"a negative size", [](Attention& a) { a.t[6].shape(kFloat32, {-3, -1}); }, "visible has a negative size"},
      {"rank past the limit", [](Attention& a) { a.t[0].view.rank = 99; }, "query must be a rank-4 float32"},
      {"scale not finite", [](Attention& a) { a.scale = 1e300; }, "scale must be a finite float32"},
  };
  for (const Unsound& c : cases) {
    Values values(7);
    Attention a;
    a.shape();
    c.change(a);
    a.allocate(values);
    AttentionCall call{};
    Error error;
    const bool valid = a.validate(call, error);
    expect(!valid && std::strstr(error.text(), c.message) != nullptr && std::strchr(error.text(), '\n') == nullptr,
           std::string("attention, ") + c.what + ": wanted \"" + c.message + "\", got \"" + error.text() + "\"");
  }
}

// --- commit_rows ----------------------------------------------------------------------------------------------
struct Commit {
  int64_t start;
  std::vector<int64_t> accepted;
  const char* message;  // null: sound
};

void commit_cases() {
  const Commit cases[] = {
      {12, {0, -1, -1, -1}, nullptr}, {20, {0, 2, 5, -1}, nullptr}, {9, {1, 2, -1, -1}, nullptr},
      {30, {-1, -1, -1, -1}, nullptr}, {3, {0, 1, 2, -1}, nullptr}, {40, {2, 3, 5, 11}, nullptr}, {0, {}, nullptr},
      {12, {0, -1, 2, -1}, "accepted [0, -1, 2, -1] must be its nodes >= 0 first, then only -1 padding"},
      {12, {0, -2, -1, -1}, "must be its nodes >= 0 first"},
      {12, {0, 3, 3, -1}, "accepted [0, 3, 3, -1]'s nodes must be strictly increasing"},
      {2, {0, 1, 2, -1}, "start 2 is less than the 3 accepted nodes"},
      {47, {0, 3, -1, -1}, "accepted node 3 is row 48, past the cache's 48 slots"},
      {49, {-1, -1, -1, -1}, "start 49 is outside the cache's 48 slots"},
      {-1, {-1}, "start -1 is outside"},
      // start - n + accepted[n - 1] wraps in int64: the row is refused, not read
      {2, {INT64_MAX}, "accepted node 9223372036854775807 is row 9223372036854775807, past"},
      {48, {0, 1, INT64_MAX - 1}, "past the cache's 48 slots"},
      {INT64_MAX, {0}, "is outside the cache's 48 slots"},
      {INT64_MIN, {-1}, "is outside the cache's 48 slots"},
  };
  for (const Commit& c : cases) {
    Values values(static_cast<uint32_t>(c.start & 0xFFFF));
    fuzz::Tensor t[5];
    t[0].shape(kFloat32, {2, 2, 48, 5});
    t[1].shape(kFloat32, {2, 2, 48, 5});
    t[2].shape(kInt64, {1});
    t[3].shape(kInt64, {static_cast<int64_t>(c.accepted.size())});
    t[4].shape(kInt64, {1});
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    *t[2].as<int64_t>() = c.start;
    if (!c.accepted.empty()) std::memcpy(t[3].view.data, c.accepted.data(), c.accepted.size() * 8);
    const std::vector<float> k_before(t[0].as<float>(), t[0].as<float>() + fuzz::span(t[0].view));
    CommitCall call{};
    Error error;
    const bool valid = validate_commit(t[0].view, t[1].view, t[2].view, t[3].view, &t[4].view, call, error);
    const std::string name = "commit start " + std::to_string(c.start);
    if (c.message != nullptr) {
      expect(!valid && std::strstr(error.text(), c.message) != nullptr,
             name + ": wanted \"" + c.message + "\", got \"" + error.text() + "\"");
      continue;
    }
    expect(valid, name + ": refused: " + error.text());
    if (!valid) continue;
    commit_rows(call);
    int64_t n = 0;
    while (n < static_cast<int64_t>(c.accepted.size()) && c.accepted[n] >= 0) ++n;
    bool right = true;
    for (int64_t head = 0; head < 4; ++head) {
      for (int64_t s = 0; s < 48; ++s) {
        const int64_t j = s - (c.start - n), from = j >= 0 && j < n ? c.start - n + c.accepted[j] : s;
        right = right && std::memcmp(t[0].as<float>() + (head * 48 + s) * 5, k_before.data() + (head * 48 + from) * 5,
                                     20) == 0;
      }
    }
    expect(right, name + ": the rows moved are not the accepted ones");
  }
  // the views around the values
  const std::pair<std::function<void(fuzz::Tensor*)>, const char*> views[] = {
      {[](fuzz::Tensor* t) { t[1].shape(kFloat32, {2, 2, 40, 5}); }, "both of one shape"},
      {[](fuzz::Tensor* t) { t[3].shape(kInt32, {4}); }, "accepted must be a rank-1 int64 tensor, got rank 1 int32"},
      {[](fuzz::Tensor* t) { t[2].shape(kInt64, {2}); }, "start and out must each hold one number"},
      {[](fuzz::Tensor* t) { t[2].shape(kInt64, {0}); }, "start and out must each hold one number"},
      {[](fuzz::Tensor* t) { t[4].shape(kInt64, {3}); }, "start and out must each hold one number"},
      {[](fuzz::Tensor* t) { t[0].shape(kFloat32, {2, 48, 5}); }, "k_cache must be a rank-4 float32"},
      {[](fuzz::Tensor* t) { t[3].view.strides[0] = 2; }, "accepted must be contiguous"},
      {[](fuzz::Tensor* t) { t[0].detached = true; }, "k_cache has elements but no data"},
  };
  // caches of head_dim 0 (no data): a sound call that moves nothing (the fuzzer found memcpy given null there)
  {
    Values values(4);
    fuzz::Tensor t[5];
    t[0].shape(kFloat32, {2, 2, 48, 0});
    t[1].shape(kFloat32, {2, 2, 48, 0});
    t[2].shape(kInt64, {1});
    t[3].shape(kInt64, {2});
    t[4].shape(kInt64, {1});
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    t[0].view.data = t[1].view.data = nullptr;
    *t[2].as<int64_t>() = 20;
    t[3].as<int64_t>()[0] = 1;
    t[3].as<int64_t>()[1] = 4;
    CommitCall call{};
    Error error;
    const bool valid = validate_commit(t[0].view, t[1].view, t[2].view, t[3].view, &t[4].view, call, error);
    expect(valid, std::string("commit of empty rows: refused: ") + error.text());
    if (valid) commit_rows(call);
  }
  // an empty cache that claims 2^38 layers: nothing to move, at once (the fuzzer found the loop over them)
  {
    Values values(6);
    fuzz::Tensor t[5];
    t[0].shape(kFloat32, {int64_t{1} << 38, 2, 0, 5});
    t[1].shape(kFloat32, {int64_t{1} << 38, 2, 0, 5});
    t[2].shape(kInt64, {1});
    t[3].shape(kInt64, {1});
    t[4].shape(kInt64, {1});
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    *t[2].as<int64_t>() = 0;
    *t[3].as<int64_t>() = -1;
    CommitCall call{};
    Error error;
    const bool valid = validate_commit(t[0].view, t[1].view, t[2].view, t[3].view, &t[4].view, call, error);
    expect(valid, std::string("commit of an empty cache: refused: ") + error.text());
    if (valid) commit_rows(call);
  }
  for (const auto& [change, message] : views) {
    Values values(3);
    fuzz::Tensor t[5];
    t[0].shape(kFloat32, {2, 2, 48, 5});
    t[1].shape(kFloat32, {2, 2, 48, 5});
    t[2].shape(kInt64, {1});
    t[3].shape(kInt64, {4});
    t[4].shape(kInt64, {1});
    change(t);
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    CommitCall call{};
    Error error;
    const bool valid = validate_commit(t[0].view, t[1].view, t[2].view, t[3].view, &t[4].view, call, error);
    expect(!valid && std::strstr(error.text(), message) != nullptr,
           std::string("commit views: wanted \"") + message + "\", got \"" + error.text() + "\"");
  }
}

// --- q4 / q8 --------------------------------------------------------------------------------------------------
// run(path) -> out, on every path this CPU runs (each on exactly sized buffers, with `path` threads): true if all
// gave `elements` values and agree bit for bit.
template <typename Run>
bool paths_agree(int64_t elements, const Run& run) {
  std::vector<float> first;
  bool agree = true;
  for (int64_t path = q4::kPortable; path <= q4::kAvx512Vnni; ++path) {
    if (q4::resolve_path(path) != path) continue;
    std::vector<float> out = run(path);
    if (first.empty() && !out.empty()) first = out;
    agree = agree && static_cast<int64_t>(out.size()) == elements && (first.empty() || out == first);
  }
  return agree;
}

// A q4_linear call of `segments` (tiles, rank) rows on `rows` rows of x [1, rows, depth], out_features `width`,
// its buffers filled from `values` (finite fp16 scales and minimums), on every path: the paths' bits if they agree.
struct Q4Call {
  int64_t rows, depth, width;
  std::vector<int64_t> segments;  // (tiles, rank) pairs
  fuzz::Tensor t[5];              // x, weights, lora_a, lora_up, rank_splits

  Q4Call(int64_t rows_, int64_t depth_, int64_t width_, std::vector<int64_t> segments_, Values& values)
      : rows(rows_), depth(depth_), width(width_), segments(std::move(segments_)) {
    int64_t rank = 0, up_rows = 0;
    for (size_t s = 0; s < segments.size(); s += 2) {
      rank += segments[s + 1];
      up_rows += segments[s] * segments[s + 1];
    }
    t[0].shape(kFloat32, {1, rows, depth});
    t[1].shape(kUint8, {q4::tiles_of(width), depth / 32, 320});
    t[2].shape(kFloat32, {depth, rank});
    t[3].shape(kFloat32, {up_rows, 16});
    t[4].shape(kInt64, {static_cast<int64_t>(segments.size() / 2), 2});
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    for (int64_t i = 0; i < q4::tiles_of(width) * depth / 32; ++i) {  // finite fp16 scales and minimums
      for (int64_t c16 = 0; c16 < 32; ++c16) t[1].as<uint8_t>()[i * 320 + 256 + 2 * c16 + 1] &= 0x3B;
    }
    std::memcpy(t[4].as<int64_t>(), segments.data(), segments.size() * sizeof(int64_t));
  }

  std::vector<float> run(int64_t path, const std::string& name) const {
    Values values(1);
    fuzz::Tensor out(kFloat32, {1, rows, width});
    out.allocate(values.in);
    const q4::Views in{&t[0].view, &t[1].view, &t[2].view, &t[3].view, &t[4].view, &out.view};
    q4::Checked checked;
    Error error;
    const bool valid = q4::validate(in, width, checked, error);
    expect(valid, name + ": refused: " + error.text());
    if (!valid) return std::vector<float>();
    q4::Call call(in, checked, out.as<float>(), path);
    call.prepare(0, call.rows());
    expect(q4::run_on_threads(call, path), name + ": threads failed");
    return std::vector<float>(out.as<float>(), out.as<float>() + rows * width);
  }
};

void q4_cases() {
  // (rows, in_features, out_features, rank): one segment
  const int64_t sound[][4] = {{1, 32, 1, 0}, {3, 64, 17, 2}, {9, 96, 40, 3}, {0, 32, 16, 1}, {17, 64, 33, 0}};
  for (const auto& c : sound) {
    const int64_t rows = c[0], depth = c[1], width = c[2], rank = c[3];
    Values values(static_cast<uint32_t>(rows * 7 + width));
    const Q4Call call(rows, depth, width, {q4::tiles_of(width), rank}, values);
    const std::string name = "q4 rows " + std::to_string(rows) + " N " + std::to_string(width);
    const bool agree = paths_agree(rows * width, [&](int64_t path) { return call.run(path, name); });
    expect(agree, name + ": the paths' bits differ");
  }
  // Packed nodes: several segments (tiles, rank) on one x, the last layer ending inside its tile or not. Every
  // path agrees, and each segment's columns are the bits of its layer alone (its own weights and LoRA, one segment).
  const std::vector<std::vector<int64_t>> packed[] = {{{2, 3, 1, 0, 1, 2}}, {{1, 0, 3, 4}}, {{1, 5, 1, 5, 2, 5}}};
  const int64_t ragged[] = {0, 7, 15};
  for (size_t p = 0; p < std::size(packed); ++p) {
    const std::vector<int64_t>& segments = packed[p][0];
    int64_t tiles = 0;
    for (size_t s = 0; s < segments.size(); s += 2) tiles += segments[s];
    const int64_t rows = 5, depth = 64, width = 16 * tiles - ragged[p];
    Values values(static_cast<uint32_t>(100 + p));
    const Q4Call whole(rows, depth, width, segments, values);
    const std::string name = "q4 segments case " + std::to_string(p);
    const bool agree = paths_agree(rows * width, [&](int64_t path) { return whole.run(path, name); });
    expect(agree, name + ": the paths' bits differ");
    const std::vector<float> together = whole.run(q4::kPortable, name);
    int64_t tile = 0, column = 0, up_row = 0;
    for (size_t s = 0; s < segments.size(); s += 2) {  // the layer alone: its slices of every buffer
      const int64_t own_tiles = segments[s], own_rank = segments[s + 1];
      const int64_t own_width = std::min(16 * own_tiles, width - 16 * tile);
      Values unused(1);
      Q4Call alone(rows, depth, own_width, {own_tiles, own_rank}, unused);
      std::memcpy(alone.t[0].as<float>(), whole.t[0].as<float>(), rows * depth * sizeof(float));
      std::memcpy(alone.t[1].as<uint8_t>(), whole.t[1].as<uint8_t>() + tile * (depth / 32) * 320,
                  own_tiles * (depth / 32) * 320);
      for (int64_t k = 0; k < depth; ++k) {
        for (int64_t j = 0; j < own_rank; ++j) {
          alone.t[2].as<float>()[k * own_rank + j] = whole.t[2].as<float>()[k * whole.t[2].view.sizes[1] + column + j];
        }
      }
      if (own_rank > 0) {
        std::memcpy(alone.t[3].as<float>(), whole.t[3].as<float>() + up_row * 16, own_tiles * own_rank * 16 * 4);
      }
      const std::vector<float> own = alone.run(q4::kPortable, name + " alone");
      bool same = !own.empty() && !together.empty();
      for (int64_t r = 0; same && r < rows; ++r) {
        same = std::memcmp(own.data() + r * own_width, together.data() + r * width + 16 * tile,
                           own_width * sizeof(float)) == 0;
      }
      expect(same, name + ": segment " + std::to_string(s / 2) + " differs from its layer alone");
      tile += own_tiles;
      column += own_rank;
      up_row += own_tiles * own_rank;
    }
  }
  // (change to the shapes, out_features or rank_splits' values; the message it must get) on x [1, 3, 64], weights
  // [2, 2, 320], A [64, 2], U [4, 16], rank_splits [[2, 2]], out [1, 3, 20]
  using Change = std::function<void(fuzz::Tensor*, int64_t&, std::vector<int64_t>&)>;
  const std::pair<Change, const char*> unsound[] = {
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[1].shape(kUint8, {2, 1, 320}); }, "the packed weights must be"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[1].shape(kInt8, {2, 2, 320}); }, "weights must be a rank-3 uint8"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[3].shape(kFloat32, {2, 16}); }, "the LoRA's U must be"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[3].shape(kFloat32, {2, 2, 16}); }, "lora_up must be a rank-2"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[2].shape(kFloat32, {32, 2}); }, "the LoRA's A must be"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[4].shape(kInt32, {1, 2}); }, "rank_splits must be a rank-2 int64"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {2, 2}); s = {1, 2, 1, 2}; },
       "ranks must be >= 0 each and sum to lora_a's 2 columns, row 1 has 2"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {2, 2}); s = {2, 1, 1, 1}; },
       "tiles must be >= 1 each and sum to ceil(out_features / 16) = 2, row 1 has 1"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {2, 2}); s = {0, 1, 2, 1}; },
       "tiles must be >= 1 each"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {2, 2}); s = {1, INT64_MAX, 1, 2}; },
       "ranks must be >= 0 each"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {2, 2}); s = {1, -1, 1, 3}; },
       "ranks must be >= 0 each"},
      {[](fuzz::Tensor*, int64_t&, auto& s) { s = {1, 2}; }, "must cover every tile and rank column"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {0, 2}); s = {}; }, "1 to 64 of them, got [0, 2]"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {65, 2}); s.assign(130, 1); },
       "1 to 64 of them, got [65, 2]"},
      {[](fuzz::Tensor* t, int64_t&, auto& s) { t[4].shape(kInt64, {1, 3}); s = {2, 2, 0}; },
       "rank_splits must be [segments, 2]"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[5].shape(kFloat32, {1}); }, "out must be a rank-3 float32"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[5].shape(kFloat32, {1, 3, 19}); }, "out must have x's shape"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[0].shape(kFloat32, {1, 1, 1, 3, 64}); },
       "x must be a float32 tensor of rank 1 to 4"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[0].shape(kFloat32, {3, 48}); },
       "in_features must be a positive multiple of 32"},
      {[](fuzz::Tensor*, int64_t& n, auto&) { n = 0; }, "out_features must be in [1, 2^24], got 0"},
      {[](fuzz::Tensor*, int64_t& n, auto&) { n = INT64_MAX; }, "out_features must be in"},
      {[](fuzz::Tensor* t, int64_t&, auto&) { t[0].view.strides[0] = 1; t[0].view.strides[1] = 1; },
       "x must be contiguous"},
  };
  for (const auto& [change, message] : unsound) {
    Values values(5);
    int64_t width = 20;
    std::vector<int64_t> splits = {2, 2};
    fuzz::Tensor t[6];
    t[0].shape(kFloat32, {1, 3, 64});
    t[1].shape(kUint8, {2, 2, 320});
    t[2].shape(kFloat32, {64, 2});
    t[3].shape(kFloat32, {4, 16});
    t[4].shape(kInt64, {1, 2});
    t[5].shape(kFloat32, {1, 3, 20});
    change(t, width, splits);
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    if (!splits.empty() && t[4].view.dtype == kInt64 && fuzz::span(t[4].view) >= static_cast<int64_t>(splits.size())) {
      std::memcpy(t[4].as<int64_t>(), splits.data(), splits.size() * sizeof(int64_t));
    }
    const q4::Views in{&t[0].view, &t[1].view, &t[2].view, &t[3].view, &t[4].view, &t[5].view};
    q4::Checked checked;
    Error error;
    const bool valid = q4::validate(in, width, checked, error);
    expect(!valid && std::strstr(error.text(), message) != nullptr,
           std::string("q4: wanted \"") + message + "\", got \"" + error.text() + "\"");
  }
}

void q8_cases() {
  const int64_t sound[][3] = {{1, 32, 1}, {3, 64, 17}, {9, 96, 40}, {0, 32, 16}};
  for (const auto& c : sound) {
    const int64_t rows = c[0], depth = c[1], width = c[2], blocks = q4::tiles_of(width) * depth / 32;
    Values values(static_cast<uint32_t>(rows * 5 + width));
    fuzz::Tensor t[3];
    t[0].shape(kFloat32, {rows, depth});
    t[1].shape(kInt8, {blocks * 512});
    t[2].shape(kFloat32, {blocks * 16});
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    const std::string name = "q8 rows " + std::to_string(rows) + " N " + std::to_string(width);
    const bool agree = paths_agree(rows * width, [&](int64_t path) {
      fuzz::Tensor out(kFloat32, {rows, width});
      out.allocate(values.in);
      const q8::Views in{&t[0].view, &t[1].view, &t[2].view, &out.view};
      q8::Checked checked;
      Error error;
      const bool valid = q8::validate(in, width, checked, error);
      expect(valid, name + ": refused: " + error.text());
      if (!valid) return std::vector<float>();
      q8::Call call(in, checked, out.as<float>(), path);
      call.prepare(0, call.rows());
      expect(q4::run_on_threads(call, path), name + ": threads failed");
      return std::vector<float>(out.as<float>(), out.as<float>() + rows * width);
    });
    expect(agree, name + ": the paths' bits differ");
  }
  const std::pair<std::function<void(fuzz::Tensor*)>, const char*> unsound[] = {
      {[](fuzz::Tensor* t) { t[1].shape(kInt8, {2 * 2 * 512 - 1}); }, "codes must hold"},
      {[](fuzz::Tensor* t) { t[2].shape(kFloat32, {2 * 2 * 16 + 1}); }, "codes must hold"},
      {[](fuzz::Tensor* t) { t[1].shape(kUint8, {2 * 2 * 512}); }, "codes must be a rank-1 int8"},
      {[](fuzz::Tensor* t) { t[3].shape(kFloat32, {2, 21}); }, "out must have x's shape"},
      {[](fuzz::Tensor* t) { t[3].shape(kFloat32, {1}); }, "out must be a rank-2 float32"},
      {[](fuzz::Tensor* t) { t[0].shape(kFloat32, {2, 40}); }, "in_features must be"},
  };
  for (const auto& [change, message] : unsound) {
    Values values(9);
    fuzz::Tensor t[4];
    t[0].shape(kFloat32, {2, 64});
    t[1].shape(kInt8, {2 * 2 * 512});
    t[2].shape(kFloat32, {2 * 2 * 16});
    t[3].shape(kFloat32, {2, 20});
    change(t);
    for (fuzz::Tensor& tensor : t) tensor.allocate(values.in);
    const q8::Views in{&t[0].view, &t[1].view, &t[2].view, &t[3].view};
    q8::Checked checked;
    Error error;
    const bool valid = q8::validate(in, 20, checked, error);
    expect(!valid && std::strstr(error.text(), message) != nullptr,
           std::string("q8: wanted \"") + message + "\", got \"" + error.text() + "\"");
  }
}

// Threads that let no exception out: a share that throws makes the call fail, the other shares still run, and
// nothing terminates the process.
void boundary_cases() {
  std::atomic<int64_t> done{0};
  const bool ok = run_shares(10, 4, [&](int64_t begin, int64_t end) {
    if (begin == 3) throw std::runtime_error("a share fails");
    done += end - begin;
  });
  expect(!ok && done == 7, "run_shares: a throwing share must make it false while the others run");
  done = 0;
  expect(run_shares(5, 99, [&](int64_t begin, int64_t end) { done += end - begin; }) && done == 5,
         "run_shares: more threads than tasks must still run every task once");
  expect(run_shares(0, 4, [](int64_t, int64_t) { throw std::runtime_error("never called"); }),
         "run_shares: no tasks must run nothing");
  Error error;
  const View rank_nine = dense_view(nullptr, kFloat32, 9, std::vector<int64_t>(9, 1).data());
  expect(!check_tensor("op", "x", rank_nine, kFloat32, 1, 9, error) && std::strstr(error.text(), "rank 9"),
         std::string("check_tensor: a rank past kMaxRank must be refused, got \"") + error.text() + "\"");
}

}  // namespace

int main() {
  boundary_cases();
  sound_attention();
  unsound_attention();
  commit_cases();
  q4_cases();
  q8_cases();
  std::printf("kernel_cases: %d checks passed, %d failed\n", passed, failures);
  return failures == 0 ? 0 : 1;
}
