// Bindings of the acceptance-sampling ops (pyspec/acceptance.h). Tensors are read zero-copy through
// DLPack; the GIL is released while an op runs. pyspec/sampling.py is the documented Python API.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "dispatch.h"
#include "dlpack_view.h"
#include "pyspec/linear.h"
#include "pyspec/acceptance.h"
#include "pyspec/check.h"
#include "pyspec/philox.h"
#include "registry.h"
#ifdef PYSPEC_WITH_CUDA
#include "pyspec/cuda_ops.h"
#endif

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// CUDA tensors in a build without CUDA get a RuntimeError, not a ValueError.
void CheckCudaBuilt(const TensorView& v, const char* op) {
#ifndef PYSPEC_WITH_CUDA
  if (IsCuda(v)) CudaNotBuilt(op);
#else
  (void)v;
  (void)op;
#endif
}

[[maybe_unused]] void* StreamPtr(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

}  // namespace

void RegisterAcceptance(py::module_& m) {
  m.def(
      "apply_sampling_filters",
      [](py::handle logits, py::handle temperature, py::handle top_k, py::handle top_p,
         py::handle min_p, py::handle probs, uintptr_t stream, const LinearKernels* kernels) {
        TensorView l = ToView(logits, "logits");
        CheckCudaBuilt(l, "apply_sampling_filters");
        TensorView t = ToView(temperature, "temperature"), k = ToView(top_k, "top_k");
        TensorView p = ToView(top_p, "top_p"), mp = ToView(min_p, "min_p");
        TensorView out = ToView(probs, "probs");
        py::gil_scoped_release release;
#ifdef PYSPEC_WITH_CUDA
        if (IsCuda(l)) {
          cuda::ApplySamplingFilters(l, t, k, p, mp, out, StreamPtr(stream));
          return;
        }
#endif
        ApplySamplingFilters(l, t, k, p, mp, out, nullptr, kernels);
      },
      py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
      py::arg("min_p"), py::arg("probs"), py::arg("stream") = 0, py::arg("kernels") = py::none(),
      "Write the filtered distribution of every row of logits [N, V] (fp32/fp16/bf16) into probs "
      "[N, V] float32. Per-row params: temperature float32 [N] (0 = greedy one-hot), top_k int32 [N] "
      "(0 = off), top_p float32 [N] (1 = off), min_p float32 [N] (0 = off). Order: temperature, "
      "top-k, top-p, min-p, renormalise. Contiguous tensors on one device (cpu or cuda; stream = the "
      "cudaStream_t to run on, 0 = the default stream).");

  m.def(
      "accept_trees",
      [](py::handle target_probs, py::object draft_probs, py::handle tokens, py::handle parents,
         py::handle tree_indptr, py::handle greedy, py::handle sampled_children, py::handle seeds,
         py::handle offsets, py::handle accepted_nodes, py::handle emitted_tokens,
         py::handle num_accepted, double row_sum_tolerance, bool debug_skip_residual,
         bool target_is_logits, uintptr_t stream) {
        AcceptTreesArgs a;
        a.target = ToView(target_probs, "target_probs");
        CheckCudaBuilt(a.target, "accept_trees");
        const std::optional<TensorView> dp = OptionalView(draft_probs, "draft_probs");
        if (dp) a.draft_probs = *dp;
        a.tokens = ToView(tokens, "tokens");
        a.parents = ToView(parents, "parents");
        a.tree_indptr = ToView(tree_indptr, "tree_indptr");
        a.greedy = ToView(greedy, "greedy");
        a.sampled_children = ToView(sampled_children, "sampled_children");
        a.seeds = ToView(seeds, "seeds");
        a.offsets = ToView(offsets, "offsets");
        a.accepted_nodes = ToView(accepted_nodes, "accepted_nodes");
        a.emitted_tokens = ToView(emitted_tokens, "emitted_tokens");
        a.num_accepted = ToView(num_accepted, "num_accepted");
        a.options.row_sum_tolerance = row_sum_tolerance;
        a.options.debug_skip_residual = debug_skip_residual;
        a.options.target_is_logits = target_is_logits;
        CheckNoOverlap({{&a.accepted_nodes, "accepted_nodes"}, {&a.emitted_tokens, "emitted_tokens"},
                        {&a.num_accepted, "num_accepted"}},
                       {{&a.target, "target_probs"}, {a.draft(), "draft_probs"},
                        {&a.tokens, "tokens"}, {&a.parents, "parents"},
                        {&a.tree_indptr, "tree_indptr"}, {&a.greedy, "greedy"},
                        {&a.sampled_children, "sampled_children"}, {&a.seeds, "seeds"},
                        {&a.offsets, "offsets"}});
        py::gil_scoped_release release;
#ifdef PYSPEC_WITH_CUDA
        if (IsCuda(a.target)) {
          cuda::AcceptTrees(a, StreamPtr(stream));
          return;
        }
#endif
        AcceptTrees(a);
      },
      py::arg("target_probs"), py::arg("draft_probs"), py::arg("tokens"), py::arg("parents"),
      py::arg("tree_indptr"), py::arg("greedy"), py::arg("sampled_children"), py::arg("seeds"),
      py::arg("offsets"), py::arg("accepted_nodes"), py::arg("emitted_tokens"),
      py::arg("num_accepted"), py::arg("row_sum_tolerance") = 1e-3,
      py::arg("debug_skip_residual") = false, py::arg("target_is_logits") = false,
      py::arg("stream") = 0,
      "Batched tree acceptance (greedy walk, recursive rejection sampling with draft_probs, or the "
      "target-only walk for deterministic children). Inputs: target_probs float32 [N, V], "
      "draft_probs float32 [N, V] or None, tokens int32 [N], parents int32 [N] (tree-local), "
      "tree_indptr int64 [B+1], greedy and sampled_children bool/uint8 [B], seeds and offsets int64 "
      "[B]. Outputs written in place: accepted_nodes and emitted_tokens int32 [B, W] (W >= max depth "
      "+ 1, -1 padded), num_accepted int32 [B]. target_is_logits: every request greedy and "
      "target_probs holds the logits (CPU; each node's token is its row's first maximum). "
      "debug_skip_residual breaks losslessness on purpose (tests only).");

  m.def(
      "tree_batch_max_depth",
      [](py::handle parents, py::handle tree_indptr) {
        TensorView par = ToView(parents, "parents");
        if (IsCuda(par)) {
          throw ValueError("'parents' / 'tree_indptr' must be cpu tensors for tree_batch_max_depth "
                           "(pass parents.cpu())");
        }
        TensorView ind = ToView(tree_indptr, "tree_indptr");
        py::gil_scoped_release release;
        return TreeBatchMaxDepth(par, ind);
      },
      py::arg("parents"), py::arg("tree_indptr"),
      "Largest depth of a flattened tree batch (parents int32 [N], tree_indptr int64 [B+1]); "
      "validates the trees.");

  m.def(
      "philox_uniform",
      [](int64_t seed, int64_t position, uint32_t stream, uint32_t draw) {
        return PhiloxUniform(static_cast<uint64_t>(seed), static_cast<uint64_t>(position), stream,
                             draw);
      },
      py::arg("seed"), py::arg("position"), py::arg("stream") = kDrawSample, py::arg("draw") = 0,
      "The uniform draw acceptance uses (pyspec/philox.h): request seed, sequence position, stream "
      "(0 = the token sampled at that position, 1 = the tests of sampled draft children), draw.");
  m.def("_sampling_isa", &detail::SamplingIsa, py::arg("kernels") = py::none(),
        "The build of the CPU sampling filters' row passes that runs with ``kernels`` (a "
        "LinearKernels; None: this CPU's best): 'generic', 'avx2' or 'avx512'.");
}

}  // namespace bindings
}  // namespace pyspec
