// tree_attention.h and q4_linear.h as ExecuTorch kernels, streamfuse::tree_attention.out, commit_rows.out and
// q4_linear.out, for programs exported with torch.ops.streamfuse.* (runtime/ops/tree_attention.py and
// runtime/ops/q4_linear.py define the ops and their schemas). Loaded into the process before a program is (runtime/ops/tree_attention.py
// load_executorch_kernels); the attention is split over ExecuTorch's threadpool by rows and heads, never by keys.
// Both write into the cache inputs, which must be the host's buffers (export/to_executorch.py host_inputs()).
// Every kernel validates all its tensors first (the headers' validators, shared with the C ABI and ONNX Runtime),
// fails the call with the one-line error in ExecuTorch's log otherwise, and lets no C++ exception out.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include <atomic>
#include <exception>

#include "q4_linear.h"
#include "q8_linear.h"
#include "tree_attention.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

streamfuse::DType dtype_of(ScalarType type) {
  switch (type) {
    case ScalarType::Float: return streamfuse::kFloat32;
    case ScalarType::Long: return streamfuse::kInt64;
    case ScalarType::Byte: return streamfuse::kUint8;
    case ScalarType::Char: return streamfuse::kInt8;
    case ScalarType::Int: return streamfuse::kInt32;
    case ScalarType::Half: return streamfuse::kFloat16;
    case ScalarType::BFloat16: return streamfuse::kBFloat16;
    case ScalarType::Double: return streamfuse::kFloat64;
    case ScalarType::Bool: return streamfuse::kBool;
    default: return streamfuse::kOtherType;
  }
}

// A tensor as the validators see it (a rank past kMaxRank keeps no sizes: the validators refuse it by its rank).
streamfuse::View view_of(const Tensor& t) {
  const int32_t rank = static_cast<int32_t>(t.dim());
  int64_t sizes[streamfuse::kMaxRank] = {};
  for (int32_t i = 0; i < rank && i < streamfuse::kMaxRank; ++i) sizes[i] = t.size(i);
  streamfuse::View view = streamfuse::dense_view(t.mutable_data_ptr(), dtype_of(t.scalar_type()), rank, sizes);
  if (t.strides().data() != nullptr) {
    for (int32_t i = 0; i < rank && i < streamfuse::kMaxRank; ++i) view.strides[i] = t.strides()[i];
  }
  return view;
}

// The call fails with `text` in ExecuTorch's log.
void refuse(KernelRuntimeContext& context, const char* text, Error code = Error::InvalidArgument) {
  ET_LOG(Error, "%s", text);
  context.fail(code);
}

// Runs body() (which returns false when it refused the call), failing the call on any C++ exception.
template <typename F>
void guarded(KernelRuntimeContext& context, const char* op, const F& body) noexcept {
  try {
    body();
  } catch (const std::exception& failure) {
    ET_LOG(Error, "%s: %s", op, failure.what());
    context.fail(Error::Internal);
  } catch (...) {
    ET_LOG(Error, "%s: an unknown C++ exception", op);
    context.fail(Error::Internal);
  }
}

// query [1, heads, rows, dim]; caches [layers, kv_heads, capacity, dim], of which `layer` is read; start [1]
// int64; extra keys and values [1, kv_heads, extra, dim]; visible [rows, extra] float -> out [1, rows, heads, dim].
// The whole cache comes in (a per-layer slice would be a copy in the graph), and only its used span is read;
// then the first `store` extra rows are written into it at slots start.. (the schema does not declare the
// write: the graphs order it by data, see runtime/ops/tree_attention.py).
Tensor& tree_attention_out(KernelRuntimeContext& context, const Tensor& query, const Tensor& k_cache,
                           const Tensor& v_cache, int64_t layer, const Tensor& start, const Tensor& k_extra,
                           const Tensor& v_extra, const Tensor& visible, double scale, int64_t store, Tensor& out) {
  guarded(context, "tree_attention", [&] {
    const streamfuse::View views[8] = {view_of(query), view_of(k_cache), view_of(v_cache), view_of(start),
                                       view_of(k_extra), view_of(v_extra), view_of(visible), view_of(out)};
    const streamfuse::AttentionViews in{&views[0], &views[1], &views[2], &views[3],
                                        &views[4], &views[5], &views[6], &views[7]};
    streamfuse::AttentionCall call{};
    streamfuse::Error error;
    if (!streamfuse::validate_attention(in, layer, scale, store, call, error)) return refuse(context, error.text());
    std::atomic<bool> ok{true};
    executorch::extension::parallel_for(0, call.args.rows * call.args.heads, 1, [&](int64_t begin, int64_t end) {
      if (!streamfuse::attend_tasks(call.args, begin, end)) ok = false;
    });
    if (!ok) {
      return refuse(context, "tree_attention: out of memory for the attention's scratch",
                    Error::MemoryAllocationFailed);
    }
    streamfuse::store_rows(call);
  });
  return out;
}

// Caches [layers, kv_heads, capacity, dim] float, start [1] and accepted [count] int64 -> out [1] int64, a copy of
// start: the graphs feed it to every attention call so that each runs after the commit.
Tensor& commit_rows_out(KernelRuntimeContext& context, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& start, const Tensor& accepted, Tensor& out) {
  guarded(context, "commit_rows", [&] {
    const streamfuse::View views[5] = {view_of(k_cache), view_of(v_cache), view_of(start), view_of(accepted),
                                       view_of(out)};
    streamfuse::CommitCall call{};
    streamfuse::Error error;
    if (!streamfuse::validate_commit(views[0], views[1], views[2], views[3], &views[4], call, error)) {
      return refuse(context, error.text());
    }
    streamfuse::commit_rows(call);
    out.mutable_data_ptr<int64_t>()[0] = call.start;
  });
  return out;
}

// A prepared linear call's rows, then its tiles, over ExecuTorch's threadpool (neither phase allocates or throws).
template <typename C>
void run_linear(C& call) {
  using executorch::extension::parallel_for;
  parallel_for(0, call.rows(), 1, [&](int64_t first, int64_t last) { call.prepare(first, last); });
  parallel_for(0, call.tiles(), 4, [&](int64_t first, int64_t last) { call.run(first, last); });
}

// x [.., K] float, weights [tiles, K/32, 320] uint8, lora_a [K, r], lora_up [Σ tiles·r, 16], rank_splits [S, 2]
// int64 -> out [.., N]: the columns (tiles) split over ExecuTorch's threadpool, never the rows (q4_linear.h says why).
Tensor& q4_linear_out(KernelRuntimeContext& context, const Tensor& x, const Tensor& weights, const Tensor& lora_a,
                      const Tensor& lora_up, const Tensor& rank_splits, int64_t out_features, Tensor& out) {
  using namespace streamfuse::q4;
  guarded(context, "q4_linear", [&] {
    const streamfuse::View views[6] = {view_of(x),       view_of(weights),     view_of(lora_a),
                                       view_of(lora_up), view_of(rank_splits), view_of(out)};
    const Views in{&views[0], &views[1], &views[2], &views[3], &views[4], &views[5]};
    Checked checked;
    streamfuse::Error error;
    if (!validate(in, out_features, checked, error)) return refuse(context, error.text());
    static const int64_t path = resolve_path(kAuto);
    Call call(in, checked, out.mutable_data_ptr<float>(), path);
    run_linear(call);
  });
  return out;
}

// x [.., K] float, codes [tiles·K/32·512] int8, scales [tiles·K/32·16] float -> out [.., N] (q8_linear.h).
Tensor& q8_tiles_out(KernelRuntimeContext& context, const Tensor& x, const Tensor& codes, const Tensor& scales,
                     int64_t out_features, Tensor& out) {
  using namespace streamfuse;
  guarded(context, "q8_linear", [&] {
    const View views[4] = {view_of(x), view_of(codes), view_of(scales), view_of(out)};
    const q8::Views in{&views[0], &views[1], &views[2], &views[3]};
    q8::Checked checked;
    streamfuse::Error error;
    if (!q8::validate(in, out_features, checked, error)) return refuse(context, error.text());
    static const int64_t path = q4::resolve_path(q4::kAuto);
    q8::Call call(in, checked, out.mutable_data_ptr<float>(), path);
    run_linear(call);
  });
  return out;
}

}  // namespace

EXECUTORCH_LIBRARY(streamfuse, "q4_linear.out", q4_linear_out);
EXECUTORCH_LIBRARY(streamfuse, "q8_tiles.out", q8_tiles_out);
EXECUTORCH_LIBRARY(streamfuse, "tree_attention.out", tree_attention_out);
EXECUTORCH_LIBRARY(streamfuse, "commit_rows.out", commit_rows_out);
