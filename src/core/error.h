// Errors: plow::Error is a user-facing failure (bad file, field, request) whose message names the
// thing and the value found/expected; PLOW_CHECK guards internal invariants and carries the source
// location. Nothing in plow aborts the process on bad input: it throws one of these.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace plow {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A broken internal invariant: a bug in plow, not in the user's input.
class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

[[noreturn]] void internal_failure(const char* file, int line, const char* condition, const std::string& detail);

}  // namespace plow

#define PLOW_CHECK(cond, ...)                                                                  \
  do {                                                                                         \
    if (!(cond)) ::plow::internal_failure(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (0)
