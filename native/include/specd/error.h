// Error reporting for the native library. Every failed precondition throws std::invalid_argument
// (mapped to Python ValueError by pybind11) with a message naming the op, the argument and what was
// expected, so callers never see a crash for bad input.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace specd {

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw std::invalid_argument(os.str());
}

}  // namespace specd

#define SPECD_CHECK(cond, ...)                    \
  do {                                            \
    if (!(cond)) ::specd::fail(__VA_ARGS__);      \
  } while (0)
