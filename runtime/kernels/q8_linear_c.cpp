// q8_linear.h behind a C ABI: the torch op and the tests (runtime/ops/q8_linear.py) call it through ctypes with a View
// of every tensor, validated (q8_linear.h) before any is read: 0 on success, else 1 with the one-line error in
// `message`; no C++ exception crosses it.
#include <exception>

#include "q8_linear.h"

// views: x, codes, scales, out. Tiles go to `threads` threads in contiguous shares.
extern "C" int streamfuse_q8_linear(const streamfuse::View* views, int64_t out_features, int64_t path,
                                   int64_t threads, char* message, int64_t size) noexcept {
  using namespace streamfuse;
  try {
    const q8::Views in{&views[0], &views[1], &views[2], &views[3]};
    q8::Checked checked;
    Error error;
    if (!q8::validate(in, out_features, checked, error)) return streamfuse::report(error.text(), message, size);
    path = q4::resolve_path(path);
    if (path < 0) {
      return streamfuse::report("q8_linear: this CPU cannot run the instruction-set path asked for", message, size);
    }
    q8::Call call(in, checked, static_cast<float*>(views[3].data), path);
    call.prepare(0, call.rows());
    if (!q4::run_on_threads(call, threads)) return streamfuse::report("q8_linear: a thread failed", message, size);
    return 0;
  } catch (const std::exception& failure) {
    return streamfuse::report(failure.what(), message, size);
  } catch (...) {
    return streamfuse::report("q8_linear: an unknown C++ exception", message, size);
  }
}
