// Fuzz target: q4_linear's validator and kernel (runtime/kernels/q4_linear.h) on every instruction-set path this
// CPU runs. x [.., K] of rank 1 to 4, packed weights, a LoRA of 1 to 3 segments (rank_splits: each some tiles and a
// rank of 0 to 3, U of their total rows) and out, of consistent shapes from the bytes, some views perturbed, some
// rank_splits values any int64, any out_features; whatever the validator accepts runs on buffers of exactly the
// claimed sizes (weights of any bytes: fp16 NaN and infinities among the scales), with the portable path's bits.
#include "../../runtime/kernels/q4_linear.h"
#include "fuzz_common.h"

namespace {

// x's leading dims (rank - 1 of them, product `rows`) then `last`.
std::vector<int64_t> leading(fuzz::Bytes& in, int32_t rank, int64_t last) {
  std::vector<int64_t> sizes;
  for (int32_t i = 0; i + 1 < rank; ++i) sizes.push_back(in.range(0, 3));
  sizes.push_back(last);
  return sizes;
}

void shape_of(fuzz::Tensor& t, streamfuse::DType dtype, const std::vector<int64_t>& sizes) {
  t.view = streamfuse::dense_view(nullptr, dtype, static_cast<int32_t>(sizes.size()), sizes.data());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace streamfuse;
  using namespace streamfuse::q4;
  fuzz::Bytes in(data, size);
  const int32_t rank_x = static_cast<int32_t>(in.range(1, 4));
  const int64_t depth = BLOCK * in.range(1, 3), width = in.range(1, 40);
  const int64_t path = in.range(kPortable, kAvx512Vnni);
  const int64_t tiles = tiles_of(width), blocks = depth / BLOCK;
  // rank_splits: `count` segments of >= 1 tile each, covering the tiles, each of rank 0 to 3
  const int64_t count = in.range(1, tiles < 3 ? tiles : 3);
  std::vector<int64_t> splits;
  int64_t tile = 0, rank = 0, up_rows = 0;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t spare = tiles - tile - (count - s);  // tiles beyond one for each segment left
    const int64_t own_tiles = s + 1 == count ? tiles - tile : 1 + in.range(0, spare > 0 ? spare : 0);
    const int64_t own_rank = in.range(0, 3);
    splits.insert(splits.end(), {own_tiles, own_rank});
    tile += own_tiles;
    rank += own_rank;
    up_rows += own_tiles * own_rank;
  }
  fuzz::Tensor tensors[6];
  std::vector<int64_t> x_sizes = leading(in, rank_x, depth), out_sizes = x_sizes;
  out_sizes.back() = width;
  shape_of(tensors[0], kFloat32, x_sizes);
  tensors[1].shape(kUint8, {tiles, blocks, TILE_BYTES});
  tensors[2].shape(kFloat32, {depth, rank});
  tensors[3].shape(kFloat32, {up_rows, TILE});
  tensors[4].shape(kInt64, {count, 2});
  shape_of(tensors[5], kFloat32, out_sizes);
  fuzz::perturb_some(in, tensors, 24);
  const bool pass_out = in.chance(224);  // else the wrapper allocates out (ONNX Runtime)
  if (!pass_out) tensors[5] = fuzz::Tensor();
  const int64_t out_features = in.chance(224) ? width : in.integer();
  const bool sound_splits = in.chance(224);  // else rank_splits holds the bytes' int64s
  if (in.chance(24)) splits[in.range(0, 2 * count - 1)] = in.integer();
  const bool honoured = fuzz::allocate_all(in, tensors);
  fuzz::Tensor& held = tensors[4];
  if (sound_splits && held.view.dtype == kInt64 && held.view.data != nullptr &&
      fuzz::span(held.view) >= static_cast<int64_t>(splits.size())) {
    std::memcpy(held.view.data, splits.data(), splits.size() * sizeof(int64_t));
  }
  const Views views{&tensors[0].view, &tensors[1].view, &tensors[2].view, &tensors[3].view, &tensors[4].view,
                    pass_out ? &tensors[5].view : nullptr};
  Checked checked;
  Error error;
  const bool valid = validate(views, out_features, checked, error);
  FUZZ_REQUIRE(valid == (error.text()[0] == '\0'));
  for (const fuzz::Tensor& t : tensors) FUZZ_REQUIRE(!valid || !t.detached || fuzz::span(t.view) == 0);
  if (!valid || !honoured || resolve_path(path) != path) return 0;
  fuzz::Tensor allocated;  // where the wrapper allocates out (ONNX Runtime): exactly the shape it was told
  float* out = tensors[5].as<float>();
  if (views.out == nullptr) {
    allocated.view = dense_view(nullptr, kFloat32, checked.shape.out_rank, checked.shape.out_sizes);
    allocated.allocate(in);
    if (!allocated.honoured) return 0;  // an out larger than the harness's buffers: validated, not run
    out = allocated.as<float>();
  }
  Call call(views, checked, out, path);
  call.prepare(0, call.rows());
  call.run(0, call.tiles());
  const int64_t elements = checked.shape.rows * checked.out_features;
  std::vector<float> portable(static_cast<size_t>(elements));  // the portable loops' answer, bit for bit
  Call reference(views, checked, portable.data(), kPortable);
  reference.prepare(0, reference.rows());
  reference.run(0, reference.tiles());
  FUZZ_REQUIRE(fuzz::same_bits(out, portable.data(), elements));
  return 0;
}
