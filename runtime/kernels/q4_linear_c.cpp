// q4_linear.h behind a C ABI: the torch op and the tests (runtime/ops/q4_linear.py) call it through ctypes with a View
// of every tensor, validated (q4_linear.h) before any is read: 0 on success, else 1 with the one-line error in
// `message`; no C++ exception crosses it.
#include <exception>

#include "q4_linear.h"

// The path a request resolves to on this CPU (0: the fastest), or -1 if this CPU cannot run it.
extern "C" int64_t streamfuse_q4_path(int64_t wanted) { return streamfuse::q4::resolve_path(wanted); }

// views: x, weights, lora_a, lora_up, rank_splits, out. Tiles go to `threads` threads in contiguous shares.
extern "C" int streamfuse_q4_linear(const streamfuse::View* views, int64_t out_features, int64_t path,
                                   int64_t threads, char* message, int64_t size) noexcept {
  using namespace streamfuse::q4;
  try {
    const Views in{&views[0], &views[1], &views[2], &views[3], &views[4], &views[5]};
    Checked checked;
    streamfuse::Error error;
    if (!validate(in, out_features, checked, error)) return streamfuse::report(error.text(), message, size);
    path = resolve_path(path);
    if (path < 0) {
      return streamfuse::report("q4_linear: this CPU cannot run the instruction-set path asked for", message, size);
    }
    Call call(in, checked, static_cast<float*>(views[5].data), path);
    call.prepare(0, call.rows());
    if (!run_on_threads(call, threads)) return streamfuse::report("q4_linear: a thread failed", message, size);
    return 0;
  } catch (const std::exception& failure) {
    return streamfuse::report(failure.what(), message, size);
  } catch (...) {
    return streamfuse::report("q4_linear: an unknown C++ exception", message, size);
  }
}
