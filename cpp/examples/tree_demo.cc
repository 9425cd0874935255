// Embedding example: build a Medusa-style draft tree with the public C++ API and print its
// structure. It grows with the core (acceptance and attention calls join as they land).
#include <cstdio>

#include "pyspec/check.h"
#include "pyspec/tree.h"
#include "pyspec/version.h"

int main() {
  using pyspec::TokenTree;
  std::printf("pyspec %s\n", pyspec::Version());
  TokenTree tree = TokenTree::FromPaths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  std::printf("%s\n", tree.ToString().c_str());
  for (int i = 0; i < tree.num_nodes(); ++i) {
    std::printf("node %d depth %d rank %d ancestors:", i, tree.depths()[i], tree.ranks()[i]);
    for (int j = 0; j <= i; ++j) {
      if (tree.IsAncestorOrSelf(j, i)) std::printf(" %d", j);
    }
    std::printf("\n");
  }
  try {
    TokenTree::FromParents({-1, 2, 0});
    return 1;  // must not get here
  } catch (const pyspec::ValueError& e) {
    std::printf("bad tree rejected: %s\n", e.what());
  }
  return 0;
}
