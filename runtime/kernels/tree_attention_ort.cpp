// tree_attention.h, q4_linear.h and q8_linear.h as ONNX Runtime custom ops, streamfuse.TreeAttention, CommitRows,
// Q4Linear and Q8Linear, for the ONNX graphs that export/to_onnx.py translates torch.ops.streamfuse.* into:
//
//   TreeAttention(query [1, heads, rows, dim], k_cache, v_cache [layers, kv_heads, capacity, dim], start [1] int64,
//                 k_extra, v_extra [1, kv_heads, extra, dim], visible [rows, extra]; layer: int, scale: float,
//                 store: int) -> out [1, rows, heads, dim]
//   CommitRows(k_cache, v_cache, start [1] int64, accepted [A] int64) -> out [1] int64 (a copy of start)
//   Q4Linear(x [.., K] (rank 2 to 4), weights [tiles, K/32, 320] uint8, lora_a [K, r], lora_up [Σ tiles·r, 16],
//            rank_splits [S, 2] int64; out_features: int) -> out [.., out_features]   (runtime/ops/q4_linear.py)
//   Q8Linear(x [.., K], codes [tiles·K/32·512] int8, scales [tiles·K/32·16]; out_features: int) -> out [.., N]
//            (runtime/ops/q8_linear.py)
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
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

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

enum ElementType : int {  // ONNXTensorElementDataType
  kUndefined = 0, kFloat = 1, kUint8 = 2, kInt8 = 3, kInt32 = 6, kInt64 = 7, kBool = 9, kFloat16 = 10, kDouble = 11,
  kBFloat16 = 16
};
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

// What differs between the ops: their inputs' element types (ONNX Runtime checks those; the op's validator in the
// headers checks everything else), output type, attributes (read once per kernel) and work.
struct Signature {
  const char* name;
  size_t inputs;
  const ElementType* types;
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

streamfuse::DType dtype_of(ElementType type) {
  switch (type) {
    case kFloat: return streamfuse::kFloat32;
    case kInt64: return streamfuse::kInt64;
    case kUint8: return streamfuse::kUint8;
    case kInt8: return streamfuse::kInt8;
    case kInt32: return streamfuse::kInt32;
    case kBool: return streamfuse::kBool;
    case kFloat16: return streamfuse::kFloat16;
    case kDouble: return streamfuse::kFloat64;
    case kBFloat16: return streamfuse::kBFloat16;
    default: return streamfuse::kOtherType;
  }
}

// Input `index` as the validators see it (ONNX Runtime's tensors are dense; a rank past kMaxRank keeps no sizes:
// the validators refuse it by its rank). The mutable accessor: the const one is newer than kApiVersion, and the
// caches are written in place (the host's buffers: ONNX Runtime hands a CPU input over without a copy).
OrtStatus* read_input(OrtKernelContext* context, size_t index, streamfuse::View& view) {
  const OrtValue* value = nullptr;
  RETURN_IF_ERROR(ort->input(context, index, &value));
  OrtTensorTypeAndShapeInfo* info = nullptr;
  RETURN_IF_ERROR(ort->type_and_shape(value, &info));
  ElementType type = kUndefined;
  size_t rank = 0;
  int64_t sizes[streamfuse::kMaxRank] = {};
  OrtStatus* status = ort->element_type(info, &type);
  if (status == nullptr) status = ort->dims_count(info, &rank);
  if (status == nullptr && rank <= streamfuse::kMaxRank) status = ort->dims(info, sizes, rank);
  ort->release_shape(info);
  if (status != nullptr) return status;
  void* data = nullptr;
  RETURN_IF_ERROR(ort->data(const_cast<OrtValue*>(value), &data));
  const int32_t clamped = rank > 1024 ? 1024 : static_cast<int32_t>(rank);
  view = streamfuse::dense_view(data, dtype_of(type), clamped, sizes);
  return nullptr;
}

template <size_t N>
OrtStatus* read_inputs(OrtKernelContext* context, streamfuse::View (&views)[N]) {
  for (size_t i = 0; i < N; ++i) RETURN_IF_ERROR(read_input(context, i, views[i]));
  return nullptr;
}

OrtStatus* output(OrtKernelContext* context, const int64_t* shape, size_t rank, void** data) {
  OrtValue* out = nullptr;
  RETURN_IF_ERROR(ort->output(context, 0, shape, rank, &out));
  return ort->data(out, data);
}

// --- TreeAttention(query, k_cache, v_cache, start, k_extra, v_extra, visible; layer, scale, store) -> out ---
constexpr ElementType kAttentionTypes[] = {kFloat, kFloat, kFloat, kInt64, kFloat, kFloat, kFloat};

struct Work {
  const streamfuse::TreeAttentionArgs* args;
  int64_t tasks, share;
  std::atomic<bool> ok{true};
};

void run_part(void* user, size_t part) {
  Work& work = *static_cast<Work*>(user);
  const int64_t begin = static_cast<int64_t>(part) * work.share;
  if (!streamfuse::attend_tasks(*work.args, begin, std::min(begin + work.share, work.tasks))) work.ok = false;
}

OrtStatus* attention_attributes(const OrtKernelInfo* info, Kernel& kernel) {
  RETURN_IF_ERROR(ort->attribute_int64(info, "layer", &kernel.layer));
  RETURN_IF_ERROR(ort->attribute_float(info, "scale", &kernel.scale));
  return ort->attribute_int64(info, "store", &kernel.store);
}

OrtStatus* attend(const Kernel& kernel, OrtKernelContext* context) {
  streamfuse::View views[7];
  RETURN_IF_ERROR(read_inputs(context, views));
  // ONNX Runtime's input order: start comes before the extra keys
  const streamfuse::AttentionViews in{&views[0], &views[1], &views[2], &views[3],
                                      &views[4], &views[5], &views[6], nullptr};
  streamfuse::AttentionCall call{};
  streamfuse::Error error;
  if (!streamfuse::validate_attention(in, kernel.layer, kernel.scale, kernel.store, call, error)) {
    return fail(error.text());
  }
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, call.out_sizes, 4, &out));
  call.args.out = static_cast<float*>(out);
  // Parts of whole KV groups where a group fills a batch, else halves of a group: a part reads its KV head's
  // keys once for all its queries, and there are parts enough for the threads to share.
  const int64_t tasks = call.args.rows * call.args.heads, per_head = tasks / call.args.kv_heads;
  if (tasks > 0) {
    const int64_t per_part = per_head > streamfuse::BATCH ? streamfuse::BATCH : (per_head + 1) / 2;
    Work work{&call.args, tasks, per_part};
    const int64_t parts = (tasks + per_part - 1) / per_part;
    RETURN_IF_ERROR(ort->parallel_for(context, run_part, static_cast<size_t>(parts), 0, &work));
    if (!work.ok) return fail("tree_attention: out of memory for the attention's scratch");
  }
  // After the attention (ParallelFor returns when every part is done); the schema does not declare this write.
  streamfuse::store_rows(call);
  return nullptr;
}

// --- CommitRows(k_cache, v_cache, start, accepted) -> out, a copy of start -------------------------------------
constexpr ElementType kCommitTypes[] = {kFloat, kFloat, kInt64, kInt64};

OrtStatus* commit(const Kernel&, OrtKernelContext* context) {
  streamfuse::View views[4];
  RETURN_IF_ERROR(read_inputs(context, views));
  streamfuse::CommitCall call{};
  streamfuse::Error error;
  if (!streamfuse::validate_commit(views[0], views[1], views[2], views[3], nullptr, call, error)) {
    return fail(error.text());
  }
  streamfuse::commit_rows(call);
  const int64_t out_shape[1] = {1};
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, out_shape, 1, &out));
  *static_cast<int64_t*>(out) = call.start;
  return nullptr;
}

// --- Q4Linear(x, weights, lora_a, lora_up, rank_splits; out_features) -> out -------------------------------------
constexpr ElementType kQ4Types[] = {kFloat, kUint8, kFloat, kFloat, kInt64};
constexpr int64_t kTilesPerPart = 4;  // ~5 KB of codes a row: parts enough for the threads, few enough to be cheap

// Rows go to the threads LORA_ROWS at a time: the prepare loops share each column of A over that many rows.
template <typename C>
void prepare_rows(void* user, size_t part) {
  auto& call = *static_cast<C*>(user);
  const int64_t first = static_cast<int64_t>(part) * streamfuse::q4::LORA_ROWS;
  call.prepare(first, std::min(first + streamfuse::q4::LORA_ROWS, call.rows()));
}

template <typename C>
void run_tiles_part(void* user, size_t part) {
  const auto& call = *static_cast<const C*>(user);
  const int64_t first = static_cast<int64_t>(part) * kTilesPerPart;
  call.run(first, std::min(first + kTilesPerPart, call.tiles()));
}

// A prepared call's rows then tiles over ONNX Runtime's intra-op threads (neither phase allocates or throws).
template <typename C>
OrtStatus* run_linear(OrtKernelContext* context, C& call) {
  if (call.rows() == 0) return nullptr;
  const int64_t row_parts = (call.rows() + streamfuse::q4::LORA_ROWS - 1) / streamfuse::q4::LORA_ROWS;
  if (row_parts == 1) {  // a decode or a step: a parallel phase would cost more than the rows
    call.prepare(0, call.rows());
  } else {
    RETURN_IF_ERROR(ort->parallel_for(context, prepare_rows<C>, static_cast<size_t>(row_parts), 0, &call));
  }
  const size_t parts = static_cast<size_t>((call.tiles() + kTilesPerPart - 1) / kTilesPerPart);
  return ort->parallel_for(context, run_tiles_part<C>, parts, 0, &call);
}

OrtStatus* q4_attributes(const OrtKernelInfo* info, Kernel& kernel) {
  return ort->attribute_int64(info, "out_features", &kernel.out_features);
}

OrtStatus* q4_linear(const Kernel& kernel, OrtKernelContext* context) {
  using namespace streamfuse::q4;
  streamfuse::View views[5];
  RETURN_IF_ERROR(read_inputs(context, views));
  const Views in{&views[0], &views[1], &views[2], &views[3], &views[4], nullptr};
  Checked checked;
  streamfuse::Error error;
  if (!validate(in, kernel.out_features, checked, error)) return fail(error.text());
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, checked.shape.out_sizes, checked.shape.out_rank, &out));
  static const int64_t path = resolve_path(kAuto);
  Call call(in, checked, static_cast<float*>(out), path);
  return run_linear(context, call);
}

// --- Q8Linear(x, codes, scales; out_features) -> out --------------------------------------------------------------
constexpr ElementType kQ8Types[] = {kFloat, kInt8, kFloat};

OrtStatus* q8_linear(const Kernel& kernel, OrtKernelContext* context) {
  using namespace streamfuse;
  View views[3];
  RETURN_IF_ERROR(read_inputs(context, views));
  const q8::Views in{&views[0], &views[1], &views[2], nullptr};
  q8::Checked checked;
  Error error;
  if (!q8::validate(in, kernel.out_features, checked, error)) return fail(error.text());
  void* out = nullptr;
  RETURN_IF_ERROR(output(context, checked.shape.out_sizes, checked.shape.out_rank, &out));
  static const int64_t path = q4::resolve_path(q4::kAuto);
  q8::Call call(in, checked, static_cast<float*>(out), path);
  return run_linear(context, call);
}

constexpr Signature kAttention{"TreeAttention", 7, kAttentionTypes, kFloat, attention_attributes, attend};
constexpr Signature kCommit{"CommitRows", 4, kCommitTypes, kInt64, nullptr, commit};
constexpr Signature kQ4Linear{"Q4Linear", 5, kQ4Types, kFloat, q4_attributes, q4_linear};
constexpr Signature kQ8Linear{"Q8Linear", 3, kQ8Types, kFloat, q4_attributes, q8_linear};

// `body`'s status, or a failed one for a C++ exception (none may cross into ONNX Runtime).
template <typename F>
OrtStatus* guarded(const F& body) noexcept {
  try {
    return body();
  } catch (const std::exception& failure) {
    try {
      return ort->create_status(kFail, (std::string("streamfuse op: ") + failure.what()).c_str());
    } catch (...) {
    }
  } catch (...) {
  }
  return ort->create_status(kFail, "streamfuse op: a C++ exception");
}

OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi*, const OrtKernelInfo* info, void** state) {
  return guarded([&]() -> OrtStatus* {
    Kernel kernel{&signature_of(op)};
    if (kernel.op->attributes != nullptr) RETURN_IF_ERROR(kernel.op->attributes(info, kernel));
    *state = new Kernel(kernel);
    return nullptr;
  });
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
    return guarded([&] { return kernel.op->compute(kernel, context); });
  };
  return Op{op, &signature};
}

const Op kOps[] = {make_op(kAttention), make_op(kCommit), make_op(kQ4Linear), make_op(kQ8Linear)};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(kApiVersion);
  if (api == nullptr) {  // every runtime has version 1's CreateStatus
    char message[200];
    std::snprintf(message, sizeof(message), "streamfuse's TreeAttention needs ONNX Runtime 1.17 or later, this is "
                  "%s: pip install 'streamfuse[onnxruntime]'", base->GetVersionString());
    return entry<CreateStatusFn>(base->GetApi(1), 0)(kFail, message);
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
