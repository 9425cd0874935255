// Host ops of CUDA sampling filters and tree acceptance: validate (small metadata tensors are
// copied to the host once and checked by the same code as the CPU ops), launch, and turn the
// kernels' per-row status records into the CPU ops' ValueErrors.
#include <algorithm>
#include <vector>

#include "acceptance.cuh"
#include "common.cuh"
#include "pyspec/acceptance.h"
#include "pyspec/cuda_ops.h"

namespace pyspec {
namespace cuda {

namespace {

// Stream-ordered device buffer.
class DeviceBuffer {
 public:
  DeviceBuffer(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) PYSPEC_CUDA_CALL(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

void ApplySamplingFilters(const TensorView& logits, const TensorView& temperature,
                          const TensorView& top_k, const TensorView& top_p,
                          const TensorView& min_p, const TensorView& probs, void* stream_ptr) {
  CheckDevice(logits, "logits", DeviceType::kCUDA);
  RequireDevice("apply_sampling_filters");
  DeviceGuard guard(logits.device.index);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Shapes first (on the views), then the parameter values from host copies.
  CheckDType(temperature, "temperature", {DType::kFloat32});
  CheckDType(top_k, "top_k", {DType::kInt32});
  CheckDType(top_p, "top_p", {DType::kFloat32});
  CheckDType(min_p, "min_p", {DType::kFloat32});
  for (const auto* t : {&temperature, &top_k, &top_p, &min_p}) {
    CheckSameDevice(logits, "logits", *t, "sampling parameters");
    CheckContiguous(*t, "sampling parameters");
  }
  const auto temp = ToHost<float>(temperature, stream);
  const auto k = ToHost<int32_t>(top_k, stream);
  const auto tp = ToHost<float>(top_p, stream);
  const auto mp = ToHost<float>(min_p, stream);
  PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
  detail::FilterParams params;
  params.temperature = temp.data();
  params.top_k = k.data();
  params.top_p = tp.data();
  params.min_p = mp.data();
  detail::CheckFilterArgs(logits, temperature, top_k, top_p, min_p, probs, DeviceType::kCUDA,
                          params);
  const int64_t rows = logits.shape[0], vocab = logits.shape[1];
  if (rows == 0) return;
  PYSPEC_CHECK(rows <= INT32_MAX, "'logits' has too many rows for one launch");
  DeviceBuffer status(sizeof(long long) * 2 * rows, stream);
  const float* t = temperature.ptr<const float>();
  const int32_t* kk = top_k.ptr<const int32_t>();
  const float* p = top_p.ptr<const float>();
  const float* m = min_p.ptr<const float>();
  float* out = probs.ptr<float>();
  long long* st = status.as<long long>();
  const unsigned grid = static_cast<unsigned>(rows);
  switch (logits.dtype) {
    case DType::kFloat32:
      kernels::FilterKernel<float><<<grid, kernels::kFilterThreads, 0, stream>>>(
          logits.ptr<const float>(), vocab, t, kk, p, m, out, st);
      break;
    case DType::kBFloat16:
      kernels::FilterKernel<__nv_bfloat16><<<grid, kernels::kFilterThreads, 0, stream>>>(
          logits.ptr<const __nv_bfloat16>(), vocab, t, kk, p, m, out, st);
      break;
    default:
      kernels::FilterKernel<__half><<<grid, kernels::kFilterThreads, 0, stream>>>(
          logits.ptr<const __half>(), vocab, t, kk, p, m, out, st);
  }
  PYSPEC_CUDA_CALL(cudaGetLastError());
  std::vector<long long> host(2 * rows);
  PYSPEC_CUDA_CALL(cudaMemcpyAsync(host.data(), st, host.size() * sizeof(long long),
                                   cudaMemcpyDeviceToHost, stream));
  PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
  for (int64_t r = 0; r < rows; ++r) {
    PYSPEC_CHECK(host[2 * r] != accept_logic::kFilterBadValue, "'logits' row ", r,
                 " has a NaN or +inf entry at token ", host[2 * r + 1]);
    PYSPEC_CHECK(host[2 * r] != accept_logic::kFilterNoFinite, "'logits' row ", r,
                 " has no finite entry (all -inf)");
  }
}

void AcceptTrees(const AcceptTreesArgs& args, void* stream_ptr) {
  const TensorView &target_probs = args.target, *draft_probs = args.draft();
  const TensorView &tokens = args.tokens, &parents = args.parents, &tree_indptr = args.tree_indptr;
  const TensorView &greedy = args.greedy, &sampled_children = args.sampled_children;
  const AcceptOptions& options = args.options;
  CheckDevice(target_probs, "target_probs", DeviceType::kCUDA);
  RequireDevice("accept_trees");
  DeviceGuard guard(target_probs.device.index);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // Dtypes of the metadata before copying it (the shared check repeats them with full messages).
  CheckDType(tokens, "tokens", {DType::kInt32});
  CheckDType(parents, "parents", {DType::kInt32});
  CheckDType(tree_indptr, "tree_indptr", {DType::kInt64});
  CheckDType(greedy, "greedy", {DType::kBool, DType::kUInt8});
  CheckDType(sampled_children, "sampled_children", {DType::kBool, DType::kUInt8});
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&tokens, "tokens"},
                               {&parents, "parents"}, {&tree_indptr, "tree_indptr"},
                               {&greedy, "greedy"}, {&sampled_children, "sampled_children"}}) {
    CheckSameDevice(target_probs, "target_probs", *t, name);
    CheckContiguous(*t, name);
  }
  const auto tok = ToHost<int32_t>(tokens, stream);
  const auto par = ToHost<int32_t>(parents, stream);
  const auto ind = ToHost<int64_t>(tree_indptr, stream);
  const auto gr = ToHost<uint8_t>(greedy, stream);
  const auto sc = ToHost<uint8_t>(sampled_children, stream);
  PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
  detail::AcceptMeta meta;
  meta.tokens = tok.data();
  meta.parents = par.data();
  meta.indptr = ind.data();
  meta.greedy = gr.data();
  meta.sampled = sc.data();
  const detail::AcceptShape shape = detail::CheckAcceptArgs(args, DeviceType::kCUDA, meta);
  const int64_t batch = shape.batch, vocab = shape.vocab;
  if (batch == 0) return;
  PYSPEC_CHECK(batch <= INT32_MAX, "too many requests for one launch");

  // Double scratch (residual and draft rows) only for requests that can reject a sampled child.
  std::vector<int32_t> slot(batch, -1);
  int32_t slots = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const bool has_children = ind[b + 1] - ind[b] > 1;
    if (gr[b] == 0 && sc[b] != 0 && draft_probs != nullptr && has_children) slot[b] = slots++;
  }
  const size_t meta_bytes = sizeof(int32_t) * batch;
  const size_t err_bytes = sizeof(accept_logic::WalkError) * batch;
  DeviceBuffer small((meta_bytes + 15) / 16 * 16 + err_bytes, stream);
  int32_t* slot_dev = small.as<int32_t>();
  auto* err_dev = reinterpret_cast<accept_logic::WalkError*>(
      small.as<unsigned char>() + (meta_bytes + 15) / 16 * 16);
  PYSPEC_CUDA_CALL(cudaMemcpyAsync(slot_dev, slot.data(), meta_bytes, cudaMemcpyHostToDevice,
                                   stream));
  DeviceBuffer scratch(sizeof(double) * 2 * static_cast<size_t>(vocab) * slots, stream);

  kernels::AcceptArgs a;
  a.in.target = target_probs.ptr<const float>();
  a.in.draft = draft_probs != nullptr ? draft_probs->ptr<const float>() : nullptr;
  a.in.tokens = tokens.ptr<const int32_t>();
  a.in.parents = parents.ptr<const int32_t>();
  a.in.indptr = tree_indptr.ptr<const int64_t>();
  a.in.vocab = vocab;
  a.in.tol = options.row_sum_tolerance;
  a.in.skip_residual = options.debug_skip_residual;
  a.greedy = greedy.ptr<const uint8_t>();
  a.sampled = sampled_children.ptr<const uint8_t>();
  a.seeds = args.seeds.ptr<const int64_t>();
  a.offsets = args.offsets.ptr<const int64_t>();
  a.scratch_slot = slot_dev;
  a.scratch = scratch.as<double>();
  a.accepted_nodes = args.accepted_nodes.ptr<int32_t>();
  a.emitted_tokens = args.emitted_tokens.ptr<int32_t>();
  a.num_accepted = args.num_accepted.ptr<int32_t>();
  a.errors = err_dev;
  a.width = shape.width;
  kernels::AcceptKernel<<<static_cast<unsigned>(batch), kernels::kAcceptThreads, 0, stream>>>(a);
  PYSPEC_CUDA_CALL(cudaGetLastError());
  std::vector<accept_logic::WalkError> errors(batch);
  PYSPEC_CUDA_CALL(cudaMemcpyAsync(errors.data(), err_dev, err_bytes, cudaMemcpyDeviceToHost,
                                   stream));
  PYSPEC_CUDA_CALL(cudaStreamSynchronize(stream));
  for (int64_t b = 0; b < batch; ++b) {
    const accept_logic::WalkError& e = errors[b];
    const char* name = e.is_draft ? "draft_probs" : "target_probs";
    switch (e.status) {
      case accept_logic::kWalkOk:
        break;
      case accept_logic::kWalkBadEntry:
        throw ValueError(detail::StrCat("'", name, "' row ", e.row, " (request ", b, ", node ",
                                        e.node, ") has a NaN, infinite or negative entry ",
                                        e.value, " at token ", e.token));
      case accept_logic::kWalkBadSum:
        throw ValueError(detail::StrCat("'", name, "' row ", e.row, " (request ", b, ", node ",
                                        e.node, ") sums to ", e.value,
                                        "; probability rows must sum to 1 within ",
                                        options.row_sum_tolerance));
      case accept_logic::kWalkZeroDraft:
        throw ValueError(detail::StrCat(
            "request ", b, ": child node ", e.child, " has token ", e.token,
            " but 'draft_probs' row ", e.row, " gives it probability 0 (after removing the earlier siblings); sampled "
            "children must be distinct draws from that row"));
      default:
        throw ValueError(detail::StrCat("request ", b, ": cannot sample: the distribution has no ",
                                        "positive mass"));
    }
  }
}

}  // namespace cuda
}  // namespace pyspec
