// What every wrapper of the kernels shares at its boundary (the C ABI, ExecuTorch, ONNX Runtime): a plain
// description of each tensor it was handed (View), the checks an op's validator runs on them before its kernel
// touches a byte, a one-line error, and threads that let no exception escape. A View is the wrapper's claim about
// memory (the engine's tensor, torch's, NumPy's); the validators check that the views agree with each other and
// with what the kernel will read and write, so a kernel reads and writes only inside the views it was given.
#pragma once

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <thread>
#include <vector>

namespace streamfuse {

// The element types the kernels take, then a few more only to name them in an error.
enum DType : int32_t {
  kFloat32 = 0, kInt64 = 1, kUint8 = 2, kInt8 = 3, kOtherType = 4,
  kInt32 = 5, kFloat16 = 6, kBFloat16 = 7, kFloat64 = 8, kBool = 9
};
constexpr int32_t kMaxRank = 8;
// At most 2^40 elements a tensor: every index a kernel computes then fits int64 and every byte count size_t.
constexpr int64_t kMaxElements = int64_t{1} << 40;

// A tensor: its data, element type, rank, sizes and strides in elements (a C struct: runtime/ops/tree_attention.py
// builds it with ctypes). Only the first `rank` sizes and strides mean anything.
struct View {
  void* data;
  int64_t sizes[kMaxRank];
  int64_t strides[kMaxRank];
  int32_t rank;
  int32_t dtype;
};

// A dense row-major view of `rank` sizes (ONNX Runtime's tensors, the tests' buffers).
inline View dense_view(void* data, DType dtype, int32_t rank, const int64_t* sizes) {
  View view{data, {}, {}, rank, dtype};
  int64_t stride = 1;
  for (int32_t i = rank < kMaxRank ? rank : kMaxRank; i-- > 0;) {
    view.sizes[i] = sizes[i];
    view.strides[i] = stride;
    if (__builtin_mul_overflow(stride, sizes[i], &stride)) stride = 0;  // too big: the validator refuses it
  }
  return view;
}

// The first problem a validator found, one line naming it and the fix.
class Error {
 public:
  const char* text() const { return text_; }
  // Sets the message; false, for `return error.set(...)` in a validator.
  __attribute__((format(printf, 2, 3))) bool set(const char* format, ...) {
    va_list args;
    va_start(args, format);
    std::vsnprintf(text_, sizeof(text_), format, args);
    va_end(args);
    return false;
  }

 private:
  char text_[320] = {};
};

// The C ABIs' failure: 1, with `text` copied into message [size] (cut to fit).
inline int report(const char* text, char* message, int64_t size) {
  if (message != nullptr && size > 0) {
    std::snprintf(message, static_cast<size_t>(size), "%s", text);
  }
  return 1;
}

inline const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case kFloat32: return "float32";
    case kInt64: return "int64";
    case kUint8: return "uint8";
    case kInt8: return "int8";
    case kInt32: return "int32";
    case kFloat16: return "float16";
    case kBFloat16: return "bfloat16";
    case kFloat64: return "float64";
    case kBool: return "bool";
    default: return "another type";
  }
}

// Whether `name` is a `dtype` tensor of rank in [low, high], dense row-major (a dim of size 1 may have any
// stride, as torch's is_contiguous allows; an empty tensor is dense), of at most kMaxElements elements, with
// data unless empty. Sets *numel (may be null).
inline bool check_tensor(const char* op, const char* name, const View& v, DType dtype, int32_t low, int32_t high,
                         Error& error, int64_t* numel = nullptr) {
  if (v.rank < low || v.rank > high || v.rank > kMaxRank || v.dtype != dtype) {
    const char* type = dtype_name(v.dtype);
    if (low == high) {
      return error.set("%s: %s must be a rank-%d %s tensor, got rank %d %s", op, name, low, dtype_name(dtype), v.rank,
                       type);
    }
    return error.set("%s: %s must be a %s tensor of rank %d to %d, got rank %d %s", op, name, dtype_name(dtype), low,
                     high, v.rank, type);
  }
  int64_t count = 1;
  for (int32_t i = 0; i < v.rank; ++i) {
    if (v.sizes[i] < 0) return error.set("%s: %s has a negative size (%lld)", op, name, (long long)v.sizes[i]);
    if (__builtin_mul_overflow(count, v.sizes[i], &count) || count > kMaxElements) {
      return error.set("%s: %s has more than 2^40 elements", op, name);
    }
  }
  if (count > 0) {
    int64_t stride = 1;
    for (int32_t i = v.rank; i-- > 0;) {
      if (v.sizes[i] != 1 && v.strides[i] != stride) {
        return error.set("%s: %s must be contiguous (row-major, no gaps): make it so (torch: .contiguous())", op,
                         name);
      }
      stride *= v.sizes[i];
    }
    if (v.data == nullptr) return error.set("%s: %s has elements but no data", op, name);
  }
  if (numel != nullptr) *numel = count;
  return true;
}

// Whether two views have the same rank and sizes.
inline bool same_shape(const View& a, const View& b) {
  if (a.rank != b.rank || a.rank > kMaxRank || a.rank < 0) return false;
  for (int32_t i = 0; i < a.rank; ++i) {
    if (a.sizes[i] != b.sizes[i]) return false;
  }
  return true;
}

// fn(begin, end) over [0, tasks) in `threads` contiguous shares (clamped to [1, tasks]), this thread taking the
// first. Nothing escapes: a share that throws, or one whose thread cannot start and that then throws here, makes
// the result false, after every started thread has joined.
template <typename F>
bool run_shares(int64_t tasks, int64_t threads, const F& fn) noexcept {
  if (tasks <= 0) return true;
  threads = threads < 1 ? 1 : (threads > tasks ? tasks : threads);
  const int64_t share = (tasks + threads - 1) / threads;
  std::atomic<bool> ok{true};
  auto part = [&fn, &ok, share, tasks](int64_t first) {
    try {
      fn(first, first + share < tasks ? first + share : tasks);
    } catch (...) {
      ok = false;
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<size_t>(threads - 1));
  } catch (...) {
    threads = 1;  // no room for the pool: one thread does it all
  }
  for (int64_t first = share; first < tasks; first += share) {
    try {
      if (threads == 1) throw std::exception();
      pool.emplace_back(part, first);
    } catch (...) {
      part(first);  // the same share here: a row's bits do not depend on the thread
    }
  }
  part(0);
  for (auto& worker : pool) worker.join();
  return ok;
}

}  // namespace streamfuse
