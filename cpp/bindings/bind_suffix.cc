#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pyspec/suffix_index.h"
#include "registry.h"
#include "uninitialized.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {
namespace {

// Token ids are >= 0, as in the corpus; the index marks document ends with -1, so a negative
// context token would match across documents.
void CheckContext(const std::vector<int32_t>& ctx) {
  for (size_t i = 0; i < ctx.size(); ++i) {
    if (ctx[i] < 0)
      throw py::value_error("context[" + std::to_string(i) + "] = " + std::to_string(ctx[i]) +
                            ": token ids must be >= 0");
  }
}

// An integer array as int64 (any integer dtype that converts safely). Floats are refused rather
// than truncated (a forcecast would read 1.9 as 1); an empty sequence is fine whatever its dtype.
py::array_t<int64_t, py::array::c_style> IntArray(const py::object& obj, const char* name) {
  py::array a = py::array::ensure(obj);
  if (!a) throw py::type_error(std::string(name) + " must be an array or sequence of integers");
  const char kind = a.dtype().kind();
  if (a.size() > 0 && kind != 'i' && kind != 'u')
    throw py::type_error(std::string(name) + " must hold integers; got dtype " +
                         std::string(py::str(a.dtype())));
  auto out = py::array_t<int64_t, py::array::c_style>::ensure(
      a.size() > 0 ? a : py::array_t<int64_t>(0));
  if (!out) throw py::value_error(std::string(name) + ": values must fit in int64");
  return out;
}

}  // namespace

void RegisterSuffix(py::module_& m) {
  py::class_<SuffixIndex>(m, "SuffixIndex", R"doc(
A token corpus indexed for longest-suffix lookup (suffix array over the documents, each suffix
ordered by its first 32 tokens); the datastore of corpus drafting.

``SuffixIndex(tokens, offsets)``: ``tokens`` int32 [N] (all documents back to back, >= 0),
``offsets`` int64 [D + 1] (document d is tokens[offsets[d]:offsets[d + 1]]).
)doc")
      .def(py::init([](py::object tokens_in, py::object offsets_in) {
             const auto tokens = IntArray(tokens_in, "tokens");
             const auto offsets = IntArray(offsets_in, "offsets");
             if (tokens.ndim() != 1 || offsets.ndim() != 1)
               throw py::value_error("tokens and offsets must be 1-D arrays");
             // Read as int64 and range-checked: a cast straight to int32 would wrap 2^32 + 5
             // to 5 without a word.
             std::vector<int32_t> t(static_cast<size_t>(tokens.size()));
             const int64_t* tk = tokens.data();
             for (py::ssize_t i = 0; i < tokens.size(); ++i) {
               if (tk[i] < 0 || tk[i] > std::numeric_limits<int32_t>::max())
                 throw py::value_error("tokens[" + std::to_string(i) + "] = " +
                                       std::to_string(tk[i]) + " must be >= 0 and fit in int32");
               t[static_cast<size_t>(i)] = static_cast<int32_t>(tk[i]);
             }
             std::vector<int64_t> o(offsets.data(), offsets.data() + offsets.size());
             py::gil_scoped_release nogil;
             return SuffixIndex(t, o);
           }),
           py::arg("tokens"), py::arg("offsets"))
      .def_property_readonly("num_tokens", &SuffixIndex::num_tokens)
      .def_property_readonly("num_documents", &SuffixIndex::num_documents)
      .def(
          "longest_match",
          [](const SuffixIndex& s, const std::vector<int32_t>& ctx, int max_len, int min_len) {
            CheckContext(ctx);
            const auto mt = s.LongestMatch(ctx.data(), static_cast<int64_t>(ctx.size()), max_len,
                                           min_len);
            return py::make_tuple(mt.length, mt.hi - mt.lo);
          },
          py::arg("context"), py::arg("max_len") = 8, py::arg("min_len") = 1,
          "(length, occurrences) of the longest suffix of ``context`` (min_len..max_len tokens) "
          "that the corpus continues; (0, 0) when none.")
      .def(
          "propose",
          [](const SuffixIndex& s, const std::vector<int32_t>& ctx, int max_nodes, int max_depth,
             int max_match, int min_match, float min_prob, int max_children) {
            CheckContext(ctx);
            SuffixIndex::Draft d;
            {
              py::gil_scoped_release nogil;
              d = s.Propose(ctx.data(), static_cast<int64_t>(ctx.size()), max_nodes, max_depth,
                            max_match, min_match, min_prob, max_children);
            }
            return py::make_tuple(d.tokens, d.parents, d.probs, d.match_length);
          },
          py::arg("context"), py::arg("max_nodes"), py::arg("max_depth"), py::arg("max_match") = 8,
          py::arg("min_match") = 1, py::arg("min_prob") = 0.0f, py::arg("max_children") = 4,
          "(tokens, parents, scores, match_length): a draft tree grown best first by path "
          "frequency after the longest matching suffix of ``context``; parents are -1 for the "
          "root's children, else indices into tokens.");
  RefuseUninitialized<SuffixIndex>();
}

}  // namespace bindings
}  // namespace pyspec
