#include "core/error.h"

namespace plow {

void internal_failure(const char* file, int line, const char* condition, const std::string& detail) {
  throw InternalError(fmt::format("internal error at {}:{}: check `{}` failed: {}", file, line, condition, detail));
}

}  // namespace plow
