// What the fuzz targets share: a reader of the fuzzer's bytes, and tensors that own exactly the memory their view
// claims (one malloc each, so AddressSanitizer catches a kernel's first byte outside it).
//
// A target builds a call of consistent shapes from the bytes, perturbs some views (rank, a size, a stride, the type,
// no data), fills the buffers with values from the bytes (NaN, infinities, extremes among them), and runs the op's
// validator; only if it accepts, and every view's claim could be honoured, does the kernel run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "../../runtime/kernels/boundary.h"

namespace fuzz {

// Honoured views span at most this many elements (larger claims are validated, never run).
constexpr int64_t kMaxSpan = int64_t{1} << 16;

// The fuzzer's bytes, read front to back; zeros once they run out (so a short input is a small, sound call).
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t u8() { return at_ < size_ ? data_[at_++] : 0; }

  uint64_t u64() {
    uint64_t value = 0;
    for (int i = 0; i < 8; ++i) value = value << 8 | u8();
    return value;
  }

  // An integer in [low, high] (one byte: small ranges only).
  int64_t range(int64_t low, int64_t high) { return low + static_cast<int64_t>(u8() % (high - low + 1)); }

  // Any int64, mostly small, sometimes an extreme.
  int64_t integer() {
    const uint8_t kind = u8();
    if (kind < 200) return static_cast<int64_t>(kind % 24) - 2;
    constexpr int64_t kExtremes[] = {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
                                     int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 40, -(int64_t{1} << 40),
                                     std::numeric_limits<int64_t>::max() - 1};
    if (kind < 240) return kExtremes[kind % 7];
    return static_cast<int64_t>(u64());
  }

  bool chance(uint8_t in_256) { return u8() < in_256; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

inline int64_t element_size(int32_t dtype) {
  switch (dtype) {
    case streamfuse::kInt64: case streamfuse::kFloat64: return 8;
    case streamfuse::kUint8: case streamfuse::kInt8: case streamfuse::kBool: return 1;
    case streamfuse::kFloat16: case streamfuse::kBFloat16: return 2;
    default: return 4;
  }
}

// The elements a view reaches (1 + the largest offset), or -1 when it cannot be honoured (a negative size or
// stride, a rank out of range, more than kMaxSpan).
inline int64_t span(const streamfuse::View& v) {
  if (v.rank < 0 || v.rank > streamfuse::kMaxRank) return -1;
  int64_t last = 0;
  for (int32_t i = 0; i < v.rank; ++i) {
    if (v.sizes[i] < 0) return -1;
    if (v.sizes[i] == 0) return 0;
  }
  for (int32_t i = 0; i < v.rank; ++i) {
    if (v.strides[i] < 0 || v.sizes[i] > kMaxSpan || v.strides[i] > kMaxSpan) return -1;
    last += (v.sizes[i] - 1) * v.strides[i];
    if (last >= kMaxSpan) return -1;
  }
  return last + 1;
}

// A tensor the target owns: its view, and `span` elements of memory for it (none for an empty view, whose data
// may be null), released with it.
struct Tensor {
  streamfuse::View view{};
  bool honoured = true;
  bool detached = false;  // perturbed to have no data: a validator must refuse it unless it is empty
  std::unique_ptr<void, decltype(&std::free)> memory{nullptr, &std::free};

  Tensor() = default;
  Tensor(streamfuse::DType dtype, std::initializer_list<int64_t> sizes) { shape(dtype, sizes); }

  void shape(streamfuse::DType dtype, std::initializer_list<int64_t> sizes) {
    std::vector<int64_t> all(sizes);
    view = streamfuse::dense_view(nullptr, dtype, static_cast<int32_t>(all.size()), all.data());
  }

  // Sizes changed: dense strides again (so the shape checks, not the contiguity check, see the change).
  void restride() { view = streamfuse::dense_view(nullptr, static_cast<streamfuse::DType>(view.dtype), view.rank,
                                                  view.sizes); }

  // One random change to the view (the validators must refuse any that makes it unsound).
  void perturb(Bytes& in) {
    const int32_t at = view.rank > 0 && view.rank <= streamfuse::kMaxRank ? static_cast<int32_t>(in.u8() % view.rank)
                                                                          : 0;
    switch (in.u8() % 7) {
      case 0: view.rank = static_cast<int32_t>(in.range(-1, 9)); restride(); break;
      case 1: view.sizes[at] += in.range(-2, 2); restride(); break;
      case 2: view.sizes[at] = in.integer(); restride(); break;
      case 3: view.dtype = static_cast<int32_t>(in.range(0, 10)); break;
      case 4: view.strides[at] += in.range(-2, 2); break;
      case 5: view.strides[at] = in.integer(); break;
      default: detached = true; break;
    }
  }

  // The memory the view claims, filled from the bytes (an empty view: malloc(0) or null, so that any access is
  // caught); a claim that cannot be honoured, or a detached view, gets none (the target never runs its kernel).
  void allocate(Bytes& in) {
    const int64_t elements = span(view);
    view.data = nullptr;
    honoured = elements >= 0 && !(detached && elements > 0);
    if (elements < 0 || detached) return;
    const size_t bytes = static_cast<size_t>(elements * element_size(view.dtype));
    if (bytes == 0 && in.chance(128)) return;
    memory.reset(std::malloc(bytes));
    view.data = memory.get();
    fill(in, bytes);
  }

  template <typename T>
  T* as() const { return static_cast<T*>(view.data); }

 private:
  void fill(Bytes& in, size_t bytes) {
    unsigned char* out = static_cast<unsigned char*>(memory.get());
    if (view.dtype == streamfuse::kInt64) {
      for (size_t i = 0; i + 8 <= bytes; i += 8) {
        const int64_t value = in.integer();
        std::memcpy(out + i, &value, 8);
      }
      return;
    }
    if (view.dtype == streamfuse::kFloat32) {
      constexpr float kSpecial[] = {0.f, -0.f, 1.f, -1e30f, 1e30f, std::numeric_limits<float>::infinity(),
                                    -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                                    std::numeric_limits<float>::denorm_min(), 3.4e38f};
      for (size_t i = 0; i + 4 <= bytes; i += 4) {
        const uint8_t kind = in.u8();
        const float value = kind < 10 ? kSpecial[kind] : static_cast<float>(static_cast<int8_t>(kind)) / 16.f;
        std::memcpy(out + i, &value, 4);
      }
      return;
    }
    for (size_t i = 0; i < bytes; ++i) out[i] = in.u8();
  }
};

// Perturbs each tensor with probability in_256 (one byte each).
template <size_t N>
void perturb_some(Bytes& in, Tensor (&tensors)[N], uint8_t in_256) {
  for (Tensor& t : tensors) {
    if (in.chance(in_256)) t.perturb(in);
  }
}

template <size_t N>
bool allocate_all(Bytes& in, Tensor (&tensors)[N]) {
  bool honoured = true;
  for (Tensor& t : tensors) {
    t.allocate(in);
    honoured = honoured && t.honoured;
  }
  return honoured;
}

// A broken property: the fuzzer (or the corpus runner) reports it as a crash with this input.
#define FUZZ_REQUIRE(condition)                                                                   \
  do {                                                                                            \
    if (!(condition)) {                                                                           \
      std::fprintf(stderr, "fuzz: property broken: %s (%s:%d)\n", #condition, __FILE__, __LINE__); \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

// Whether two outputs hold the same bits, a NaN matching any NaN (its payload is the hardware's): every
// instruction-set path of a linear op computes the portable loops' operations.
inline bool same_bits(const float* a, const float* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0 && !(a[i] != a[i] && b[i] != b[i])) return false;
  }
  return true;
}

}  // namespace fuzz
