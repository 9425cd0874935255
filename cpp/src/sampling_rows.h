// Row passes the sampling filters and the tree walk share (internal to pyspec_core).
#pragma once

#include <cstdint>

namespace pyspec {
namespace detail {

// A logits row's first maximal entry (lowest id on ties; -0 and +0 compare equal; -1 when every
// entry is -inf or NaN), its count of entries that are not -inf, and whether any entry is NaN or
// +inf.
struct LogitsRowScan {
  int64_t argmax;
  int64_t finite;
  bool bad;
};
// The filters' own pass over row `row` of the logits (`z`, `vocab` entries), in this CPU's widest
// build (every build gives the same result).
LogitsRowScan ScanLogitsRow(const float* z, int64_t vocab);
// The same scan, with the filters' check: ValueError naming the row and the first NaN or +inf
// entry, or a row without a finite entry (all -inf).
LogitsRowScan CheckedScanLogitsRow(const float* z, int64_t vocab, int64_t row);

}  // namespace detail
}  // namespace pyspec
