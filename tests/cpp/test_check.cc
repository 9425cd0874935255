// pyspec/check.h: error messages are built without iostreams and read like std::ostream output.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "pyspec/check.h"
#include "pyspec/tensor_view.h"

namespace pyspec {
namespace {

enum Plain { kPlainThree = 3 };
enum class Scoped : int8_t { kMinusTwo = -2 };

TEST(StrCat, FormatsLikeAnOstream) {
  EXPECT_EQ(detail::StrCat(), "");
  EXPECT_EQ(detail::StrCat("row ", 7, " of ", int64_t{-9000000000}, ", col ", 3u),
            "row 7 of -9000000000, col 3");
  EXPECT_EQ(detail::StrCat(std::numeric_limits<int64_t>::min()), "-9223372036854775808");
  EXPECT_EQ(detail::StrCat(std::numeric_limits<uint64_t>::max()), "18446744073709551615");
  EXPECT_EQ(detail::StrCat(0.25, " ", 1e-7, " ", 123456789.0, " ", 2.5f), "0.25 1e-07 1.23457e+08 2.5");
  EXPECT_EQ(detail::StrCat(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(detail::StrCat(true, false), "10");
  EXPECT_EQ(detail::StrCat('x', std::string("yz"), std::string_view("w")), "xyzw");
  const char* none = nullptr;
  EXPECT_EQ(detail::StrCat(none), "(null)");
  // Byte-sized integers print as numbers, enums as their value.
  EXPECT_EQ(detail::StrCat(uint8_t{200}, " ", int8_t{-5}), "200 -5");
  EXPECT_EQ(detail::StrCat(kPlainThree, " ", Scoped::kMinusTwo), "3 -2");
}

TEST(StrCat, CheckMessagesCarryTheValues) {
  try {
    PYSPEC_CHECK(false, "'x'[", 4, "] = ", -0.5, " must be >= 0");
    FAIL() << "no throw";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "'x'[4] = -0.5 must be >= 0");
  }
}

TEST(StrCat, ShapeAndDtypeErrors) {
  float data[15] = {};
  const TensorView t = TensorView::Contiguous(data, DType::kFloat32, {3, 5});
  EXPECT_EQ(t.ShapeString(), "[3, 5]");
  try {
    CheckShape(t, "q", {3, -1, 2});
    FAIL() << "no throw";
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "'q' has shape [3, 5]; expected [3, *, 2]");
  }
  try {
    CheckDType(t, "q", {DType::kBFloat16, DType::kFloat16});
    FAIL() << "no throw";
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("'q' has dtype ", 0), 0u) << e.what();
  }
}

}  // namespace
}  // namespace pyspec
