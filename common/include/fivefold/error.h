#pragma once
/// @file error.h
/// @brief The project's exceptions and the FIVEFOLD_CHECK macro for readable input validation.

#include <sstream>
#include <stdexcept>
#include <string>

namespace fivefold {

/// Raised for bad input or a broken invariant; the message says what was wrong and how to fix it.
class Error : public std::runtime_error {
 public:
  /// @param message full, user-facing explanation.
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

/// Thrown by every exercise stub until the learner writes the function.
/// The message names the chapter, the function and the README section to read.
class NotImplemented : public std::logic_error {
 public:
  /// @param what e.g. "ch04: apply_rope (see chapters/04_rope/README.md, 'The rotation')".
  explicit NotImplemented(const std::string& what) : std::logic_error("NotImplemented: " + what) {}
};

namespace detail {
/// Concatenates the streamed parts of a FIVEFOLD_CHECK message.
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace fivefold

/// Throws fivefold::Error with the concatenated message parts when `cond` is false.
#define FIVEFOLD_CHECK(cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) throw ::fivefold::Error(::fivefold::detail::concat(__VA_ARGS__)); \
  } while (0)
