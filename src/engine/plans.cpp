#include "engine/plans.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "compiler/rule.h"
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

Plan compile_plan(const LoadedModel& model, PlanPhase phase, int64_t max_tokens, int workers, int64_t max_context, bool fuse,
                  const PlanTuning& tuning) {
  CompileOptions options;
  options.fusion = fuse;
  for (const std::string& name : tuning.disabled_rules) {
    std::string known;
    bool found = false;
    for (const Rule& rule : all_rules()) {
      found = found || rule.name == name;
      known += (known.empty() ? "" : ", ") + rule.name;
    }
    if (!found) fail("disabled rule '{}' is not a compiler rule (the rules: {})", name, known);
    options.disabled_rules.insert(name);
  }
  // A prefill chunk's f_b projection stays a plain linear: the cuda backend runs those as cuBLAS GEMMs
  // (prefill_gemm.cpp), which take no epilogue, and the gate is then one pass over the chunk. Its KDA
  // core stays unfused: the delta rule runs chunked (kda_prefill.h), the fused core token by token.
  // Nor does a prefill chunk fold a residual sum into the norm's readers: the hop they save is a
  // decode step's, and every task of a chunk would add and normalize all of its rows again.
  if (phase == PlanPhase::kPrefill) {
    for (const char* rule : {"kda-gate-into-linear", "kda-core-fuse", "add-norm-into-multi-linear", "add-norm-into-router"}) {
      options.disabled_rules.insert(rule);
    }
  }
  const CompiledGraph compiled = compile_graph(model.graph, options);
  LowerOptions lower{phase, max_tokens, workers, max_context, fingerprint_of(model)};
  lower.light_task_elements = tuning.light_task_elements;
  lower.shadow_tail_workers = tuning.shadow_tail_workers;
  Plan plan = lower_to_plan(compiled.graph, lower);
  plan.compile.ops_before_fusion = static_cast<int64_t>(compiled.report.ops_before);
  plan.compile.rules_fired = compiled.report.rules_fired();
  return plan;
}

std::vector<Plan> compile_serving_plans(const LoadedModel& model, int num_slots, int64_t max_context, int64_t step_tokens, int workers, bool fuse_prefill) {
  std::vector<Plan> plans;
  for (int64_t batch = 1;; batch *= 2) {
    plans.push_back(compile_plan(model, PlanPhase::kDecode, std::min<int64_t>(batch, num_slots), workers, max_context));
    if (batch >= num_slots) break;
  }
  plans.push_back(compile_plan(model, PlanPhase::kPrefill, step_tokens, workers, max_context, fuse_prefill));
  return plans;
}

InterpreterOptions plan_interpreter_options(const LoadedModel& model, int workers, DType act, int num_slots, int64_t max_context,
                                            Collective* collective) {
  InterpreterOptions options;
  options.workers = workers;
  options.act_dtype = act;
  options.num_slots = num_slots;
  options.max_context_tokens = max_context;
  options.model_fingerprint = fingerprint_of(model);
  options.collective = collective;
  return options;
}

std::unique_ptr<PlanInterpreter> make_plan_interpreter(const LoadedModel& model, std::vector<Plan> plans, int workers, DType act, int num_slots,
                                                       int64_t max_context, Collective* collective) {
  return std::make_unique<PlanInterpreter>(*model.weights, std::move(plans),
                                           plan_interpreter_options(model, workers, act, num_slots, max_context, collective));
}

}  // namespace plow
