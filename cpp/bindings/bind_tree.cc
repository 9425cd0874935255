#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include "pyspec/tree.h"
#include "registry.h"
#include "uninitialized.h"

namespace py = pybind11;

namespace pyspec {
namespace bindings {

void RegisterTree(py::module_& m) {
  py::class_<TokenTree>(m, "TokenTree", R"doc(
A draft token tree (node 0 = root = the last accepted token; parents before children).

Build it from parent indices (``TokenTree(parents, tokens=None)``) or a template:
``TokenTree.chain(gamma)``, ``TokenTree.kary(width, depth)``, ``TokenTree.from_paths(choices)``.
)doc")
      .def(py::init([](std::vector<int32_t> parents, std::optional<std::vector<int32_t>> tokens) {
             return TokenTree::FromParents(std::move(parents), tokens ? std::move(*tokens)
                                                                      : std::vector<int32_t>{});
           }),
           py::arg("parents"), py::arg("tokens") = py::none(),
           "parents[0] = -1 and 0 <= parents[i] < i; tokens: one per node or None (template).")
      .def_static("chain", &TokenTree::Chain, py::arg("gamma"), "Root + gamma nodes in a line.")
      .def_static("kary", &TokenTree::KAry, py::arg("width"), py::arg("depth"),
                  "Full width-ary tree of the given depth, breadth-first order.")
      .def_static("from_paths", &TokenTree::FromPaths, py::arg("paths"),
                  "Tree from a Medusa/EAGLE choice list of child-rank paths (root implicit).")
      .def("to_paths", &TokenTree::ToPaths, "Rank path of every non-root node, in node order.")
      .def_property_readonly("num_nodes", &TokenTree::num_nodes)
      .def_property_readonly("max_depth", &TokenTree::max_depth)
      .def_property_readonly("is_chain", &TokenTree::is_chain)
      .def_property_readonly("parents", &TokenTree::parents)
      .def_property_readonly("depths", &TokenTree::depths)
      .def_property_readonly("ranks", &TokenTree::ranks)
      .def_property("tokens", &TokenTree::tokens, &TokenTree::SetTokens,
                    "One token id per node (-1 where a template is not filled yet).")
      .def(
          "children",
          [](const TokenTree& t, int node) {
            if (node < 0 || node >= t.num_nodes()) throw py::value_error("node out of range");
            return std::vector<int32_t>(t.children_begin(node), t.children_end(node));
          },
          py::arg("node"))
      .def("path_to", &TokenTree::PathTo, py::arg("node"), "Node indices root..node.")
      .def("is_ancestor_or_self", [](const TokenTree& t, int a, int n) {
             if (a < 0 || n < 0 || a >= t.num_nodes() || n >= t.num_nodes())
               throw py::value_error("node out of range");
             return t.IsAncestorOrSelf(a, n);
           }, py::arg("ancestor"), py::arg("node"))
      .def(
          "ancestor_masks",
          [](const TokenTree& t) {
            py::array_t<uint64_t> out({t.num_nodes(), TokenTree::kMaskWords});
            std::memcpy(out.mutable_data(), t.ancestor_mask(0),
                        sizeof(uint64_t) * t.num_nodes() * TokenTree::kMaskWords);
            return out;
          },
          "Bit-packed ancestor-or-self rows, uint64 [num_nodes, 4]: bit j of row i is set when j "
          "is i or an ancestor of i.")
      .def("__len__", &TokenTree::num_nodes)
      .def("__repr__", &TokenTree::ToString);
  RefuseUninitialized<TokenTree>();
}

}  // namespace bindings
}  // namespace pyspec
