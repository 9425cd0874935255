// Error checks used across the core.
//
//   PYSPEC_CHECK(cond, msg...)   user input; throws pyspec::ValueError (Python ValueError).
//   PYSPEC_ICHECK(cond, msg...)  internal invariant; prints file:line and aborts: a failure is a bug.
//   PYSPEC_DCHECK(cond, msg...)  like ICHECK, compiled only in debug builds.
#pragma once

#include <charconv>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace pyspec {

// Bad user input (shapes, dtypes, values). Maps to Python ValueError.
class ValueError : public std::invalid_argument {
 public:
  explicit ValueError(const std::string& what) : std::invalid_argument(what) {}
};

// A valid request that cannot be served here (e.g. a CUDA op without a GPU). Maps to RuntimeError.
class RuntimeError : public std::runtime_error {
 public:
  explicit RuntimeError(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

// Messages are built by appending to a std::string, without iostreams: on a CUDA machine's image
// (torch 2.11+cu130, H200) the extension segfaulted inside std::ostream's number formatting, both in
// nvcc-compiled host code and in the core's own files, the first time an error message carried a
// number; and <sstream> is a heavy include for every file of the core. .ci/run refuses iostreams
// in the library. Formatting follows std::ostream's defaults (integers in decimal, floating point
// as "%g", bool as 0/1, char as the character), except that 8-bit integers print as numbers.
inline void AppendOne(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void AppendOne(std::string& s, const std::string& v) { s += v; }
inline void AppendOne(std::string& s, const char* v) { s += v != nullptr ? v : "(null)"; }
inline void AppendOne(std::string& s, char c) { s += c; }
inline void AppendOne(std::string& s, bool b) { s += b ? '1' : '0'; }
inline void AppendOne(std::string& s, const void* p) {
  char buf[32];
  const int n = std::snprintf(buf, sizeof(buf), "%p", p);
  s.append(buf, n > 0 ? static_cast<size_t>(n) : 0);
}
template <typename T>
std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>> AppendOne(std::string& s, T v) {
  if constexpr (std::is_enum_v<T>) {
    AppendOne(s, static_cast<std::underlying_type_t<T>>(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    const int n = std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
    s.append(buf, n > 0 ? static_cast<size_t>(n) : 0);
  } else {
    // signed/unsigned char print as numbers (ostream would print them as characters).
    using Wide = std::conditional_t<std::is_signed_v<T>, long long, unsigned long long>;
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof(buf), static_cast<Wide>(v));
    s.append(buf, r.ptr);
  }
}

inline void AppendAll(std::string&) {}
template <typename T, typename... Rest>
void AppendAll(std::string& s, const T& first, const Rest&... rest) {
  AppendOne(s, first);
  AppendAll(s, rest...);
}

inline std::string StrCat() { return std::string(); }
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string s;
  AppendAll(s, args...);
  return s;
}

[[noreturn]] void FailInternal(const char* file, int line, const char* cond, const std::string& msg);

}  // namespace detail
}  // namespace pyspec

#define PYSPEC_CHECK(cond, ...)                                          \
  do {                                                                   \
    if (!(cond)) {                                                       \
      throw ::pyspec::ValueError(::pyspec::detail::StrCat(__VA_ARGS__)); \
    }                                                                    \
  } while (0)

#define PYSPEC_ICHECK(cond, ...)                                                             \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      ::pyspec::detail::FailInternal(__FILE__, __LINE__, #cond,                              \
                                     ::pyspec::detail::StrCat(__VA_ARGS__)); \
    }                                                                                        \
  } while (0)

#ifdef NDEBUG
#define PYSPEC_DCHECK(cond, ...) \
  do {                           \
  } while (0)
#else
#define PYSPEC_DCHECK(cond, ...) PYSPEC_ICHECK(cond, __VA_ARGS__)
#endif
