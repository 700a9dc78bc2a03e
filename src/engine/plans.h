// Plans for a loaded model: the fingerprint that ties a plan to the model it was compiled from, and
// the one place a model's graph becomes a plan (compiler passes, then lowering).
#pragma once

#include <cstdint>

#include "compiler/compile.h"
#include "engine/model.h"
#include "plan/lower.h"
#include "runtime/cpu/interpreter.h"

namespace plow {

// model_fingerprint(text of config.source, model.graph): the same for a checkpoint directory and for
// its config with random weights (the weights' values are not hashed, their names and shapes are).
uint64_t fingerprint_of(const LoadedModel& model);

// What a benchmark may vary in a plan, to time it against the defaults: LowerOptions' task sizes and
// placement, and compiler rules left out (their names; an unknown name is an error).
struct PlanTuning {
  int64_t light_task_elements = LowerOptions::kLightTaskElements;
  int32_t shadow_tail_workers = LowerOptions::kShadowTailWorkers;
  std::vector<std::string> disabled_rules;
};

// Compiles (e-graph fusion with the certified rules unless `fuse` is false, less the tuning's
// disabled rules) and lowers to one bucket. The plan records the graph's op count before fusion and
// the rules that fired.
Plan compile_plan(const LoadedModel& model, PlanPhase phase, int64_t max_tokens, int workers, int64_t max_context, bool fuse = true,
                  const PlanTuning& tuning = {});

// The plans a server needs: decode buckets 1, 2, 4, … up to num_slots, and one prefill plan for steps
// of step_tokens (mixed prefill + decode steps run on it). The cuda backend asks for the prefill plan
// unfused (fuse_prefill false): its plain linears run as cuBLAS GEMMs.
std::vector<Plan> compile_serving_plans(const LoadedModel& model, int num_slots, int64_t max_context, int64_t step_tokens, int workers,
                                        bool fuse_prefill = true);

// The interpreter options for `model`: `workers` threads, activations in `act`, the model's fingerprint
// required of every plan, `collective` joining a tensor-parallel rank to its group.
InterpreterOptions plan_interpreter_options(const LoadedModel& model, int workers, DType act, int num_slots, int64_t max_context,
                                            Collective* collective = nullptr);

// The plan interpreter for `model` over `plans` (with plan_interpreter_options): `workers` threads, activations in `act`, the model's
// fingerprint required of every plan; `collective` joins a tensor-parallel rank to its group.
std::unique_ptr<PlanInterpreter> make_plan_interpreter(const LoadedModel& model, std::vector<Plan> plans, int workers, DType act, int num_slots,
                                                       int64_t max_context, Collective* collective = nullptr);

}  // namespace plow
