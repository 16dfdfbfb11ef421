// tree_attention.h as an ExecuTorch kernel, streamfuse::tree_attention.out, for programs exported with
// torch.ops.streamfuse.tree_attention (runtime/tree_attention.py defines the op and its schema). Loaded
// into the process before a program is (runtime/tree_attention.py load_executorch_kernels); the work is
// split over ExecuTorch's threadpool by rows and heads, never by keys.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "tree_attention.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

// query [1, heads, rows, dim]; caches [layers, kv_heads, capacity, dim], of which `layer` is read; start [1]
// int64; extra keys and values [1, kv_heads, extra, dim]; visible [rows, extra] float -> out [1, rows, heads, dim].
// The whole cache comes in (a per-layer slice would be a copy in the graph), and only its used span is read.
Tensor& tree_attention_out(KernelRuntimeContext& context, const Tensor& query, const Tensor& k_cache,
                           const Tensor& v_cache, int64_t layer, const Tensor& start, const Tensor& k_extra,
                           const Tensor& v_extra, const Tensor& visible, double scale, Tensor& out) {
  ET_KERNEL_CHECK(context, query.dim() == 4 && k_cache.dim() == 4 && k_extra.dim() == 4 && visible.dim() == 2,
                  InvalidArgument, out);
  ET_KERNEL_CHECK(context, query.scalar_type() == ScalarType::Float && start.scalar_type() == ScalarType::Long,
                  InvalidArgument, out);
  const int64_t first = start.const_data_ptr<int64_t>()[0];
  ET_KERNEL_CHECK(context, first >= 0 && first <= k_cache.size(2), InvalidArgument, out);
  ET_KERNEL_CHECK(context, layer >= 0 && layer < k_cache.size(0), InvalidArgument, out);
  const int64_t offset = layer * k_cache.size(1) * k_cache.size(2) * k_cache.size(3);
  const streamfuse::TreeAttentionArgs args{
      query.const_data_ptr<float>(), k_cache.const_data_ptr<float>() + offset,
      v_cache.const_data_ptr<float>() + offset,
      k_extra.const_data_ptr<float>(), v_extra.const_data_ptr<float>(), visible.const_data_ptr<float>(),
      out.mutable_data_ptr<float>(), query.size(1), k_cache.size(1), query.size(2), query.size(3),
      k_cache.size(2), first, k_extra.size(2), static_cast<float>(scale)};
  executorch::extension::parallel_for(0, args.rows * args.heads, 1, [&](int64_t begin, int64_t end) {
    streamfuse::attend_tasks(args, begin, end);
  });
  return out;
}

}  // namespace

EXECUTORCH_LIBRARY(streamfuse, "tree_attention.out", tree_attention_out);
