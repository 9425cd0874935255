// Row passes the sampling filters and the tree walk share (internal to pyspec_core).
#pragma once

#include <cstdint>

namespace pyspec {
namespace detail {

// A logits row's first maximal entry (lowest id on ties; -1 when every entry is -inf or NaN), its
// count of entries that are not -inf, and whether any entry is NaN or +inf. The filters' own pass,
// in the instruction set they run (SetSamplingIsa).
struct LogitsRowScan {
  int64_t argmax;
  int64_t finite;
  bool bad;
};
LogitsRowScan ScanLogitsRow(const float* z, int64_t vocab);

}  // namespace detail
}  // namespace pyspec
