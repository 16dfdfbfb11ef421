// tree_attention.h and q4_linear.h as ExecuTorch kernels, streamfuse::tree_attention.out, commit_rows.out and
// q4_linear.out, for programs exported with torch.ops.streamfuse.* (runtime/tree_attention.py and
// runtime/q4_linear.py define the ops and their schemas). Loaded into the process before a program is (runtime/tree_attention.py
// load_executorch_kernels); the attention is split over ExecuTorch's threadpool by rows and heads, never by keys.
// Both write into the cache inputs, which must be the host's buffers (export/to_executorch.py host_inputs()).
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <vector>

#include "q4_linear.h"
#include "q8_linear.h"
#include "tree_attention.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

// query [1, heads, rows, dim]; caches [layers, kv_heads, capacity, dim], of which `layer` is read; start [1]
// int64; extra keys and values [1, kv_heads, extra, dim]; visible [rows, extra] float -> out [1, rows, heads, dim].
// The whole cache comes in (a per-layer slice would be a copy in the graph), and only its used span is read;
// then the first `store` extra rows are written into it at slots start.. (the schema does not declare the
// write: the graphs order it by data, see runtime/tree_attention.py).
Tensor& tree_attention_out(KernelRuntimeContext& context, const Tensor& query, const Tensor& k_cache,
                           const Tensor& v_cache, int64_t layer, const Tensor& start, const Tensor& k_extra,
                           const Tensor& v_extra, const Tensor& visible, double scale, int64_t store, Tensor& out) {
  ET_KERNEL_CHECK(context, query.dim() == 4 && k_cache.dim() == 4 && k_extra.dim() == 4 && visible.dim() == 2,
                  InvalidArgument, out);
  ET_KERNEL_CHECK(context, query.scalar_type() == ScalarType::Float && start.scalar_type() == ScalarType::Long,
                  InvalidArgument, out);
  const int64_t first = start.const_data_ptr<int64_t>()[0];
  ET_KERNEL_CHECK(context, first >= 0 && first <= k_cache.size(2), InvalidArgument, out);
  ET_KERNEL_CHECK(context, layer >= 0 && layer < k_cache.size(0), InvalidArgument, out);
  ET_KERNEL_CHECK(context, store >= 0 && store <= k_extra.size(2), InvalidArgument, out);
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
  streamfuse::store_rows(k_cache.mutable_data_ptr<float>() + offset, v_cache.mutable_data_ptr<float>() + offset,
                         args.k_extra, args.v_extra, args.kv_heads, args.capacity, args.dim, first, args.extra, store);
  return out;
}

// Caches [layers, kv_heads, capacity, dim] float, start [1] and accepted [count] int64 -> out [1] int64, a copy of
// start: the graphs feed it to every attention call so that each runs after the commit.
Tensor& commit_rows_out(KernelRuntimeContext& context, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& start, const Tensor& accepted, Tensor& out) {
  ET_KERNEL_CHECK(context, k_cache.dim() == 4 && v_cache.dim() == 4 && start.dim() == 1 && accepted.dim() == 1,
                  InvalidArgument, out);
  ET_KERNEL_CHECK(context, k_cache.scalar_type() == ScalarType::Float && v_cache.scalar_type() == ScalarType::Float &&
                  start.scalar_type() == ScalarType::Long && accepted.scalar_type() == ScalarType::Long &&
                  out.scalar_type() == ScalarType::Long && start.numel() == 1 && out.numel() == 1,
                  InvalidArgument, out);
  ET_KERNEL_CHECK(context, executorch::runtime::tensors_have_same_shape(k_cache, v_cache), InvalidArgument, out);
  const int64_t first = start.const_data_ptr<int64_t>()[0];
  const char* error = streamfuse::commit_rows(
      k_cache.mutable_data_ptr<float>(), v_cache.mutable_data_ptr<float>(), k_cache.size(0), k_cache.size(1),
      k_cache.size(2), k_cache.size(3), first, accepted.const_data_ptr<int64_t>(), accepted.size(0));
  ET_KERNEL_CHECK_MSG(context, error == nullptr, InvalidArgument, out, "%s", error);
  out.mutable_data_ptr<int64_t>()[0] = first;
  return out;
}

// x [.., K] float, weights [tiles, K/32, 320] uint8, lora_a [K, r], lora_up [tiles, r, 16] -> out [.., N]: the
// columns (tiles) split over ExecuTorch's threadpool, never the rows (q4_linear.h says why).
Tensor& q4_linear_out(KernelRuntimeContext& context, const Tensor& x, const Tensor& weights, const Tensor& lora_a,
                      const Tensor& lora_up, int64_t out_features, Tensor& out) {
  using namespace streamfuse::q4;
  ET_KERNEL_CHECK(context, x.dim() >= 1 && weights.dim() == 3 && lora_a.dim() == 2 && lora_up.dim() == 3 &&
                  out.dim() == x.dim(), InvalidArgument, out);
  ET_KERNEL_CHECK(context, x.scalar_type() == ScalarType::Float && weights.scalar_type() == ScalarType::Byte &&
                  lora_a.scalar_type() == ScalarType::Float && lora_up.scalar_type() == ScalarType::Float &&
                  out.scalar_type() == ScalarType::Float, InvalidArgument, out);
  const int64_t depth = x.size(x.dim() - 1), rows = depth > 0 ? x.numel() / depth : 0, rank = lora_a.size(1);
  ET_KERNEL_CHECK_MSG(context, args_error(rows, depth, out_features, rank) == nullptr, InvalidArgument, out, "%s",
                      args_error(rows, depth, out_features, rank));
  const int64_t tiles = tiles_of(out_features), blocks = depth / BLOCK;
  ET_KERNEL_CHECK(context, weights.size(0) == tiles && weights.size(1) == blocks && weights.size(2) == TILE_BYTES &&
                  lora_a.size(0) == depth && lora_up.size(0) == tiles && lora_up.size(1) == rank &&
                  lora_up.size(2) == TILE && out.numel() == rows * out_features &&
                  out.size(out.dim() - 1) == out_features, InvalidArgument, out);
  static const int64_t path = resolve_path(kAuto);
  Call call(x.const_data_ptr<float>(), weights.const_data_ptr<uint8_t>(), lora_a.const_data_ptr<float>(),
            lora_up.const_data_ptr<float>(), out.mutable_data_ptr<float>(), rows, depth, out_features, rank, path);
  executorch::extension::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) { call.prepare(first, last); });
  executorch::extension::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) { call.run(first, last); });
  return out;
}

// x [.., K] float, codes [tiles·K/32·512] int8, scales [tiles·K/32·16] float -> out [.., N] (q8_linear.h).
Tensor& q8_tiles_out(KernelRuntimeContext& context, const Tensor& x, const Tensor& codes, const Tensor& scales,
                     int64_t out_features, Tensor& out) {
  using namespace streamfuse;
  ET_KERNEL_CHECK(context, x.dim() >= 1 && codes.dim() == 1 && scales.dim() == 1 && out.dim() == x.dim(),
                  InvalidArgument, out);
  ET_KERNEL_CHECK(context, x.scalar_type() == ScalarType::Float && codes.scalar_type() == ScalarType::Char &&
                  scales.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float,
                  InvalidArgument, out);
  const int64_t depth = x.size(x.dim() - 1), rows = depth > 0 ? x.numel() / depth : 0;
  ET_KERNEL_CHECK_MSG(context, q4::args_error(rows, depth, out_features, 0) == nullptr, InvalidArgument, out, "%s",
                      q4::args_error(rows, depth, out_features, 0));
  const int64_t tiles = q4::tiles_of(out_features), blocks = depth / q8::BLOCK;
  ET_KERNEL_CHECK(context, codes.numel() == tiles * blocks * q8::CODES_BYTES &&
                  scales.numel() == tiles * blocks * q8::TILE && out.numel() == rows * out_features &&
                  out.size(out.dim() - 1) == out_features, InvalidArgument, out);
  static const int64_t path = q4::resolve_path(q4::kAuto);
  q8::Call call(x.const_data_ptr<float>(), codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                out.mutable_data_ptr<float>(), rows, depth, out_features, path);
  executorch::extension::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) { call.prepare(first, last); });
  executorch::extension::parallel_for(0, tiles, 4, [&](int64_t first, int64_t last) { call.run(first, last); });
  return out;
}

}  // namespace

EXECUTORCH_LIBRARY(streamfuse, "q4_linear.out", q4_linear_out);
EXECUTORCH_LIBRARY(streamfuse, "q8_tiles.out", q8_tiles_out);
EXECUTORCH_LIBRARY(streamfuse, "tree_attention.out", tree_attention_out);
EXECUTORCH_LIBRARY(streamfuse, "commit_rows.out", commit_rows_out);
