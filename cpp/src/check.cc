#include "pyspec/check.h"

#include <cstdio>
#include <cstdlib>

#include "pyspec/version.h"

namespace pyspec {
namespace detail {

void FailInternal(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "pyspec internal error at %s:%d: check '%s' failed%s%s\n", file, line, cond,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace detail

const char* Version() { return PYSPEC_VERSION_STRING; }

}  // namespace pyspec
