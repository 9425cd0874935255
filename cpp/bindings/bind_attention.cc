#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "dispatch.h"
#include "dlpack_view.h"
#include "pyspec/attention.h"
#include "pyspec/check.h"
#include "pyspec/linear.h"
#include "pyspec/tree.h"
#include "registry.h"
#include "uninitialized.h"
#ifdef PYSPEC_WITH_CUDA
#include "pyspec/cuda_ops.h"
#endif

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// Attention metadata is planned on the host.
void RejectCudaMetadata(const TensorView& v, const char* name) {
  if (IsCuda(v)) {
    throw ValueError(detail::StrCat("'", name, "' is on cuda; attention metadata must be cpu ",
                                    "tensors (the plan is uploaded to the GPU once per step)"));
  }
}

float DefaultScale(const TensorView& q, std::optional<double> scale) {
  if (scale) return static_cast<float>(*scale);
  if (q.ndim != 3 || q.shape[2] <= 0) {
    throw ValueError(detail::StrCat("'q' must be [num_queries, num_q_heads, head_dim]; got ",
                                    q.ShapeString()));
  }
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.shape[2])));
}

}  // namespace

void RegisterAttention(py::module_& m) {
  py::class_<AttentionPlan>(m, "AttentionPlan", py::dynamic_attr(), R"doc(
Metadata of one tree-attention step, built by ``plan_attention`` and reused by every layer's
``run_attention``: validated ragged batch, packed ancestor masks, page indices and the split-KV work
partition. Immutable; safe to share between threads.
)doc")
      .def_property_readonly("batch_size", &AttentionPlan::batch_size, "Requests in the step.")
      .def_property_readonly("num_queries", &AttentionPlan::num_queries,
                             "Query rows T = q_indptr[-1].")
      .def_property_readonly("block_size", &AttentionPlan::block_size, "Tokens per KV page.")
      .def_property_readonly("num_blocks", &AttentionPlan::num_blocks, "Pages in the KV pool.")
      .def_property_readonly("num_q_heads", &AttentionPlan::num_q_heads,
                             "Query heads the plan was sized for (0 = any).")
      .def_property_readonly("num_kv_heads", &AttentionPlan::num_kv_heads,
                             "KV heads the plan was sized for (0 = any).")
      .def_property_readonly(
          "num_work_items", [](const AttentionPlan& p) { return p.work_items().size(); },
          "Parallel work items per KV head (query tiles x KV chunks).")
      .def_property_readonly(
          "num_split_tiles", [](const AttentionPlan& p) { return p.merges().size(); },
          "Query tiles whose prefix is split into KV chunks merged by log-sum-exp.")
      .def(
          "is_tree",
          [](const AttentionPlan& p, int64_t b) {
            const int64_t n = static_cast<int64_t>(p.tree_flags().size());
            PYSPEC_CHECK(b >= 0 && b < n, "request must be in [0, ", n, "); got ", b);
            return p.is_tree(b);
          },
          py::arg("request"),
           "True when the request's new tokens form a tree, False for a causal chunk.")
      .def(
          "_step_arrays",
          [](const AttentionPlan& p) {
            auto bytes = [](const auto& v) {
              return py::bytes(reinterpret_cast<const char*>(v.data()),
                               v.size() * sizeof(v[0]));
            };
            py::dict d;
            d["q_indptr"] = bytes(p.q_indptr());        // int64 [B + 1]
            d["prefix_lens"] = bytes(p.prefix_lens());  // int64 [B]
            d["page_indptr"] = bytes(p.page_indptr());  // int64 [B + 1]
            d["pages"] = bytes(p.pages());              // int32, used pages of every request
            d["tree_flags"] = bytes(p.tree_flags());    // uint8 [B]
            d["masks"] = bytes(p.masks());              // uint64 [T, mask_words] or empty
            d["mask_words"] = static_cast<int64_t>(TokenTree::kMaskWords);
            return d;
          },
          "The validated step metadata as raw little-endian arrays (for device back ends that "
          "lay out their own work partition, such as the Triton kernel).")
      .def("__repr__", &AttentionPlan::ToString);
  RefuseUninitialized<AttentionPlan>();

  m.def(
      "plan_attention",
      [](py::handle q_indptr, py::handle prefix_lens, py::handle block_tables, int64_t block_size,
         py::handle tree_parents, py::handle tree_indptr, int64_t num_blocks, int64_t num_q_heads,
         int64_t num_kv_heads, int num_threads, int64_t min_kv_chunk) {
        TensorView qi = ToView(q_indptr, "q_indptr"), pl = ToView(prefix_lens, "prefix_lens");
        TensorView bt = ToView(block_tables, "block_tables");
        TensorView tp = ToView(tree_parents, "tree_parents");
        TensorView ti = ToView(tree_indptr, "tree_indptr");
        const std::pair<const TensorView*, const char*> meta[] = {
            {&qi, "q_indptr"}, {&pl, "prefix_lens"}, {&bt, "block_tables"},
            {&tp, "tree_parents"}, {&ti, "tree_indptr"}};
        for (const auto& [v, name] : meta) RejectCudaMetadata(*v, name);
        AttentionPlanOptions opt;
        opt.num_q_heads = num_q_heads;
        opt.num_kv_heads = num_kv_heads;
        opt.num_threads = num_threads;
        opt.min_kv_chunk = min_kv_chunk;
        py::gil_scoped_release release;
        return PlanAttention(qi, pl, bt, block_size, tp, ti, num_blocks, opt);
      },
      py::arg("q_indptr"), py::arg("prefix_lens"), py::arg("block_tables"), py::arg("block_size"),
      py::arg("tree_parents"), py::arg("tree_indptr"), py::arg("num_blocks"),
      py::arg("num_q_heads") = 0, py::arg("num_kv_heads") = 0, py::arg("num_threads") = 0,
      py::arg("min_kv_chunk") = 0,
      R"doc(Plan one tree-attention step (cpu int32/int64 metadata).

q_indptr [B+1]: query rows of each request. prefix_lens [B]: committed tokens in the pages.
block_tables [B, max_blocks]: page ids (-1 = unused). tree_parents [total_nodes] with tree_indptr
[B+1]: per request 0 nodes (causal chunk) or q_len nodes (a tree, tree-local parents, root -1).
num_blocks: pages in the pool. num_q_heads/num_kv_heads: head counts the plan is sized for (0 =
unknown). num_threads/min_kv_chunk: partition knobs (0 = default). Raises ValueError naming the bad
argument.)doc");

  m.def(
      "run_attention",
      [](const AttentionPlan& plan, py::handle q, py::handle k_pages, py::handle v_pages,
         py::handle k_new, py::handle v_new, py::handle out, py::object lse,
         std::optional<double> scale, const LinearKernels* kernels) {
        TensorView qv = ToView(q, "q"), kp = ToView(k_pages, "k_pages");
        TensorView vp = ToView(v_pages, "v_pages"), kn = ToView(k_new, "k_new");
        TensorView vn = ToView(v_new, "v_new"), ov = ToView(out, "out");
        const std::optional<TensorView> lv = OptionalView(lse, "lse");
        const float s = DefaultScale(qv, scale);
        if (IsCuda(qv)) {
#ifdef PYSPEC_WITH_CUDA
          // A one-off device plan; pyspec.attention.tree_attention caches one per step instead.
          // Validate first so bad shapes get the op's errors, not the device plan's.
          const detail::AttentionShape shape = detail::CheckAttentionArgs(
              plan, qv, kp, vp, kn, vn, ov, ViewPtr(lv), s, DeviceType::kCUDA);
          py::gil_scoped_release release;
          cuda::DeviceAttentionPlan dplan(plan, qv.device.index, shape.Hq, shape.Hkv, shape.D,
                                          nullptr);
          cuda::RunAttention(dplan, qv, kp, vp, kn, vn, ov, ViewPtr(lv), s, nullptr);
          return;
#else
          CudaNotBuilt("run_attention");
#endif
        }
        py::gil_scoped_release release;
        RunAttention(plan, qv, kp, vp, kn, vn, ov, ViewPtr(lv), s, nullptr, kernels);
      },
      py::arg("plan"), py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("k_new"),
      py::arg("v_new"), py::arg("out"), py::arg("lse") = py::none(), py::arg("scale") = py::none(),
      py::arg("kernels") = py::none(),
      R"doc(Run tree attention for one layer with a plan, writing ``out`` (and ``lse``) in place.

q [T, Hq, D]; k_pages/v_pages [num_blocks, block_size, Hkv, D]; k_new/v_new [T, Hkv, D] (the new
tokens' K/V in q's row order); out [T, Hq, D] with q's dtype; lse float32 [T, Hq] or None (natural
log-sum-exp of the scaled scores). q/out and K/V: float32, bfloat16 or float16, contiguous, cpu.
scale defaults to 1/sqrt(D). All tensors on one device: cpu, or cuda (the plan is uploaded for the
call; tree_attention() keeps one upload per step instead). kernels: the LinearKernels (a model's)
whose vector build the CPU kernel runs, AVX-512 at most; None: this CPU's best.)doc");

#ifdef PYSPEC_WITH_CUDA
  py::class_<cuda::DeviceAttentionPlan>(m, "CudaAttentionPlan", R"doc(
An AttentionPlan uploaded to one GPU with its GPU work partition for a head layout; reused by every
layer of the step. Device memory is allocated and freed stream-ordered on `stream`.
)doc")
      .def(py::init([](const AttentionPlan& plan, int device, int64_t num_q_heads,
                       int64_t num_kv_heads, int64_t head_dim, uintptr_t stream) {
             py::gil_scoped_release release;
             return new cuda::DeviceAttentionPlan(plan, device, num_q_heads, num_kv_heads,
                                                  head_dim, reinterpret_cast<void*>(stream));
           }),
           py::arg("plan"), py::arg("device"), py::arg("num_q_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("stream") = 0)
      .def_property_readonly("device", &cuda::DeviceAttentionPlan::device)
      .def_property_readonly("num_work_items", &cuda::DeviceAttentionPlan::num_work_items)
      .def_property_readonly("num_split_tiles", &cuda::DeviceAttentionPlan::num_split_tiles)
      .def_property_readonly("kv_chunk", &cuda::DeviceAttentionPlan::kv_chunk)
      .def("uses_tensor_cores",
           [](const cuda::DeviceAttentionPlan& p, const std::string& q_dtype,
              const std::string& kv_dtype) {
             auto parse = [](const std::string& n) {
               if (n == "bfloat16") return DType::kBFloat16;
               if (n == "float16") return DType::kFloat16;
               return DType::kFloat32;
             };
             return p.UsesTensorCores(parse(q_dtype), parse(kv_dtype));
           },
           py::arg("q_dtype"), py::arg("kv_dtype"),
           "Whether tensors of these dtypes ('bfloat16', 'float16', 'float32') take the "
           "tensor-core kernel.");
  RefuseUninitialized<cuda::DeviceAttentionPlan>();

  m.def(
      "run_attention_cuda",
      [](const cuda::DeviceAttentionPlan& plan, py::handle q, py::handle k_pages,
         py::handle v_pages, py::handle k_new, py::handle v_new, py::handle out, py::object lse,
         std::optional<double> scale, uintptr_t stream, const std::string& variant) {
        PYSPEC_CHECK(variant == "simple" || variant == "pipelined",
                     "unknown CUDA attention variant '", variant,
                     "'; allowed: 'simple', 'pipelined'");
        TensorView qv = ToView(q, "q"), kp = ToView(k_pages, "k_pages");
        TensorView vp = ToView(v_pages, "v_pages"), kn = ToView(k_new, "k_new");
        TensorView vn = ToView(v_new, "v_new"), ov = ToView(out, "out");
        const std::optional<TensorView> lv = OptionalView(lse, "lse");
        const float s = DefaultScale(qv, scale);
        py::gil_scoped_release release;
        cuda::RunAttention(plan, qv, kp, vp, kn, vn, ov, ViewPtr(lv), s,
                           reinterpret_cast<void*>(stream), variant == "pipelined");
      },
      py::arg("plan"), py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("k_new"),
      py::arg("v_new"), py::arg("out"), py::arg("lse") = py::none(), py::arg("scale") = py::none(),
      py::arg("stream") = 0, py::arg("variant") = "simple",
      "run_attention for CUDA tensors with an uploaded CudaAttentionPlan; variant: the "
      "tensor-core kernel, 'simple' (one synchronous K/V stage) or 'pipelined' (two cp.async "
      "stages).");
#endif

  m.def("_attention_isa", &detail::AttentionIsa, py::arg("kernels") = py::none(),
        "The CPU attention kernel's build that runs with ``kernels`` (a LinearKernels; None: "
        "this CPU's best): 'generic', 'avx2' or 'avx512'.");
}

}  // namespace bindings
}  // namespace pyspec
