// Fuzz target: tree attention's validator and kernel (runtime/kernels/tree_attention.h). A call of consistent
// shapes from the bytes, some views perturbed, any start, layer, store and scale; whatever the validator accepts
// runs (the attention on every path this CPU has, their bits equal, a NaN matching any NaN; then the store) on
// buffers of exactly the claimed sizes.
#include "../../runtime/kernels/tree_attention.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace streamfuse;
  fuzz::Bytes in(data, size);
  const int64_t layers = in.range(1, 3), kv = in.range(1, 3), group = in.range(1, 3), rows = in.range(0, 5);
  const int64_t dim = in.range(1, 20), capacity = in.range(0, 40), extra = in.range(0, 6);
  const int64_t heads = kv * group;
  fuzz::Tensor tensors[8];
  tensors[0].shape(kFloat32, {1, heads, rows, dim});             // query
  tensors[1].shape(kFloat32, {layers, kv, capacity, dim});       // k_cache
  tensors[2].shape(kFloat32, {layers, kv, capacity, dim});       // v_cache
  tensors[3].shape(kInt64, {1});                                 // start
  tensors[4].shape(kFloat32, {1, kv, extra, dim});               // k_extra
  tensors[5].shape(kFloat32, {1, kv, extra, dim});               // v_extra
  tensors[6].shape(kFloat32, {rows, extra});                     // visible
  tensors[7].shape(kFloat32, {1, rows, heads, dim});             // out
  fuzz::perturb_some(in, tensors, 24);
  const bool pass_out = in.chance(224);  // else the wrapper allocates out (ONNX Runtime)
  if (!pass_out) tensors[7] = fuzz::Tensor();
  const int64_t layer = in.chance(224) ? in.range(0, layers - 1) : in.integer();
  const int64_t store = in.chance(224) ? in.range(0, extra) : in.integer();
  uint32_t bits = in.chance(224) ? 0x3e800000u : static_cast<uint32_t>(in.u64());  // 0.25, or any float
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const int64_t start = in.chance(192) ? in.range(0, capacity) : in.integer();
  const bool honoured = fuzz::allocate_all(in, tensors);
  if (tensors[3].view.data != nullptr && fuzz::span(tensors[3].view) >= 1 && tensors[3].view.dtype == kInt64) {
    *tensors[3].as<int64_t>() = start;
  }
  const AttentionViews views{&tensors[0].view, &tensors[1].view, &tensors[2].view, &tensors[3].view,
                             &tensors[4].view, &tensors[5].view, &tensors[6].view,
                             pass_out ? &tensors[7].view : nullptr};
  AttentionCall call{};
  Error error;
  const bool accepted = validate_attention(views, layer, scale, store, call, error);
  FUZZ_REQUIRE(accepted == (error.text()[0] == '\0'));
  for (const fuzz::Tensor& t : tensors) FUZZ_REQUIRE(!accepted || !t.detached || fuzz::span(t.view) == 0);
  if (!accepted || !honoured) return 0;
  fuzz::Tensor allocated;  // where the wrapper allocates out (ONNX Runtime): exactly the shape it was told
  if (views.out == nullptr) {
    const int64_t* o = call.out_sizes;
    allocated.shape(kFloat32, {o[0], o[1], o[2], o[3]});
    allocated.allocate(in);
    if (!allocated.honoured) return 0;  // an out larger than the harness's buffers: validated, not run
    call.args.out = allocated.as<float>();
  }
  FUZZ_REQUIRE(attend_tasks(call.args, 0, call.args.rows * call.args.heads));
  if (resolve_attention_path(kAttentionPairs) == kAttentionPairs) {  // both paths: the same bits
    const int64_t elements = call.args.rows * call.args.heads * call.args.dim;
    std::vector<float> first(call.args.out, call.args.out + elements);
    call.args.path = call.args.path == kAttentionPairs ? kAttentionGeneric : kAttentionPairs;
    FUZZ_REQUIRE(attend_tasks(call.args, 0, call.args.rows * call.args.heads));
    FUZZ_REQUIRE(fuzz::same_bits(first.data(), call.args.out, elements));
  }
  store_rows(call);
  return 0;
}
