// tree_attention.h behind a C ABI: the torch op (runtime/tree_attention.py) calls it through ctypes.
#include <algorithm>
#include <thread>
#include <vector>

#include "tree_attention.h"

extern "C" void streamfuse_tree_attention(const float* query, const float* k_cache, const float* v_cache,
                                          const float* k_extra, const float* v_extra, const float* visible, float* out,
                                          int64_t heads, int64_t kv_heads, int64_t rows, int64_t dim,
                                          int64_t capacity, int64_t start, int64_t extra, float scale,
                                          int64_t threads) {
  const streamfuse::TreeAttentionArgs args{query, k_cache, v_cache, k_extra, v_extra, visible, out,
                                           heads, kv_heads, rows, dim, capacity, start, extra, scale};
  const int64_t tasks = rows * heads;
  threads = std::max<int64_t>(1, std::min(threads, tasks));
  if (threads == 1) {
    streamfuse::attend_tasks(args, 0, tasks);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t share = (tasks + threads - 1) / threads;
  for (int64_t begin = 0; begin < tasks; begin += share) {
    pool.emplace_back([&args, begin, share, tasks] { streamfuse::attend_tasks(args, begin, std::min(begin + share, tasks)); });
  }
  for (auto& worker : pool) worker.join();
}
