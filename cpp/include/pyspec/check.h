// Error checks used across the core.
//
//   PYSPEC_CHECK(cond, msg...)   user input; throws pyspec::ValueError (Python ValueError).
//   PYSPEC_ICHECK(cond, msg...)  internal invariant; prints file:line and aborts: a failure is a bug.
//   PYSPEC_DCHECK(cond, msg...)  like ICHECK, compiled only in debug builds.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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

inline void AppendAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void AppendAll(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  AppendAll(os, rest...);
}

inline std::string StrCat() { return std::string(); }
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  AppendAll(os, args...);
  return os.str();
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
