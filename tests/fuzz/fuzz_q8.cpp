// Fuzz target: the Q8_0 head's validator and kernel (runtime/kernels/q8_linear.h) on every instruction-set path
// this CPU runs: x [.., K] of rank 1 to 4, flat codes and scales, out, of consistent shapes from the bytes, some
// views perturbed, any out_features; whatever the validator accepts runs on buffers of exactly the claimed sizes,
// with the portable path's bits.
#include "../../runtime/kernels/q8_linear.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace streamfuse;
  fuzz::Bytes in(data, size);
  const int32_t rank_x = static_cast<int32_t>(in.range(1, 4));
  const int64_t depth = q8::BLOCK * in.range(1, 3), width = in.range(1, 40);
  const int64_t path = in.range(q4::kPortable, q4::kAvx512Vnni);
  const int64_t blocks = q4::tiles_of(width) * (depth / q8::BLOCK);
  fuzz::Tensor tensors[4];
  std::vector<int64_t> x_sizes;
  for (int32_t i = 0; i + 1 < rank_x; ++i) x_sizes.push_back(in.range(0, 3));
  x_sizes.push_back(depth);
  std::vector<int64_t> out_sizes = x_sizes;
  out_sizes.back() = width;
  tensors[0].view = dense_view(nullptr, kFloat32, rank_x, x_sizes.data());
  tensors[1].shape(kInt8, {blocks * q8::CODES_BYTES});
  tensors[2].shape(kFloat32, {blocks * q8::TILE});
  tensors[3].view = dense_view(nullptr, kFloat32, rank_x, out_sizes.data());
  fuzz::perturb_some(in, tensors, 24);
  const bool pass_out = in.chance(224);  // else the wrapper allocates out (ONNX Runtime)
  if (!pass_out) tensors[3] = fuzz::Tensor();
  const int64_t out_features = in.chance(224) ? width : in.integer();
  const bool honoured = fuzz::allocate_all(in, tensors);
  const q8::Views views{&tensors[0].view, &tensors[1].view, &tensors[2].view,
                        pass_out ? &tensors[3].view : nullptr};
  q8::Checked checked;
  Error error;
  const bool valid = q8::validate(views, out_features, checked, error);
  FUZZ_REQUIRE(valid == (error.text()[0] == '\0'));
  for (const fuzz::Tensor& t : tensors) FUZZ_REQUIRE(!valid || !t.detached || fuzz::span(t.view) == 0);
  if (!valid || !honoured || q4::resolve_path(path) != path) return 0;
  fuzz::Tensor allocated;  // where the wrapper allocates out (ONNX Runtime): exactly the shape it was told
  float* out = tensors[3].as<float>();
  if (views.out == nullptr) {
    allocated.view = dense_view(nullptr, kFloat32, checked.shape.out_rank, checked.shape.out_sizes);
    allocated.allocate(in);
    if (!allocated.honoured) return 0;  // an out larger than the harness's buffers: validated, not run
    out = allocated.as<float>();
  }
  q8::Call call(views, checked, out, path);
  call.prepare(0, call.rows());
  call.run(0, call.tiles());
  const int64_t elements = checked.shape.rows * checked.out_features;
  std::vector<float> portable(static_cast<size_t>(elements));  // the portable loops' answer, bit for bit
  q8::Call reference(views, checked, portable.data(), q4::kPortable);
  reference.prepare(0, reference.rows());
  reference.run(0, reference.tiles());
  FUZZ_REQUIRE(fuzz::same_bits(out, portable.data(), elements));
  return 0;
}
