// q8_linear.h behind a C ABI: the torch op and the tests (runtime/q8_linear.py) call it through ctypes.
#include "q8_linear.h"

// null on success, else the error (a static string). Each buffer's size in elements comes with it, checked
// against the call's sizes before anything is read.
extern "C" const char* streamfuse_q8_linear(const float* x, const int8_t* codes, const float* scales, float* out,
                                            int64_t rows, int64_t in_features, int64_t out_features, int64_t x_size,
                                            int64_t codes_size, int64_t scales_size, int64_t out_size, int64_t path,
                                            int64_t threads) {
  using namespace streamfuse;
  if (const char* error = q4::args_error(rows, in_features, out_features, 0)) return error;
  const int64_t tiles = q4::tiles_of(out_features), blocks = in_features / q8::BLOCK;
  if (x_size != rows * in_features) return "q8_linear: x must hold rows x in_features values";
  if (codes_size != tiles * blocks * q8::CODES_BYTES || scales_size != tiles * blocks * q8::TILE) {
    return "q8_linear: codes must hold ceil(out_features / 16) x in_features / 32 x 512 bytes and scales 16 a block";
  }
  if (out_size != rows * out_features) return "q8_linear: out must hold rows x out_features values";
  path = q4::resolve_path(path);
  if (path < 0) return "q8_linear: this CPU cannot run the instruction-set path asked for";
  q8::Call call(x, codes, scales, out, rows, in_features, out_features, path);
  call.prepare(0, rows);
  q4::run_on_threads(call, threads);
  return nullptr;
}
