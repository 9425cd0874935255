// _C.linear, _C.rms_norm, _C.rotary_qkv: bindings of pyspec::Linear and the layer ops.
//
// The op runs ~8 times per layer per decoded token, so the binding's own cost matters; ToView
// reads torch tensors through torch._C._to_dlpack, the cheap path.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dlpack_view.h"
#include "pyspec/attention.h"
#include "pyspec/check.h"
#include "pyspec/decoder.h"
#include "pyspec/layer_ops.h"
#include "pyspec/linear.h"
#include "registry.h"
#include "uninitialized.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// The weights of a decoder stack as views, with references that keep the tensors alive.
class DecoderStack {
 public:
  DecoderStack(const py::list& layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               int64_t intermediate, double eps, const LinearKernels* kernels)
      : kernels_(kernels != nullptr ? *kernels : LinearKernels::Default()) {
    cfg_.num_heads = num_heads;
    cfg_.num_kv_heads = num_kv_heads;
    cfg_.head_dim = head_dim;
    cfg_.intermediate = intermediate;
    cfg_.eps = static_cast<float>(eps);
    int64_t index = 0;
    for (py::handle item : layers) {
      PYSPEC_CHECK(py::isinstance<py::dict>(item), "layers[", index, "] must be a dict of the "
                   "layer's tensors; got ",
                   std::string(py::str(py::type::handle_of(item).attr("__name__"))));
      const py::dict d = py::reinterpret_borrow<py::dict>(item);
      for (const char* key : {"ln1", "ln2", "wqkv", "wo", "wgu", "wd"}) {
        PYSPEC_CHECK(d.contains(key), "layers[", index, "] has no '", key, "'");
      }
      ++index;
      DecoderLayerWeights w;
      w.ln1 = Keep(d["ln1"], "ln1");
      w.ln2 = Keep(d["ln2"], "ln2");
      w.wqkv = Matrix(d["wqkv"], "wqkv");
      w.wo = Matrix(d["wo"], "wo");
      w.wgu = Matrix(d["wgu"], "wgu");
      w.wd = Matrix(d["wd"], "wd");
      if (d.contains("bqkv") && !d["bqkv"].is_none()) w.bqkv = Keep(d["bqkv"], "bqkv");
      if (d.contains("bo") && !d["bo"].is_none()) w.bo = Keep(d["bo"], "bo");
      layers_.push_back(w);
    }
    hidden_ = layers_.empty() ? 0 : layers_[0].ln1.size(0);
    if (!layers_.empty()) CheckDecoderLayers(cfg_, layers_, hidden_, layers_[0].ln1.dtype);
  }

  void Run(py::handle x, py::handle cos, py::handle sin, const AttentionPlan& plan,
           py::handle k_pages, py::handle v_pages, py::handle k_new, py::handle v_new,
           int64_t begin, int64_t end) const {
    const TensorView xv = ToView(x, "x"), cv = ToView(cos, "cos"), sv = ToView(sin, "sin");
    const TensorView kp = ToView(k_pages, "k_pages"), vp = ToView(v_pages, "v_pages");
    const TensorView kn = ToView(k_new, "k_new"), vn = ToView(v_new, "v_new");
    CheckNoOverlap({{&xv, "x"}, {&kn, "k_new"}, {&vn, "v_new"}},
                   {{&cv, "cos"}, {&sv, "sin"}, {&kp, "k_pages"}, {&vp, "v_pages"}});
    py::gil_scoped_release release;
    DecoderLayers(cfg_, layers_, xv, cv, sv, plan, kp, vp, kn, vn, begin, end, nullptr, &kernels_);
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // The view and a reference to its memory: for a torch tensor a detached alias, which holds the
  // storage even if the tensor itself is later given another (w.data = ...).
  TensorView Keep(py::handle t, const char* name) {
    py::object ref = py::hasattr(t, "detach") ? t.attr("detach")()
                                              : py::reinterpret_borrow<py::object>(t);
    const TensorView v = ToView(ref, name);
    keep_.push_back(std::move(ref));
    return v;
  }
  // A tensor, or a (dense, q, d, m[, perm]) tuple of packed codes (m None for 8-bit; dense None
  // when the model holds only the codes; perm None or absent: the columns in their natural order).
  DecoderMatrix Matrix(py::handle t, const char* name) {
    DecoderMatrix mat;
    if (py::isinstance<py::tuple>(t)) {
      const py::tuple tup = py::reinterpret_borrow<py::tuple>(t);
      PYSPEC_CHECK(tup.size() == 4 || tup.size() == 5, "'", name,
                   "' must be a tensor or a (dense, q, d, m[, perm]) tuple");
      if (!tup[0].is_none()) mat.w = Keep(tup[0], name);  // None: the codes alone
      mat.packed = true;
      mat.q = Keep(tup[1], "q");
      if (!tup[2].is_none()) mat.d = Keep(tup[2], "d");  // None: 16-bit codes
      if (!tup[3].is_none()) mat.m = Keep(tup[3], "m");
      if (tup.size() == 5 && !tup[4].is_none()) mat.perm = Keep(tup[4], "perm");
    } else {
      mat.w = Keep(t, name);
    }
    return mat;
  }

  LinearKernels kernels_;
  DecoderConfig cfg_;
  int64_t hidden_ = 0;
  std::vector<DecoderLayerWeights> layers_;
  std::vector<py::object> keep_;
};

DType DTypeArg(const std::string& dtype) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    if (dtype == DTypeName(dt)) return dt;
  }
  throw ValueError("dtype must be 'float32', 'bfloat16' or 'float16'; got '" + dtype + "'");
}

const char* RouteName(LinearKernels::Route r) {
  switch (r) {
    case LinearKernels::Route::kLinear: return "linear";
    case LinearKernels::Route::kPacked: return "packed";
    case LinearKernels::Route::kGemm: return "gemm";
  }
  return "?";
}

}  // namespace

void RegisterLinear(py::module_& m) {
  py::class_<LinearKernels>(m, "LinearKernels", R"doc(
Which builds of the CPU dense kernels a model runs and which route a call takes (a property of
the model, never of the process). isa: 'auto' (this CPU's best), 'generic', 'avx2', 'avx512' (no
AMX) or 'amx' (AVX-512 and AMX tiles for bfloat16); ValueError for one this CPU, OS or build
lacks. Routes for a call of `rows` input rows: 'linear' (the core kernel on the dense matrix),
'packed' (the core kernel on 4-bit / 8-bit codes), 'gemm' (a GEMM library on the dense matrix,
rebuilt from the codes when only they are held); every route gives a row the same bits.)doc")
      .def(py::init<const std::string&>(), py::arg("isa") = "auto")
      .def_property_readonly("isa", &LinearKernels::isa,
                             "The resolved ISA: 'generic', 'avx2', 'avx512' or 'amx'.")
      .def(
          "kernel", [](const LinearKernels& k, const std::string& dtype) {
            return k.Kernel(DTypeArg(dtype));
          },
          py::arg("dtype"),
          "The build that runs layers of `dtype` ('float32', 'bfloat16', 'float16'): 'generic', "
          "'avx2', 'avx512', 'avx512-bf16' (bf16 pairs through vdpbf16ps) or 'amx-bf16'.")
      .def(
          "max_fast_rows", [](const LinearKernels& k, const std::string& dtype) {
            return k.MaxFastRows(DTypeArg(dtype));
          },
          py::arg("dtype"), "Input rows up to which the core kernel beats a GEMM library.")
      .def_property_readonly("packed_max_rows", &LinearKernels::PackedMaxRows,
                             "Input rows up to which the codes beat the float32 matrix (32 "
                             "AVX-512, 4 AVX2, 0 where linear_packed cannot run).")
      .def_property_readonly("packed_available", &LinearKernels::PackedAvailable)
      .def("packed_rows_limit", &LinearKernels::PackedRowsLimit, py::arg("has_dense"),
           "Input rows up to which packed codes take the packed route (held beside their float32 "
           "matrix, or alone); 0 where linear_packed cannot run.")
      .def(
          "dense_route", [](const LinearKernels& k, const std::string& dtype, int64_t rows) {
            return std::string(RouteName(k.DenseRoute(DTypeArg(dtype), rows)));
          },
          py::arg("dtype"), py::arg("rows"), "'linear' or 'gemm' for a dense matrix.")
      .def(
          "packed_route", [](const LinearKernels& k, int64_t rows, bool has_dense) {
            return std::string(RouteName(k.PackedRoute(rows, has_dense)));
          },
          py::arg("rows"), py::arg("has_dense"),
          "'packed', 'linear' or 'gemm' for packed codes (held beside their float32 matrix, or "
          "alone).")
      .def("__repr__", [](const LinearKernels& k) {
        return "LinearKernels(isa='" + k.isa() + "')";
      })
      // Pickled as its resolved ISA (a model and its copies compute the same bits; unpickling
      // where that ISA is missing raises the constructor's ValueError).
      .def(py::pickle([](const LinearKernels& k) { return py::make_tuple(k.isa()); },
                      [](const py::tuple& t) {
                        PYSPEC_CHECK(t.size() == 1, "LinearKernels: bad pickled state");
                        return LinearKernels(t[0].cast<std::string>());
                      }));
  RefuseUninitialized<LinearKernels>();
  m.def(
      "rms_norm",
      [](py::handle x, py::handle w, float eps, py::handle out) {
        const TensorView xv = ToView(x, "x"), wv = ToView(w, "w"), ov = ToView(out, "out");
        py::gil_scoped_release release;
        RmsNorm(xv, wv, eps, ov);
      },
      py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out"),
      R"doc(RMSNorm ``out = w * round(x * rsqrt(mean(x**2, -1) + eps))`` into ``out`` in place.

x [T, H], w [H], out [T, H] (may be x): contiguous cpu tensors of one dtype (float32, bfloat16 or
float16); fp32 arithmetic, rounding as Hugging Face's Llama RMSNorm. Raises ValueError naming the
bad argument; RuntimeError for CUDA tensors.)doc");
  m.def(
      "rotary_qkv",
      [](py::handle qkv, py::handle cos, py::handle sin, py::handle q, py::handle k,
         py::handle v) {
        const TensorView a = ToView(qkv, "qkv"), c = ToView(cos, "cos"), s = ToView(sin, "sin");
        const TensorView qv = ToView(q, "q"), kv = ToView(k, "k"), vv = ToView(v, "v");
        CheckNoOverlap({{&qv, "q"}, {&kv, "k"}, {&vv, "v"}},
                       {{&a, "qkv"}, {&c, "cos"}, {&s, "sin"}});
        py::gil_scoped_release release;
        RotaryQKV(a, c, s, qv, kv, vv);
      },
      py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("q"), py::arg("k"), py::arg("v"),
      R"doc(Split a fused projection qkv [T, (Hq + 2 Hkv) D] into q [T, Hq, D], k and v
[T, Hkv, D] (written in place), rotating q and k by the rotary embedding (rotate-half layout;
cos/sin [T, D] float32). Contiguous cpu tensors, q/k/v/qkv of one dtype; fp32 arithmetic, one
rounding. Raises ValueError naming the bad argument; RuntimeError for CUDA tensors.)doc");
  m.def(
      "linear",
      [](py::handle x, py::handle w, py::handle bias, py::handle out,
         const LinearKernels* kernels) {
        const TensorView xv = ToView(x, "x"), wv = ToView(w, "w"), ov = ToView(out, "out");
        const std::optional<TensorView> bv = OptionalView(bias, "bias");
        // `out` may be `x` (the kernel reads x into registers first) but not the weights or
        // the bias, which are read while the output is written.
        CheckNoOverlap({{&ov, "out"}}, {{&wv, "w"}, {ViewPtr(bv), "bias"}});
        py::gil_scoped_release release;
        Linear(xv, wv, ViewPtr(bv), ov, nullptr, kernels);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"),
      py::arg("kernels") = static_cast<const LinearKernels*>(nullptr),
      R"doc(Dense layer ``out = x @ w.T + bias``, written into ``out`` in place.

x [M, K], w [N, K], bias [N] or None, out [M, N]: contiguous cpu tensors of one dtype (float32,
bfloat16 or float16; out may be x, not w or bias); fp32 accumulation, one rounding per output. Tuned for small M (decoding):
each weight row is read from memory once per call, output rows are split over the thread pool.
Correct for any M, but for M above a few dozen a GEMM library is faster (pyspec.linear routes
those to torch). ``kernels``: a LinearKernels (default: this CPU's best). Raises ValueError naming the bad argument; RuntimeError for CUDA tensors (not implemented
on CUDA). Tensors that require grad are read as is (no autograd).)doc");

  m.def(
      "unpack_packed",
      [](py::handle q, py::handle d, py::handle mn, py::handle out) {
        const TensorView qv = ToView(q, "q"), ov = ToView(out, "out");
        const std::optional<TensorView> dv = OptionalView(d, "d"), mv = OptionalView(mn, "m");
        CheckNoOverlap({{&ov, "out"}}, {{&qv, "q"}, {ViewPtr(dv), "d"}, {ViewPtr(mv), "m"}});
        py::gil_scoped_release release;
        UnpackPacked(qv, dv ? *dv : TensorView{}, ViewPtr(mv), ov);
      },
      py::arg("q"), py::arg("d"), py::arg("m"), py::arg("out"),
      R"doc(The float32 matrix out [N, K] that packed codes stand for, written in place: 4-bit
``w = d * q + m`` (q [N, K/2] uint8, d and m [N, K/32] float32) or, with ``m`` None, 8-bit
``w = d * q`` (q [N, K] int8), or, with ``d`` and ``m`` None, 16-bit codes (q [N, K] float16 or
bfloat16: the values widened), as ``linear_packed`` rebuilds them; out contiguous float32, K a
multiple of 32. Equal bit for bit to the matrix ``pyspec.linear.pack_exact`` packed. Any CPU;
raises ValueError naming the bad argument.)doc");

  m.def(
      "linear_packed",
      [](py::handle x, py::handle q, py::handle d, py::handle mn, py::handle bias,
         py::handle out, const LinearKernels* kernels) {
        const TensorView xv = ToView(x, "x"), qv = ToView(q, "q");
        const TensorView ov = ToView(out, "out");
        const std::optional<TensorView> dv = OptionalView(d, "d"), mv = OptionalView(mn, "m"),
                                        bv = OptionalView(bias, "bias");
        CheckNoOverlap({{&ov, "out"}}, {{&xv, "x"}, {&qv, "q"}, {ViewPtr(dv), "d"},
                                        {ViewPtr(mv), "m"}, {ViewPtr(bv), "bias"}});
        py::gil_scoped_release release;
        LinearPacked(xv, qv, dv ? *dv : TensorView{}, ViewPtr(mv), ViewPtr(bv), ov, nullptr,
                     kernels);
      },
      py::arg("x"), py::arg("q"), py::arg("d"), py::arg("m"), py::arg("bias"), py::arg("out"),
      py::arg("kernels") = static_cast<const LinearKernels*>(nullptr),
      R"doc(Dense layer over packed weights, ``out = x @ w.T + bias`` with ``w`` rebuilt from codes
in groups of 32 along K: 4-bit ``w = d * q + m`` (q [N, K/2] uint8, low nibble = element j of a
group, high nibble = element j + 16; d, m [N, K/32] float32) or, with ``m`` None, 8-bit
``w = d * q`` (q [N, K] int8), or, with ``d`` and ``m`` None, 16-bit codes (q [N, K] float16 or
bfloat16: the weights themselves, widened exactly). x [M, K], out [M, N], bias [N] or None:
contiguous float32 cpu
tensors; K a multiple of 32. Accumulates as the float32 kernel of ``linear`` with the same
``kernels`` does (its AVX2 or AVX-512 build), so where the rebuilt weights equal a float32 matrix
the outputs equal ``linear``'s on it bit for bit. Needs one of those builds
(``LinearKernels.packed_available``); raises ValueError naming the bad argument.)doc");
  py::class_<DecoderStack>(m, "DecoderStack", R"doc(A Llama-style decoder stack's CPU weights
for ``run``, which computes every layer in one call (RMSNorm, fused QKV, RoPE, tree attention
over the paged KV, output projection, RMSNorm, gate/up, SiLU-times-up, down projection, residual
adds) with the same kernels as the ops one by one, so with the same results bit for bit.)doc")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, int64_t, double,
                    const LinearKernels*>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"),
           py::arg("kernels") = static_cast<const LinearKernels*>(nullptr),
           "layers: dicts with ln1, ln2, wqkv, bqkv (or None), wo, bo (or None), wgu (gate then "
           "up), wd; a matrix is a tensor or a (dense, q, d, m) tuple of packed codes. The "
           "stack keeps references to them. kernels: the model's LinearKernels (default: this "
           "CPU's best).")
      .def("run", &DecoderStack::Run, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("plan"), py::arg("k_pages"), py::arg("v_pages"), py::arg("k_new"),
           py::arg("v_new"), py::arg("begin") = 0, py::arg("end") = -1,
           "x [T, hidden] in place through layers [begin, end) (end -1: the last); each layer's new K/V into k_new[l] / "
           "v_new[l] ([L, T, Hkv, D]); k_pages/v_pages [L, blocks, block_size, Hkv, D]; cos/sin "
           "[T, head_dim] float32. Raises ValueError naming a bad argument.")
      .def("__len__", &DecoderStack::size);
  RefuseUninitialized<DecoderStack>();
  m.def(
      "silu_mul",
      [](py::handle gu, py::handle out) {
        const TensorView g = ToView(gu, "gu"), o = ToView(out, "out");
        CheckNoOverlap({{&o, "out"}}, {{&g, "gu"}});
        py::gil_scoped_release release;
        SiluMul(g, o);
      },
      py::arg("gu"), py::arg("out"),
      R"doc(``out = silu(gu[:, :I]) * gu[:, I:]`` for gu [T, 2 I] (gate then up), out [T, I], written
in place; fp32 arithmetic, each result rounded to the dtype as torch's silu(gate) * up does.
Contiguous cpu tensors of one dtype (float32, bfloat16 or float16). Raises ValueError naming the
bad argument.)doc");
  m.def("_packed_prefetch_blocks", &detail::SetPackedPrefetchBlocks, py::arg("blocks") = -1,
        "linear_packed's prefetch distance in blocks of 4 weight rows (0: none; negative: only "
        "read it). A benchmark knob; returns the distance in use.");
}

}  // namespace bindings
}  // namespace pyspec
