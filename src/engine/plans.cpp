#include "engine/plans.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "plan/plan.h"

namespace plow {

uint64_t fingerprint_of(const LoadedModel& model) {
  std::ifstream in(model.config.source, std::ios::binary);
  if (!in) fail("cannot re-read config file '{}' to fingerprint the model", model.config.source);
  std::stringstream text;
  text << in.rdbuf();
  return model_fingerprint(text.str(), model.graph);
}

}  // namespace plow
