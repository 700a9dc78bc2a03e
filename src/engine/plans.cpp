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

Plan compile_plan(const LoadedModel& model, PlanPhase phase, int64_t max_tokens, int workers, int64_t max_context, bool fuse) {
  CompileOptions options;
  options.fusion = fuse;
  const CompiledGraph compiled = compile_graph(model.graph, options);
  Plan plan = lower_to_plan(compiled.graph, {phase, max_tokens, workers, max_context, fingerprint_of(model)});
  plan.compile.ops_before_fusion = static_cast<int64_t>(compiled.report.ops_before);
  plan.compile.rules_fired = compiled.report.rules_fired();
  return plan;
}

}  // namespace plow
