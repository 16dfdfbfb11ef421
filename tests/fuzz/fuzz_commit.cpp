// Fuzz target: commit_rows' validator and kernel (runtime/kernels/tree_attention.h). Caches of consistent shapes,
// some views perturbed, any start and any accepted nodes (mostly ascending with -1 padding, sometimes not, sometimes
// extremes); whatever the validator accepts moves its rows in buffers of exactly the claimed sizes.
#include "../../runtime/kernels/tree_attention.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace streamfuse;
  fuzz::Bytes in(data, size);
  const int64_t layers = in.range(1, 3), kv = in.range(1, 3), capacity = in.range(0, 40), dim = in.range(1, 12);
  const int64_t count = in.range(0, 8);
  fuzz::Tensor tensors[5];
  tensors[0].shape(kFloat32, {layers, kv, capacity, dim});  // k_cache
  tensors[1].shape(kFloat32, {layers, kv, capacity, dim});  // v_cache
  tensors[2].shape(kInt64, {1});                            // start
  tensors[3].shape(kInt64, {count});                        // accepted
  tensors[4].shape(kInt64, {1});                            // out
  fuzz::perturb_some(in, tensors, 24);
  const bool pass_out = in.chance(224);  // else the wrapper allocates out (ONNX Runtime)
  if (!pass_out) tensors[4] = fuzz::Tensor();
  const int64_t start = in.chance(192) ? in.range(0, capacity) : in.integer();
  // accepted: ascending small nodes then -1 padding, unless the bytes say otherwise
  std::vector<int64_t> nodes;
  int64_t node = -1;
  const int64_t kept = in.range(0, count);
  for (int64_t j = 0; j < count; ++j) {
    node = j < kept ? node + in.range(1, 4) : -1;
    nodes.push_back(in.chance(232) ? node : in.integer());
  }
  const bool honoured = fuzz::allocate_all(in, tensors);
  if (tensors[2].view.data != nullptr && fuzz::span(tensors[2].view) >= 1 && tensors[2].view.dtype == kInt64) {
    *tensors[2].as<int64_t>() = start;
  }
  const fuzz::Tensor& accepted = tensors[3];
  if (accepted.view.data != nullptr && accepted.view.dtype == kInt64) {
    const int64_t room = fuzz::span(accepted.view);
    for (int64_t j = 0; j < room && j < count; ++j) accepted.as<int64_t>()[j] = nodes[j];
  }
  const View* out = pass_out ? &tensors[4].view : nullptr;
  CommitCall call{};
  Error error;
  const bool valid = validate_commit(tensors[0].view, tensors[1].view, tensors[2].view, tensors[3].view, out, call,
                                     error);
  FUZZ_REQUIRE(valid == (error.text()[0] == '\0'));
  for (const fuzz::Tensor& t : tensors) FUZZ_REQUIRE(!valid || !t.detached || fuzz::span(t.view) == 0);
  if (!valid || !honoured) return 0;
  FUZZ_REQUIRE(call.kept >= 0 && call.kept <= call.start && call.start <= call.capacity);
  commit_rows(call);
  if (out != nullptr) *static_cast<int64_t*>(out->data) = call.start;
  return 0;
}
