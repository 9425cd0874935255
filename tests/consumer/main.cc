// Links pyspec::core from an installed package and exercises the public API.
#include <cstdio>
#include <vector>

#include "pyspec/check.h"
#include "pyspec/kv_ops.h"
#include "pyspec/tensor_view.h"
#include "pyspec/tree.h"
#include "pyspec/version.h"

int main() {
  pyspec::TokenTree tree = pyspec::TokenTree::KAry(2, 3);
  if (tree.num_nodes() != 15 || !tree.IsAncestorOrSelf(1, 3)) return 1;
  std::vector<float> scratch = {1, 2, 3, 4}, pages(8, 0.f);
  std::vector<int32_t> src = {1}, dst = {3};
  using pyspec::DType;
  using pyspec::TensorView;
  pyspec::MaterializeKV(TensorView::Contiguous(scratch.data(), DType::kFloat32, {2, 1, 2}),
                        TensorView::Contiguous(pages.data(), DType::kFloat32, {2, 2, 1, 2}),
                        TensorView::Contiguous(src.data(), DType::kInt32, {1}),
                        TensorView::Contiguous(dst.data(), DType::kInt32, {1}));
  if (pages[6] != 3.f || pages[7] != 4.f) return 2;
  try {
    pyspec::TokenTree::FromParents({0});
    return 3;
  } catch (const pyspec::ValueError&) {
  }
  std::printf("consumer OK: pyspec %s, tree of %d nodes\n", pyspec::Version(), tree.num_nodes());
  return 0;
}
