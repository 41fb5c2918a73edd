// SPECDEC_CHECK(cond, parts...): TORCH_CHECK with the message assembled here, from strings, numbers
// (std::to_string, snprintf), dtypes, devices and shapes, never through an iostream. TORCH_CHECK
// streams each part into a std::ostringstream instantiated in the calling translation unit; in the
// extension built on an H200 machine (GCC 13.3, torch 2.11.0+cu130, 2026-12-04) streaming an integer
// there crashed the process (SIGSEGV in std::ostream::_M_insert<long>, which that build held a copy
// of), so a wrong shape became a crash instead of an error. Strings alone reach TORCH_CHECK here.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace specdec {

// "[2, 3]"
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

namespace detail {

inline void append_part(std::string& s, const char* part) { s += part; }
inline void append_part(std::string& s, const std::string& part) { s += part; }
inline void append_part(std::string& s, char part) { s += part; }
inline void append_part(std::string& s, bool part) { s += part ? "true" : "false"; }
inline void append_part(std::string& s, c10::ScalarType part) { s += c10::toString(part); }
inline void append_part(std::string& s, const c10::Device& part) { s += part.str(); }
inline void append_part(std::string& s, at::IntArrayRef part) { s += shape_str(part); }

template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append_part(std::string& s, T part) {
  s += std::to_string(part);
}

template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append_part(std::string& s, T part) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", static_cast<double>(part));  // as an ostream prints it
  s += text;
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append_part(s, parts), ...);
  return s;
}

}  // namespace detail
}  // namespace specdec

#define SPECDEC_CHECK(cond, ...) TORCH_CHECK(cond, ::specdec::detail::message(__VA_ARGS__))
// The same for TORCH_CHECK_VALUE (a ValueError in Python).
#define SPECDEC_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::specdec::detail::message(__VA_ARGS__))
