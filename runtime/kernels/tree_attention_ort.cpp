// tree_attention.h, q4_linear.h and q8_linear.h as ONNX Runtime custom ops, streamfuse.TreeAttention, CommitRows,
// Q4Linear and Q8Linear, for the ONNX graphs that export/to_onnx.py translates torch.ops.streamfuse.* into:
//
//   TreeAttention(query [1, heads, rows, dim], k_cache, v_cache [layers, kv_heads, capacity, dim], start [1] int64,
//                 k_extra, v_extra [1, kv_heads, extra, dim], visible [rows, extra]; layer: int, scale: float,
//                 store: int) -> out [1, rows, heads, dim]
//   CommitRows(k_cache, v_cache, start [1] int64, accepted [A] int64) -> out [1] int64 (a copy of start)
//   Q4Linear(x [.., K] (rank 2 to 4), weights [tiles, K/32, 320] uint8, lora_a [K, r], lora_up [tiles, r, 16];
//            out_features: int) -> out [.., out_features]   (runtime/q4_linear.py)
//   Q8Linear(x [.., K], codes [tiles·K/32·512] int8, scales [tiles·K/32·16]; out_features: int) -> out [.., N]
//            (runtime/q8_linear.py)
//
// The whole cache comes in (the host's buffer, used in place): TreeAttention reads slots [0, start) of `layer`,
// then writes its first `store` extra rows at slots start..; CommitRows compacts the accepted rows in place.
// The attention goes over ONNX Runtime's intra-op threads by rows and heads, never by keys (the header says why).
//
// The onnxruntime wheel ships no C headers, so the few pieces of ONNX Runtime's C API used here are declared
// below: OrtApi is a table of function pointers that only ever grows at its end (ONNX Runtime's ABI promise), so
// each entry is read at its fixed index; the indices are those of the API's public header (1.17 onwards, which
// added KernelContext_ParallelFor), and OrtCustomOp is that header's struct as of API version 18.
// RegisterCustomOps asks for API version kApiVersion and fails with a message on an older runtime.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "q4_linear.h"
#include "q8_linear.h"
#include "tree_attention.h"

extern "C" {
struct OrtStatus;
struct OrtApi;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtCustomOpDomain;
struct OrtSessionOptions;
struct OrtShapeInferContext;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

enum ElementType : int { kUndefined = 0, kFloat = 1, kUint8 = 2, kInt8 = 3, kInt64 = 7 };  // ONNXTensorElementDataType
enum Characteristic : int { kRequired = 0 };                        // OrtCustomOpInputOutputCharacteristic
enum MemType : int { kMemDefault = 0 };                             // OrtMemType
enum ErrorCode : int { kFail = 1, kInvalidArgument = 2 };           // OrtErrorCode

struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  ElementType (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  ElementType (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  Characteristic (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  Characteristic (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  MemType (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};
static_assert(sizeof(OrtCustomOp) == 26 * sizeof(void*), "OrtCustomOp: 26 members, the version padded to a pointer");
}

namespace {

constexpr uint32_t kApiVersion = 17;  // KernelContext_ParallelFor, CreateKernelV2 / KernelComputeV2

// OrtApi entries by index (the public header's order) and type.
template <typename F>
F entry(const OrtApi* api, size_t index) {
  return reinterpret_cast<F>(reinterpret_cast<void* const*>(api)[index]);
}
using CreateStatusFn = OrtStatus* (*)(ErrorCode, const char*);
using CreateCustomOpDomainFn = OrtStatus* (*)(const char*, OrtCustomOpDomain**);
using CustomOpDomainAddFn = OrtStatus* (*)(OrtCustomOpDomain*, const OrtCustomOp*);
using AddCustomOpDomainFn = OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*);
using GetTensorMutableDataFn = OrtStatus* (*)(OrtValue*, void**);
using GetTensorElementTypeFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, ElementType*);
using GetDimensionsCountFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*);
using GetDimensionsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t);
using GetTensorTypeAndShapeFn = OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**);
using AttributeFloatFn = OrtStatus* (*)(const OrtKernelInfo*, const char*, float*);
using AttributeInt64Fn = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
using GetInputFn = OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**);
using GetOutputFn = OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
using ReleaseShapeFn = void (*)(OrtTensorTypeAndShapeInfo*);
using ParallelForFn = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);

struct Api {
  CreateStatusFn create_status;
  CreateCustomOpDomainFn create_domain;
  CustomOpDomainAddFn domain_add;
  AddCustomOpDomainFn add_domain;
  GetTensorMutableDataFn data;
  GetTensorElementTypeFn element_type;
  GetDimensionsCountFn dims_count;
  GetDimensionsFn dims;
  GetTensorTypeAndShapeFn type_and_shape;
  AttributeFloatFn attribute_float;
  AttributeInt64Fn attribute_int64;
  GetInputFn input;
  GetOutputFn output;
  ReleaseShapeFn release_shape;
  ParallelForFn parallel_for;

  explicit Api(const OrtApi* api)
      : create_status(entry<CreateStatusFn>(api, 0)),
        create_domain(entry<CreateCustomOpDomainFn>(api, 26)),
        domain_add(entry<CustomOpDomainAddFn>(api, 27)),
        add_domain(entry<AddCustomOpDomainFn>(api, 28)),
        data(entry<GetTensorMutableDataFn>(api, 51)),
        element_type(entry<GetTensorElementTypeFn>(api, 60)),
        dims_count(entry<GetDimensionsCountFn>(api, 61)),
        dims(entry<GetDimensionsFn>(api, 62)),
        type_and_shape(entry<GetTensorTypeAndShapeFn>(api, 65)),
        attribute_float(entry<AttributeFloatFn>(api, 85)),
        attribute_int64(entry<AttributeInt64Fn>(api, 86)),
        input(entry<GetInputFn>(api, 90)),
        output(entry<GetOutputFn>(api, 91)),
        release_shape(entry<ReleaseShapeFn>(api, 99)),
        parallel_for(entry<ParallelForFn>(api, 274)) {}
};

const Api* ort = nullptr;  // set once by RegisterCustomOps

#define RETURN_IF_ERROR(expr)         \
  do {                                \
    if (OrtStatus* status = (expr)) { \
      return status;                  \
    }                                 \
  } while (0)

OrtStatus* fail(const std::string& message) { return ort->create_status(kInvalidArgument, message.c_str()); }

struct Signature;

// A kernel's state: its op and its attributes (TreeAttention's, Q4Linear's; CommitRows has none).
struct Kernel {
  const Signature* op;
  int64_t layer = 0, store = 0, out_features = 0;
  float scale = 0.f;
};

// What differs between the ops: their inputs (each checked against its name, element type and rank), output
// type, attributes (read once per kernel) and work.
struct Signature {
  const char* name;
  size_t inputs;
  const char* const* names;
  const ElementType* types;
  const int64_t* ranks;
  ElementType output;
  OrtStatus* (*attributes)(const OrtKernelInfo*, Kernel&);
  OrtStatus* (*compute)(const Kernel&, OrtKernelContext*);
};

// OrtCustomOp first, so the const OrtCustomOp* each callback gets is its Op (a standard-layout struct).
struct Op {
  OrtCustomOp base;
  const Signature* signature;
};
const Signature& signature_of(const OrtCustomOp* op) { return *reinterpret_cast<const Op*>(op)->signature; }

// A tensor input's data and shape.
struct Input {
  void* data = nullptr;
  int64_t shape[4] = {};
  size_t rank = 0;
  const float* floats() const { return static_cast<const float*>(data); }
  const int64_t* ints() const { return static_cast<const int64_t*>(data); }
};

OrtStatus* read_input(OrtKernelContext* context, const Signature& op, size_t index, Input& in) {
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(ort->input(context, index, &value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(ort->type_and_shape(value, &info));
  ElementType type = kUndefined;
  size_t rank = 0;
  OrtStatus* status = ort->element_type(info, &type);
  if (status == nullptr) status = ort->dims_count(info, &rank);
  // a rank of 0 in the signature: any of 2..4 (Q4Linear's x, [.., K])
  const size_t expected_rank = op.ranks[index] == 0 && rank >= 2 && rank <= 4 ? rank : op.ranks[index];
  if (status == nullptr && rank == expected_rank) status = ort->dims(info, in.shape, rank);
  ort->release_shape(info);
  if (status != nullptr) return status;
  in.rank = rank;
  const ElementType expected = op.types[index];
  if (type != expected || rank != expected_rank) {
    const char* type_name = expected == kInt64 ? " int64" : expected == kUint8 ? " uint8" : expected == kInt8 ? " int8"
                                                                                                       : " float";
    const std::string ranks = op.ranks[index] == 0 ? "2, 3 or 4" : std::to_string(expected_rank);
    return fail(std::string(op.name) + ": input " + op.names[index] + " must be a rank-" + ranks + type_name +
                " tensor");
  }
  // The mutable accessor: the const one is newer than kApiVersion, and the caches are written in place (the
  // host's buffers: ONNX Runtime hands a CPU input over without a copy).
  return ort->data(const_cast<OrtValue*>(value), &in.data);
}

template <size_t N>
OrtStatus* read_inputs(OrtKernelContext* context, const Signature& op, Input (&in)[N]) {
  for (size_t i = 0; i < N; ++i) RETURN_IF_ERROR(read_input(context, op, i, in[i]));
  return nullptr;
}

OrtStatus* output(OrtKernelContext* context, const int64_t* shape, size_t rank, void** data) {
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(ort->output(context, 0, shape, rank, &out));
  return ort->data(out, data);
}

// --- TreeAttention(query, k_cache, v_cache, start, k_extra, v_extra, visible; layer, scale, store) -> out ---
constexpr const char* kAttentionNames[] = {"query", "k_cache", "v_cache", "start", "k_extra", "v_extra", "visible"};
constexpr ElementType kAttentionTypes[] = {kFloat, kFloat, kFloat, kInt64, kFloat, kFloat, kFloat};
constexpr int64_t kAttentionRanks[] = {4, 4, 4, 1, 4, 4, 2};

struct Work {
  const streamfuse::TreeAttentionArgs* args;
  int64_t tasks, share;
};

void run_part(void* user, size_t part) {
  const Work& work = *static_cast<const Work*>(user);
  const int64_t begin = static_cast<int64_t>(part) * work.share;
  streamfuse::attend_tasks(*work.args, begin, std::min(begin + work.share, work.tasks));
}

OrtStatus* attention_attributes(const OrtKernelInfo* info, Kernel& kernel) {
  RETURN_IF_ERROR(ort->attribute_int64(info, "layer", &kernel.layer));
  RETURN_IF_ERROR(ort->attribute_float(info, "scale", &kernel.scale));
  return ort->attribute_int64(info, "store", &kernel.store);
}

OrtStatus* attend(const Kernel& kernel, OrtKernelContext* context) {
  Input in[7];
  RETURN_IF_ERROR(read_inputs(context, *kernel.op, in));
  const int64_t* query = in[0].shape;
  const int64_t* cache = in[1].shape;
  const int64_t* extra = in[4].shape;
  const int64_t heads = query[1], rows = query[2], dim = query[3], kv_heads = cache[1], capacity = cache[2];
  const int64_t first = in[3].ints()[0];
  bool shapes_agree = cache[3] == dim && extra[1] == kv_heads && extra[3] == dim && kv_heads > 0 &&
                      heads % kv_heads == 0 && in[6].shape[0] == rows && in[6].shape[1] == extra[2];
  for (int i = 0; i < 4; ++i) shapes_agree = shapes_agree && in[2].shape[i] == cache[i] && in[5].shape[i] == extra[i];
  if (!shapes_agree) return fail("TreeAttention: the inputs' shapes disagree (see runtime/tree_attention.py)");
  if (kernel.layer < 0 || kernel.layer >= cache[0]) return fail("TreeAttention: layer outside the cache");
  if (first < 0 || first > capacity) return fail("TreeAttention: start outside the cache");
  if (kernel.store < 0 || kernel.store > extra[2]) return fail("TreeAttention: store outside [0, the extra rows]");
  const int64_t out_shape[4] = {1, rows, heads, dim};
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, out_shape, 4, &out));
  const int64_t offset = kernel.layer * kv_heads * capacity * dim;
  const streamfuse::TreeAttentionArgs args{in[0].floats(), in[1].floats() + offset, in[2].floats() + offset,
                                           in[4].floats(), in[5].floats(), in[6].floats(), static_cast<float*>(out),
                                           heads, kv_heads, rows, dim, capacity, first, extra[2], kernel.scale};
  // Parts of whole KV groups where a group fills a batch, else halves of a group: a part reads its KV head's
  // keys once for all its queries, and there are parts enough for the threads to share.
  const int64_t tasks = rows * heads, per_head = tasks / kv_heads;
  if (tasks > 0) {
    const int64_t per_part = per_head > streamfuse::BATCH ? streamfuse::BATCH : (per_head + 1) / 2;
    const Work work{&args, tasks, per_part};
    const int64_t parts = (tasks + per_part - 1) / per_part;
    RETURN_IF_ERROR(ort->parallel_for(context, run_part, static_cast<size_t>(parts), 0, const_cast<Work*>(&work)));
  }
  // After the attention (ParallelFor returns when every part is done); the schema does not declare this write.
  streamfuse::store_rows(static_cast<float*>(in[1].data) + offset, static_cast<float*>(in[2].data) + offset,
                         in[4].floats(), in[5].floats(), kv_heads, capacity, dim, first, extra[2], kernel.store);
  return nullptr;
}

// --- CommitRows(k_cache, v_cache, start, accepted) -> out, a copy of start -------------------------------------
constexpr const char* kCommitNames[] = {"k_cache", "v_cache", "start", "accepted"};
constexpr ElementType kCommitTypes[] = {kFloat, kFloat, kInt64, kInt64};
constexpr int64_t kCommitRanks[] = {4, 4, 1, 1};

OrtStatus* commit(const Kernel& kernel, OrtKernelContext* context) {
  Input in[4];
  RETURN_IF_ERROR(read_inputs(context, *kernel.op, in));
  const int64_t* cache = in[0].shape;
  bool shapes_agree = in[2].shape[0] == 1;
  for (int i = 0; i < 4; ++i) shapes_agree = shapes_agree && in[1].shape[i] == cache[i];
  if (!shapes_agree) return fail("CommitRows: the caches' shapes differ or start is not one number");
  const int64_t first = in[2].ints()[0];
  const char* error = streamfuse::commit_rows(static_cast<float*>(in[0].data), static_cast<float*>(in[1].data),
                                              cache[0], cache[1], cache[2], cache[3], first, in[3].ints(),
                                              in[3].shape[0]);
  if (error != nullptr) return fail(error);
  const int64_t out_shape[1] = {1};
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, out_shape, 1, &out));
  *static_cast<int64_t*>(out) = first;
  return nullptr;
}

// --- Q4Linear(x, weights, lora_a, lora_up; out_features) -> out --------------------------------------------------
constexpr const char* kQ4Names[] = {"x", "weights", "lora_a", "lora_up"};
constexpr ElementType kQ4Types[] = {kFloat, kUint8, kFloat, kFloat};
constexpr int64_t kQ4Ranks[] = {0, 3, 2, 3};  // x: [.., K], rank 2 to 4
constexpr int64_t kTilesPerPart = 4;  // ~5 KB of codes a row: parts enough for the threads, few enough to be cheap

void prepare_q4_row(void* user, size_t row) {
  auto& call = *static_cast<streamfuse::q4::Call*>(user);
  call.prepare(static_cast<int64_t>(row), static_cast<int64_t>(row) + 1);
}

void run_q4_part(void* user, size_t part) {
  const auto& call = *static_cast<const streamfuse::q4::Call*>(user);
  const int64_t first = static_cast<int64_t>(part) * kTilesPerPart;
  call.run(first, std::min(first + kTilesPerPart, call.tiles()));
}

// x's rows (all dims but the last; their product at most 2^20) and the output's shape, or an error.
OrtStatus* rows_of(const char* op, const Input& x, int64_t width, int64_t& rows, int64_t (&shape)[4]) {
  rows = 1;
  for (size_t i = 0; i + 1 < x.rank; ++i) {
    if (x.shape[i] < 0 || x.shape[i] > (int64_t{1} << 20) || rows * x.shape[i] > (int64_t{1} << 20)) {
      return fail(std::string(op) + ": x's rows (all its dims but the last) must number at most 2^20");
    }
    rows *= x.shape[i];
    shape[i] = x.shape[i];
  }
  shape[x.rank - 1] = width;
  return nullptr;
}

OrtStatus* q4_attributes(const OrtKernelInfo* info, Kernel& kernel) {
  return ort->attribute_int64(info, "out_features", &kernel.out_features);
}

OrtStatus* q4_linear(const Kernel& kernel, OrtKernelContext* context) {
  using namespace streamfuse::q4;
  Input in[4];
  RETURN_IF_ERROR(read_inputs(context, *kernel.op, in));
  int64_t rows = 0, out_shape[4] = {};
  const int64_t depth = in[0].shape[in[0].rank - 1], width = kernel.out_features, rank = in[2].shape[1];
  RETURN_IF_ERROR(rows_of("Q4Linear", in[0], width, rows, out_shape));
  if (const char* error = args_error(rows, depth, width, rank)) return fail(error);
  const int64_t tiles = tiles_of(width), blocks = depth / BLOCK;
  const int64_t* w = in[1].shape;
  if (w[0] != tiles || w[1] != blocks || w[2] != TILE_BYTES || in[2].shape[0] != depth || in[3].shape[0] != tiles ||
      in[3].shape[1] != rank || in[3].shape[2] != TILE) {
    return fail("Q4Linear: weights must be [ceil(N / 16), K / 32, 320], lora_a [K, r] and lora_up [ceil(N / 16), r, "
                "16] (runtime/q4_linear.py)");
  }
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, out_shape, in[0].rank, &out));
  if (rows == 0) return nullptr;
  static const int64_t path = resolve_path(kAuto);
  Call call(in[0].floats(), static_cast<const uint8_t*>(in[1].data), in[2].floats(), in[3].floats(),
            static_cast<float*>(out), rows, depth, width, rank, path);
  if (rows <= 2) {  // a decode or a small step: a parallel phase would cost more than the rows
    call.prepare(0, rows);
  } else {
    RETURN_IF_ERROR(ort->parallel_for(context, prepare_q4_row, static_cast<size_t>(rows), 0, &call));
  }
  const size_t parts = static_cast<size_t>((tiles + kTilesPerPart - 1) / kTilesPerPart);
  return ort->parallel_for(context, run_q4_part, parts, 0, &call);
}

// --- Q8Linear(x, codes, scales; out_features) -> out --------------------------------------------------------------
constexpr const char* kQ8Names[] = {"x", "codes", "scales"};
constexpr ElementType kQ8Types[] = {kFloat, kInt8, kFloat};
constexpr int64_t kQ8Ranks[] = {0, 1, 1};  // x: [.., K], rank 2 to 4; the codes and scales flat

void prepare_q8_row(void* user, size_t row) {
  static_cast<streamfuse::q8::Call*>(user)->prepare(static_cast<int64_t>(row), static_cast<int64_t>(row) + 1);
}

void run_q8_part(void* user, size_t part) {
  const auto& call = *static_cast<const streamfuse::q8::Call*>(user);
  const int64_t first = static_cast<int64_t>(part) * kTilesPerPart;
  call.run(first, std::min(first + kTilesPerPart, call.tiles()));
}

OrtStatus* q8_linear(const Kernel& kernel, OrtKernelContext* context) {
  using namespace streamfuse;
  Input in[3];
  RETURN_IF_ERROR(read_inputs(context, *kernel.op, in));
  int64_t rows = 0, out_shape[4] = {};
  const int64_t depth = in[0].shape[in[0].rank - 1], width = kernel.out_features;
  RETURN_IF_ERROR(rows_of("Q8Linear", in[0], width, rows, out_shape));
  if (const char* error = q4::args_error(rows, depth, width, 0)) return fail(error);
  const int64_t tiles = q4::tiles_of(width), blocks = depth / q8::BLOCK;
  if (in[1].shape[0] != tiles * blocks * q8::CODES_BYTES || in[2].shape[0] != tiles * blocks * q8::TILE) {
    return fail("Q8Linear: codes must hold ceil(N / 16) x K / 32 x 512 int8 and scales 16 floats a block "
                "(runtime/q8_linear.py)");
  }
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, out_shape, in[0].rank, &out));
  if (rows == 0) return nullptr;
  static const int64_t path = q4::resolve_path(q4::kAuto);
  q8::Call call(in[0].floats(), static_cast<const int8_t*>(in[1].data), in[2].floats(), static_cast<float*>(out),
                rows, depth, width, path);
  if (rows <= 2) {
    call.prepare(0, rows);
  } else {
    RETURN_IF_ERROR(ort->parallel_for(context, prepare_q8_row, static_cast<size_t>(rows), 0, &call));
  }
  const size_t parts = static_cast<size_t>((tiles + kTilesPerPart - 1) / kTilesPerPart);
  return ort->parallel_for(context, run_q8_part, parts, 0, &call);
}

constexpr Signature kAttention{"TreeAttention", 7, kAttentionNames, kAttentionTypes, kAttentionRanks, kFloat,
                               attention_attributes, attend};
constexpr Signature kCommit{"CommitRows", 4, kCommitNames, kCommitTypes, kCommitRanks, kInt64, nullptr, commit};
constexpr Signature kQ4Linear{"Q4Linear", 4, kQ4Names, kQ4Types, kQ4Ranks, kFloat, q4_attributes, q4_linear};
constexpr Signature kQ8Linear{"Q8Linear", 3, kQ8Names, kQ8Types, kQ8Ranks, kFloat, q4_attributes, q8_linear};

OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** state) {
  Kernel kernel{&signature_of(op)};
  if (kernel.op->attributes != nullptr) RETURN_IF_ERROR(kernel.op->attributes(info, kernel));
  *state = new Kernel(kernel);
  return nullptr;
}

Op make_op(const Signature& signature) {
  OrtCustomOp op{};
  op.version = kApiVersion;
  op.GetName = [](const OrtCustomOp* self) { return signature_of(self).name; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
  op.GetInputType = [](const OrtCustomOp* self, size_t index) { return signature_of(self).types[index]; };
  op.GetInputTypeCount = [](const OrtCustomOp* self) { return signature_of(self).inputs; };
  op.GetOutputType = [](const OrtCustomOp* self, size_t) { return signature_of(self).output; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) { return size_t{1}; };
  op.KernelDestroy = [](void* state) { delete static_cast<Kernel*>(state); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return kRequired; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return kMemDefault; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = [](void* state, OrtKernelContext* context) {
    const Kernel& kernel = *static_cast<const Kernel*>(state);
    return kernel.op->compute(kernel, context);
  };
  return Op{op, &signature};
}

const Op kOps[] = {make_op(kAttention), make_op(kCommit), make_op(kQ4Linear), make_op(kQ8Linear)};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(kApiVersion);
  if (api == nullptr) {  // every runtime has version 1's CreateStatus
    const std::string message = std::string("streamfuse's TreeAttention needs ONNX Runtime 1.17 or later, this is ") +
                                base->GetVersionString() + ": pip install 'streamfuse[onnxruntime]'";
    return entry<CreateStatusFn>(base->GetApi(1), 0)(kFail, message.c_str());
  }
  static const Api table(api);
  ort = &table;
  static OrtCustomOpDomain* domain = nullptr;  // kept for the process: sessions may outlive any one caller
  if (domain == nullptr) {
    RETURN_IF_ERROR(ort->create_domain("streamfuse", &domain));
    for (const Op& op : kOps) RETURN_IF_ERROR(ort->domain_add(domain, &op.base));
  }
  return ort->add_domain(options, domain);
}
