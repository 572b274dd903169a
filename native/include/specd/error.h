// Error reporting for the native library. Every failed precondition throws std::invalid_argument
// (mapped to Python ValueError by pybind11) with a message naming the op, the argument and what was
// expected, so callers never see a crash for bad input.
#pragma once
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace specd {

namespace detail {

// Error messages are built with std::string and std::to_chars-free conversions rather than
// iostreams: an ostringstream needs the C++ locale machinery, which crashed when libstdc++ was
// linked statically into the module (seen on the H200 image's GCC 13 build).
inline void append(std::string& s, std::string_view v) { s.append(v.data(), v.size()); }
inline void append(std::string& s, const char* v) { s.append(v); }
inline void append(std::string& s, const std::string& v) { s.append(v); }
inline void append(std::string& s, char v) { s.push_back(v); }
inline void append(std::string& s, bool v) { s.append(v ? "true" : "false"); }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) { s.append(std::to_string(v)); }
template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", double(v));
  s.append(buf);
}

}  // namespace detail

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::string msg;
  (detail::append(msg, args), ...);
  throw std::invalid_argument(msg);
}

}  // namespace specd

#define SPECD_CHECK(cond, ...)                    \
  do {                                            \
    if (!(cond)) ::specd::fail(__VA_ARGS__);      \
  } while (0)
