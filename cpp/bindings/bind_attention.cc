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
#include "registry.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

void RejectCuda(const TensorView& v, const char* op) {
  if (IsCuda(v)) {
    throw RuntimeError(detail::StrCat("pyspec: '", op, "' got CUDA tensors: tree attention is not ",
                                      "implemented on CUDA yet (use cpu tensors)"));
  }
}

}  // namespace

void RegisterAttention(py::module_& m) {
  py::class_<AttentionPlan>(m, "AttentionPlan", R"doc(
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
      .def("is_tree", &AttentionPlan::is_tree, py::arg("request"),
           "True when the request's new tokens form a tree, False for a causal chunk.")
      .def("__repr__", &AttentionPlan::ToString);

  m.def(
      "plan_attention",
      [](py::handle q_indptr, py::handle prefix_lens, py::handle block_tables, int64_t block_size,
         py::handle tree_parents, py::handle tree_indptr, int64_t num_blocks, int64_t num_q_heads,
         int64_t num_kv_heads, int num_threads, int64_t min_kv_chunk) {
        TensorView qi = ToView(q_indptr, "q_indptr"), pl = ToView(prefix_lens, "prefix_lens");
        TensorView bt = ToView(block_tables, "block_tables");
        TensorView tp = ToView(tree_parents, "tree_parents");
        TensorView ti = ToView(tree_indptr, "tree_indptr");
        for (const TensorView* v : {&qi, &pl, &bt, &tp, &ti}) RejectCuda(*v, "plan_attention");
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
         std::optional<double> scale) {
        TensorView qv = ToView(q, "q"), kp = ToView(k_pages, "k_pages");
        TensorView vp = ToView(v_pages, "v_pages"), kn = ToView(k_new, "k_new");
        TensorView vn = ToView(v_new, "v_new"), ov = ToView(out, "out");
        std::optional<TensorView> lv;
        if (!lse.is_none()) lv = ToView(lse, "lse");
        for (const TensorView* v : {&qv, &kp, &vp, &kn, &vn, &ov}) RejectCuda(*v, "run_attention");
        if (lv) RejectCuda(*lv, "run_attention");
        float s = 0.0f;
        if (scale) {
          s = static_cast<float>(*scale);
        } else {
          if (qv.ndim != 3 || qv.shape[2] <= 0) {
            throw ValueError(detail::StrCat("'q' must be [num_queries, num_q_heads, head_dim]; ",
                                            "got ", qv.ShapeString()));
          }
          s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(qv.shape[2])));
        }
        py::gil_scoped_release release;
        RunAttention(plan, qv, kp, vp, kn, vn, ov, lv ? &*lv : nullptr, s);
      },
      py::arg("plan"), py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("k_new"),
      py::arg("v_new"), py::arg("out"), py::arg("lse") = py::none(), py::arg("scale") = py::none(),
      R"doc(Run tree attention for one layer with a plan, writing ``out`` (and ``lse``) in place.

q [T, Hq, D]; k_pages/v_pages [num_blocks, block_size, Hkv, D]; k_new/v_new [T, Hkv, D] (the new
tokens' K/V in q's row order); out [T, Hq, D] with q's dtype; lse float32 [T, Hq] or None (natural
log-sum-exp of the scaled scores). q/out and K/V: float32, bfloat16 or float16, contiguous, cpu.
scale defaults to 1/sqrt(D). CUDA tensors raise RuntimeError (not implemented on CUDA yet).)doc");

  m.def("_attention_isa", &detail::AttentionIsa,
        "Instruction set of the CPU attention kernel in use ('generic' or 'avx2').");
  m.def("_set_attention_isa", &detail::SetAttentionIsa, py::arg("isa"),
        "Force the CPU attention kernel: 'auto', 'generic' or 'avx2' (tests and benchmarks). "
        "Returns the kernel now in use.");
}

}  // namespace bindings
}  // namespace pyspec
