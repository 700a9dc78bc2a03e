// A request the server refuses: the HTTP status and the OpenAI error object's fields. Handlers throw
// it; the route wrapper turns it into {"error": {"message", "type", "param", "code"}}.
#pragma once

#include <stdexcept>
#include <string>

namespace plow {

class ApiError : public std::runtime_error {
 public:
  ApiError(int http_status, std::string message, std::string field = {})
      : std::runtime_error(std::move(message)), status(http_status), param(std::move(field)) {}
  int status;
  std::string param;  // the offending request field, empty when none
};

// "invalid_request_error", "authentication_error", ... for an HTTP status.
inline const char* api_error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "internal_error" : "invalid_request_error";
  }
}

}  // namespace plow
