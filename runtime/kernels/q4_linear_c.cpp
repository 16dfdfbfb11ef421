// q4_linear.h behind a C ABI: the torch op and the tests (runtime/q4_linear.py) call it through ctypes.
#include "q4_linear.h"

namespace {

// Every buffer's size from the call's sizes; the caller (runtime/q4_linear.py) passes each buffer's own size
// in elements, so a wrong one is an error here, never a read past it.
const char* sizes_error(int64_t rows, int64_t in_features, int64_t out_features, int64_t rank, int64_t x_size,
                        int64_t weights_size, int64_t a_size, int64_t up_size, int64_t out_size) {
  using namespace streamfuse::q4;
  if (const char* error = args_error(rows, in_features, out_features, rank)) return error;
  const int64_t tiles = tiles_of(out_features);
  if (x_size != rows * in_features) return "q4_linear: x must hold rows x in_features values";
  if (weights_size != tiles * (in_features / BLOCK) * TILE_BYTES) {
    return "q4_linear: the packed weights must be [ceil(out_features / 16), in_features / 32, 320] bytes";
  }
  if (a_size != in_features * rank || up_size != tiles * rank * TILE) {
    return "q4_linear: the LoRA must be A [in_features, rank] and U [ceil(out_features / 16), rank, 16]";
  }
  if (out_size != rows * out_features) return "q4_linear: out must hold rows x out_features values";
  return nullptr;
}

}  // namespace

// The path a request resolves to on this CPU (0: the fastest), or -1 if this CPU cannot run it.
extern "C" int64_t streamfuse_q4_path(int64_t wanted) { return streamfuse::q4::resolve_path(wanted); }

// null on success, else the error (a static string). Tiles go to `threads` threads in contiguous shares.
extern "C" const char* streamfuse_q4_linear(const float* x, const uint8_t* weights, const float* lora_a,
                                            const float* lora_up, float* out, int64_t rows, int64_t in_features,
                                            int64_t out_features, int64_t rank, int64_t x_size, int64_t weights_size,
                                            int64_t a_size, int64_t up_size, int64_t out_size, int64_t path,
                                            int64_t threads) {
  using namespace streamfuse::q4;
  if (const char* error = sizes_error(rows, in_features, out_features, rank, x_size, weights_size, a_size, up_size,
                                      out_size)) {
    return error;
  }
  path = resolve_path(path);
  if (path < 0) return "q4_linear: this CPU cannot run the instruction-set path asked for";
  Call call(x, weights, lora_a, lora_up, out, rows, in_features, out_features, rank, path);
  call.prepare(0, rows);
  run_on_threads(call, threads);
  return nullptr;
}
