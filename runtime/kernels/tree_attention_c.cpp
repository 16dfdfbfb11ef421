// tree_attention.h behind a C ABI: the torch ops (runtime/ops/tree_attention.py) call it through ctypes with a View of
// every tensor. Each function validates them all (tree_attention.h) before reading any, returns 0 on success and
// otherwise 1 with the one-line error in `message`; no C++ exception crosses it.
#include <exception>

#include "tree_attention.h"

// views: query, k_cache, v_cache, start, k_extra, v_extra, visible, out (tree_attention.h's AttentionViews). The
// attention over `threads` threads (clamped to the rows x heads), then, after every thread joined, the store.
extern "C" int streamfuse_tree_attention(const streamfuse::View* views, int64_t layer, double scale, int64_t store,
                                         int64_t threads, char* message, int64_t size) noexcept {
  using namespace streamfuse;
  try {
    const AttentionViews in{&views[0], &views[1], &views[2], &views[3], &views[4], &views[5], &views[6], &views[7]};
    AttentionCall call{};
    Error error;
    if (!validate_attention(in, layer, scale, store, call, error)) return report(error.text(), message, size);
    const int64_t tasks = call.args.rows * call.args.heads;
    std::atomic<bool> ok{true};
    const bool ran = run_shares(tasks, threads, [&](int64_t begin, int64_t end) {
      if (!attend_tasks(call.args, begin, end)) ok = false;
    });
    if (!ran || !ok) return report("tree_attention: out of memory for the attention's scratch", message, size);
    store_rows(call);
    return 0;
  } catch (const std::exception& failure) {
    return report(failure.what(), message, size);
  } catch (...) {
    return report("tree_attention: an unknown C++ exception", message, size);
  }
}

// views: k_cache, v_cache, start, accepted, out; out receives start. Nothing is moved when the call is wrong.
extern "C" int streamfuse_commit_rows(const streamfuse::View* views, char* message, int64_t size) noexcept {
  using namespace streamfuse;
  try {
    CommitCall call{};
    Error error;
    if (!validate_commit(views[0], views[1], views[2], views[3], &views[4], call, error)) {
      return report(error.text(), message, size);
    }
    commit_rows(call);
    *static_cast<int64_t*>(views[4].data) = call.start;
    return 0;
  } catch (...) {
    return report("commit_rows: an unknown C++ exception", message, size);
  }
}
