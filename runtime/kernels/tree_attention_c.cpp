// tree_attention.h behind a C ABI: the torch ops (runtime/tree_attention.py) call it through ctypes.
#include <algorithm>
#include <thread>
#include <vector>

#include "tree_attention.h"

// The attention, then (after every thread joined) the store of the first `store` extra rows into the
// layer's caches, whose pointers come in const only because the attention just reads them.
extern "C" void streamfuse_tree_attention(const float* query, const float* k_cache, const float* v_cache,
                                          const float* k_extra, const float* v_extra, const float* visible, float* out,
                                          int64_t heads, int64_t kv_heads, int64_t rows, int64_t dim,
                                          int64_t capacity, int64_t start, int64_t extra, float scale,
                                          int64_t store, int64_t threads) {
  const streamfuse::TreeAttentionArgs args{query, k_cache, v_cache, k_extra, v_extra, visible, out,
                                           heads, kv_heads, rows, dim, capacity, start, extra, scale};
  const int64_t tasks = rows * heads;
  threads = std::max<int64_t>(1, std::min(threads, tasks));
  if (threads == 1) {
    streamfuse::attend_tasks(args, 0, tasks);
  } else {
    std::vector<std::thread> pool;
    const int64_t share = (tasks + threads - 1) / threads;
    for (int64_t begin = 0; begin < tasks; begin += share) {
      pool.emplace_back([&args, begin, share, tasks] { streamfuse::attend_tasks(args, begin, std::min(begin + share, tasks)); });
    }
    for (auto& worker : pool) worker.join();
  }
  streamfuse::store_rows(const_cast<float*>(k_cache), const_cast<float*>(v_cache), k_extra, v_extra, kv_heads,
                         capacity, dim, start, extra, store);
}

// 0, or 1 when the call is wrong (nothing copied; the torch op checks first and names the error).
extern "C" int streamfuse_commit_rows(float* k_cache, float* v_cache, int64_t layers, int64_t kv_heads,
                                      int64_t capacity, int64_t dim, int64_t start, const int64_t* accepted,
                                      int64_t count) {
  return streamfuse::commit_rows(k_cache, v_cache, layers, kv_heads, capacity, dim, start, accepted, count) ? 1 : 0;
}
