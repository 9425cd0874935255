#pragma once

namespace pyspec {

// The library version ("MAJOR.MINOR.PATCH"), as built.
const char* Version();

}  // namespace pyspec
