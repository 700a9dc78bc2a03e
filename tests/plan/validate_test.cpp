// validate_plan rejects each kind of broken plan with a plow::Error naming the plan and the offending
// op / task / counter; a lowered plan passes. Plans come from the tiny fixture's graph (no weights).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include "compiler/compile.h"
#include "core/error.h"
#include "engine/model.h"
#include "plan/lower.h"
#include "plan/validate.h"
#include "runtime/cpu/interpreter.h"

namespace plow {
namespace {

const Graph& tiny_graph() {
  static const auto model = LoadedModel::describe((std::filesystem::path(PLOW_TEST_DATA) / "tiny-kimi-linear" / "config.json").string());
  return model->graph;
}

Plan tiny_plan(int workers = 3, int64_t max_tokens = 2) {
  Plan plan = lower_to_plan(tiny_graph(), {PlanPhase::kDecode, max_tokens, workers, 0, 42});
  plan.source = "tiny.plow";
  return plan;
}

// The fused graph: horizontal fusion makes slices, which plans lower to views.
Plan fused_plan(int workers = 3, int64_t max_tokens = 2) {
  static const CompiledGraph compiled = compile_graph(tiny_graph(), {});
  Plan plan = lower_to_plan(compiled.graph, {PlanPhase::kDecode, max_tokens, workers, 0, 42});
  plan.source = "tiny.plow";
  return plan;
}

bool any_op(uint8_t) { return true; }

void expect_rejected(const Plan& plan, const std::string& needle, const std::function<bool(uint8_t)>& has_op = any_op) {
  try {
    validate_plan(plan, has_op);
    FAIL() << "plan accepted; expected an error containing: " << needle;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("tiny.plow"), std::string::npos) << message;
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  }
}

int32_t first_op(const Plan& plan, Op op, int skip = 0) {
  for (int32_t i = 0; i < static_cast<int32_t>(plan.ops.size()); ++i) {
    if (plan.ops[static_cast<size_t>(i)].op() == op && skip-- == 0) return i;
  }
  throw std::runtime_error("no such op");
}

std::vector<int32_t> tasks_of(const Plan& plan, int32_t op) {
  std::vector<int32_t> result;
  for (int32_t t = 0; t < static_cast<int32_t>(plan.tasks.size()); ++t) {
    if (plan.tasks[static_cast<size_t>(t)].op == op) result.push_back(t);
  }
  return result;
}

// The plan as a file written before `op` spread: without the empty tasks of its ops, the queues
// renumbered and each counter's threshold lowered by the signals of the dropped tasks.
void drop_spread_tasks(Plan& plan, Op op) {
  std::vector<PlanTask> kept;
  std::vector<int32_t> renumber(plan.tasks.size(), -1);
  std::vector<int64_t> dropped_signals(static_cast<size_t>(plan.counters), 0);
  for (int32_t t = 0; t < static_cast<int32_t>(plan.tasks.size()); ++t) {
    const PlanTask& task = plan.tasks[static_cast<size_t>(t)];
    if (plan.ops[static_cast<size_t>(task.op)].op() == op && task.col_begin == task.col_end) {
      for (int32_t counter : task.signals) dropped_signals[static_cast<size_t>(counter)] += 1;
      continue;
    }
    renumber[static_cast<size_t>(t)] = static_cast<int32_t>(kept.size());
    kept.push_back(task);
  }
  for (PlanTask& task : kept) task.wait_threshold -= dropped_signals[static_cast<size_t>(task.wait_counter)];
  for (auto& queue : plan.queues) {
    std::vector<int32_t> renumbered;
    for (int32_t t : queue) {
      if (renumber[static_cast<size_t>(t)] >= 0) renumbered.push_back(renumber[static_cast<size_t>(t)]);
    }
    queue = renumbered;
  }
  plan.tasks = kept;
}

TEST(ValidatePlan, LoweredPlansPass) {
  for (int workers : {1, 2, 3, 8}) {
    for (int64_t tokens : {1, 5, 64}) EXPECT_NO_THROW(validate_plan(tiny_plan(workers, tokens), PlanInterpreter::has_op));
  }
}

TEST(ValidatePlan, SlicesAreViews) {
  for (int workers : {1, 3, 8}) {
    const Plan plan = fused_plan(workers, 5);
    EXPECT_NO_THROW(validate_plan(plan, PlanInterpreter::has_op));
    int views = 0;
    for (int32_t i = 0; i < static_cast<int32_t>(plan.ops.size()); ++i) {
      const PlanOp& op = plan.ops[static_cast<size_t>(i)];
      if (!op.is_view()) continue;
      ++views;
      EXPECT_TRUE(tasks_of(plan, i).empty()) << op.label;
      const ActivationView view = activation_view(plan, i);
      const PlanOp& owner = plan.ops[static_cast<size_t>(view.owner)];
      EXPECT_FALSE(owner.is_view());
      EXPECT_EQ(view.row_stride, owner.width);
      EXPECT_EQ(view.offset, owner.offset + op.attrs.i("offset")) << op.label;  // the tiny graph's slices are of buffers
      EXPECT_EQ(op.offset, view.offset);
    }
    EXPECT_GT(views, 0) << "the fused tiny graph has no slices: nothing here is tested";
  }
}

TEST(ValidatePlan, BrokenViews) {
  const Plan good = fused_plan();
  int32_t view = -1, reader = -1;  // a view and an op that reads it
  for (int32_t i = 0; i < static_cast<int32_t>(good.ops.size()) && reader < 0; ++i) {
    for (int32_t input : good.ops[static_cast<size_t>(i)].inputs) {
      if (good.ops[static_cast<size_t>(input)].is_view() && reader < 0) view = input, reader = i;
    }
  }
  ASSERT_GE(reader, 0);
  const int32_t owner = activation_view(good, view).owner;
  Plan plan = good;
  plan.ops[static_cast<size_t>(view)].offset += 1;
  expect_rejected(plan, "a view at arena float");
  plan = good;  // a task for a view
  PlanTask task = plan.tasks[static_cast<size_t>(tasks_of(plan, owner)[0])];
  task.op = view;
  task.signals.clear();
  plan.tasks.push_back(task);
  plan.queues[0].push_back(static_cast<int32_t>(plan.tasks.size() - 1));
  expect_rejected(plan, "is a view of its input and has no tasks");
  plan = good;  // the reader no longer waits for the owner of the view it reads
  const int32_t counter = plan.tasks[static_cast<size_t>(tasks_of(plan, reader)[0])].wait_counter;
  for (int32_t t : tasks_of(plan, owner)) {
    auto& signals = plan.tasks[static_cast<size_t>(t)].signals;
    signals.erase(std::remove(signals.begin(), signals.end(), counter), signals.end());
  }
  for (int32_t t : tasks_of(plan, reader)) plan.tasks[static_cast<size_t>(t)].wait_threshold -= static_cast<int64_t>(tasks_of(plan, owner).size());
  expect_rejected(plan, "does not signal counter");
  plan = good;  // a view as the output
  plan.output_op = view;
  expect_rejected(plan, "the output is a slice");
  plan = good;  // the reader's own buffer placed over the owner it still reads through the view
  plan.ops[static_cast<size_t>(reader)].offset = plan.ops[static_cast<size_t>(owner)].offset;
  expect_rejected(plan, "still reads");
}

TEST(ValidatePlan, Cycle) {
  Plan plan = tiny_plan();
  // A task of a late op signals the counter an early op waits on (thresholds kept consistent).
  const int32_t early = first_op(plan, Op::kRmsNorm);
  plan.tasks.back().signals.push_back(early);
  for (int32_t t : tasks_of(plan, early)) plan.tasks[static_cast<size_t>(t)].wait_threshold += 1;
  expect_rejected(plan, "cycle");
}

TEST(ValidatePlan, WrongThreshold) {
  Plan plan = tiny_plan();
  plan.tasks[7].wait_threshold += 1;
  expect_rejected(plan, "task 7");
  plan = tiny_plan();
  plan.tasks[7].wait_threshold -= 1;
  expect_rejected(plan, "threshold");
}

TEST(ValidatePlan, MissingDataEdge) {
  Plan plan = tiny_plan();
  // Drop the edge from the embedding's first task to its first consumer, thresholds adjusted.
  const int32_t embed = first_op(plan, Op::kEmbedding);
  PlanTask& producer = plan.tasks[static_cast<size_t>(tasks_of(plan, embed)[0])];
  const int32_t counter = producer.signals[0];
  producer.signals.erase(producer.signals.begin());
  for (PlanTask& t : plan.tasks) {
    if (t.wait_counter == counter) t.wait_threshold -= 1;
  }
  expect_rejected(plan, "does not signal counter");
}

TEST(ValidatePlan, MissingWriteAfterReadEdge) {
  Plan plan = tiny_plan();
  // Find a task edge that exists only because of arena reuse (the signaller is not an input).
  for (PlanTask& task : plan.tasks) {
    for (size_t k = 0; k < task.signals.size(); ++k) {
      const PlanOp& consumer = plan.ops[static_cast<size_t>(task.signals[k])];
      if (std::find(consumer.inputs.begin(), consumer.inputs.end(), task.op) != consumer.inputs.end()) continue;
      const int32_t counter = task.signals[k];
      task.signals.erase(task.signals.begin() + static_cast<int64_t>(k));
      for (PlanTask& t : plan.tasks) {
        if (t.wait_counter == counter) t.wait_threshold -= 1;
      }
      expect_rejected(plan, "overwrites");
      return;
    }
  }
  FAIL() << "the tiny plan reuses no arena space";
}

TEST(ValidatePlan, BufferOutOfBounds) {
  Plan plan = tiny_plan();
  plan.ops[5].offset = plan.arena_floats;
  expect_rejected(plan, "outside the arena");
  plan = tiny_plan();
  plan.arena_floats *= 4;
  expect_rejected(plan, "larger than its buffers need");
}

TEST(ValidatePlan, BufferOverlapsLiveInput) {
  Plan plan = tiny_plan();
  const int32_t add = first_op(plan, Op::kAdd);
  plan.ops[static_cast<size_t>(add)].offset = plan.ops[static_cast<size_t>(plan.ops[static_cast<size_t>(add)].inputs[0])].offset;
  expect_rejected(plan, "still reads");
}

TEST(ValidatePlan, UnknownOpcode) {
  Plan plan = tiny_plan();
  plan.ops[3].opcode = 250;
  expect_rejected(plan, "opcode 250 is not in the op table");
  // Known to the op table but not to the backend: named, never skipped.
  const auto no_linear = [](uint8_t op) { return static_cast<Op>(op) != Op::kLinear; };
  expect_rejected(tiny_plan(), "no kernel for op 'linear'", no_linear);
}

TEST(ValidatePlan, UnreadWeight) {
  Plan plan = tiny_plan();
  plan.weights.push_back({"model.unused.weight", {"model.unused.weight"}, {4, 4}, false, false});
  expect_rejected(plan, "'model.unused.weight') is declared but no op reads it");
}

TEST(ValidatePlan, QueuesAndSlices) {
  Plan plan = tiny_plan();
  std::swap(plan.queues[0][3], plan.queues[0][4]);
  expect_rejected(plan, "op order");
  plan = tiny_plan();
  plan.queues[1].push_back(plan.queues[0].back());
  expect_rejected(plan, "queued twice");
  plan = tiny_plan();
  plan.queues[2].pop_back();
  expect_rejected(plan, "queues hold");
  plan = tiny_plan();
  plan.tasks[4].col_end -= 1;
  expect_rejected(plan, "column");
  plan = tiny_plan();  // a KDA core slice that splits a head
  const int32_t core = first_op(plan, Op::kKdaDeltaRule);
  const auto core_tasks = tasks_of(plan, core);
  ASSERT_EQ(core_tasks.size(), 2u);
  plan.tasks[static_cast<size_t>(core_tasks[0])].col_end -= 1;
  plan.tasks[static_cast<size_t>(core_tasks[1])].col_begin -= 1;
  expect_rejected(plan, "splits a unit");
}

// moe_topk spreads over rows: min(workers, ⌈max_tokens / 16⌉) tasks, the first whole, the others the
// empty slice at its end (the GPU body shares rows by task; the CPU runs the whole one). A plan with
// more empty tasks than its spread is rejected; one with fewer (files from before the spread) passes.
TEST(ValidatePlan, MoeTopkSpreadsOverRows) {
  struct Case {
    int workers;
    int64_t tokens;
    size_t tasks;
  };
  for (const Case& c : {Case{8, 2, 1}, Case{8, 16, 1}, Case{8, 17, 2}, Case{8, 64, 4}, Case{3, 64, 3}, Case{132, 1024, 64}}) {
    const Plan plan = tiny_plan(c.workers, c.tokens);
    const int32_t topk = first_op(plan, Op::kMoeTopK);
    const std::vector<int32_t> tasks = tasks_of(plan, topk);
    ASSERT_EQ(tasks.size(), c.tasks) << c.workers << " workers, " << c.tokens << " rows";
    const int64_t width = plan.ops[static_cast<size_t>(topk)].width;
    for (size_t i = 0; i < tasks.size(); ++i) {
      const PlanTask& task = plan.tasks[static_cast<size_t>(tasks[i])];
      EXPECT_EQ(task.col_begin, i == 0 ? 0 : width) << i;
      EXPECT_EQ(task.col_end, width) << i;
    }
  }
  Plan plan = tiny_plan(4, 64);
  plan.max_tokens = 48;  // a spread of 3 (gated_rms_norm's 4 tasks still fit): the 3 empty tasks are one too many
  expect_rejected(plan, "4 tasks, at most 3");
  plan = tiny_plan(8, 64);  // a plan file from before the spread: one task for the whole op
  drop_spread_tasks(plan, Op::kMoeTopK);
  EXPECT_EQ(tasks_of(plan, first_op(plan, Op::kMoeTopK)).size(), 1u);
  EXPECT_NO_THROW(validate_plan(plan, PlanInterpreter::has_op));
}

// gated_rms_norm (2 heads of 16 in the tiny model) spreads over ⌈rows / 8⌉ tasks up to the workers;
// the GPU gives those past the heads whole rows of a large step.
TEST(ValidatePlan, GatedRmsNormSpreadsOverRows) {
  struct Case {
    int workers;
    int64_t tokens;
    size_t tasks;
  };
  for (const Case& c : {Case{8, 2, 2}, Case{8, 16, 2}, Case{8, 17, 3}, Case{8, 64, 8}, Case{3, 64, 3}, Case{1, 64, 1}, Case{132, 1024, 128}}) {
    const Plan plan = tiny_plan(c.workers, c.tokens);
    const int32_t norm = first_op(plan, Op::kGatedRmsNorm);
    const std::vector<int32_t> tasks = tasks_of(plan, norm);
    ASSERT_EQ(tasks.size(), c.tasks) << c.workers << " workers, " << c.tokens << " rows";
    const int64_t width = plan.ops[static_cast<size_t>(norm)].width, heads = std::min<int64_t>(c.workers, 2);
    ASSERT_EQ(width, 32);
    for (size_t i = 0; i < tasks.size(); ++i) {
      const PlanTask& task = plan.tasks[static_cast<size_t>(tasks[i])];
      EXPECT_EQ(task.col_begin, static_cast<int64_t>(i) < heads ? width * static_cast<int64_t>(i) / heads : width) << i;
      EXPECT_EQ(task.col_end, static_cast<int64_t>(i) < heads ? width * static_cast<int64_t>(i + 1) / heads : width) << i;
    }
  }
  Plan plan = tiny_plan(8, 64);
  plan.max_tokens = 56;  // a spread of 7 (moe_topk's 4 tasks still fit): the 6 empty tasks are one too many
  expect_rejected(plan, "8 tasks, at most 7");
  plan = tiny_plan(132, 1024);  // a plan file from before the spread: one task per head
  drop_spread_tasks(plan, Op::kGatedRmsNorm);
  EXPECT_EQ(tasks_of(plan, first_op(plan, Op::kGatedRmsNorm)).size(), 2u);
  EXPECT_NO_THROW(validate_plan(plan, PlanInterpreter::has_op));
}

// Light ops (lower.cpp is_light) get at most one task per light_task_elements output elements of the
// bucket, at least one; 1 gives them one slice a worker like any other op; the weight-streaming ops
// keep theirs. The plans validate and cover each op exactly (ValidatePlan checks both).
TEST(ValidatePlan, LightOpsGetATaskPerLightTaskElements) {
  const Graph graph = tiny_graph();
  for (int64_t light : {int64_t{1}, int64_t{16}, int64_t{48}, int64_t{512}}) {
    for (int64_t tokens : {int64_t{1}, int64_t{5}}) {
      LowerOptions options{PlanPhase::kDecode, tokens, 8, 0, 42};
      options.light_task_elements = light;
      const Plan plan = lower_to_plan(graph, options);
      EXPECT_NO_THROW(validate_plan(plan, PlanInterpreter::has_op));
      for (Op op : {Op::kShortConvSilu, Op::kRmsNorm, Op::kSiluMul, Op::kLinear}) {
        const PlanOp& planned = plan.ops[static_cast<size_t>(first_op(plan, op))];
        const int64_t slices = std::min<int64_t>(8, planned.width);  // one-column units
        const int64_t want = op == Op::kLinear ? slices : std::clamp<int64_t>((tokens * planned.width + light - 1) / light, 1, slices);
        EXPECT_EQ(static_cast<int64_t>(tasks_of(plan, first_op(plan, op)).size()), want)
            << op_name(op) << " width " << planned.width << ", " << tokens << " rows, light_task_elements " << light;
      }
    }
  }
  LowerOptions zero{PlanPhase::kDecode, 1, 8, 0, 42};
  zero.light_task_elements = 0;
  try {
    lower_to_plan(graph, zero);
    ADD_FAILURE() << "light_task_elements 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("light_task_elements 0 is below 1"), std::string::npos) << e.what();
  }
}

TEST(ValidatePlan, ShapesAndStatesAreRederived) {
  Plan plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kLinear))].width += 1;
  expect_rejected(plan, "shape rule");
  plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kMlaAttention))].attrs.set("heads", 3);
  expect_rejected(plan, "does not fit the op table");
  plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kMoeTopK))].attrs.set("groups", 3);
  expect_rejected(plan, "impossible");
  plan = tiny_plan();  // moe_topk reading the layer input [T, H] as if it were the logits [T, E]
  PlanOp& topk = plan.ops[static_cast<size_t>(first_op(plan, Op::kMoeTopK))];
  topk.inputs[0] = plan.ops[static_cast<size_t>(topk.inputs[0])].inputs[0];
  expect_rejected(plan, "logits for");
  plan = tiny_plan();  // moe_down reading the routes [T, 2k] as if they were the k experts' activations
  PlanOp& down = plan.ops[static_cast<size_t>(first_op(plan, Op::kMoeDown))];
  down.inputs[0] = down.inputs[1];
  expect_rejected(plan, "is not top_k × the expert width");
  plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kMlaAttention))].attrs.set("rope", -8);
  expect_rejected(plan, "must be an integer >= 0");
  plan = tiny_plan();
  std::swap(plan.ops[static_cast<size_t>(first_op(plan, Op::kShortConvSilu))].state, plan.ops[static_cast<size_t>(first_op(plan, Op::kKdaDeltaRule))].state);
  expect_rejected(plan, "wrong kind or size");
  plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kShortConvSilu, 1))].state = plan.ops[static_cast<size_t>(first_op(plan, Op::kShortConvSilu))].state;
  expect_rejected(plan, "already updated by another op");
  plan = tiny_plan();
  plan.ops[static_cast<size_t>(first_op(plan, Op::kAdd))].inputs[0] = 10000;
  expect_rejected(plan, "not an earlier op");
}

// kda_fused_core updates four states: its own (the recurrent one) and the conv windows its attrs name.
TEST(ValidatePlan, FusedKdaCoreStates) {
  const Plan fused = fused_plan();
  const int32_t core = first_op(fused, Op::kKdaFusedCore);
  validate_plan(fused, any_op);
  Plan plan = fused;
  plan.ops[static_cast<size_t>(core)].attrs.set("conv_k", plan.ops[static_cast<size_t>(core)].attrs.get("conv_q"));
  expect_rejected(plan, "already updated by another op");
  plan = fused;
  plan.ops[static_cast<size_t>(core)].attrs.set("conv_v", plan.ops[static_cast<size_t>(core)].state);
  expect_rejected(plan, "already updated by another op");
  plan = fused;  // the next layer's recurrent state named as a conv window
  plan.ops[static_cast<size_t>(core)].attrs.set("conv_v", plan.ops[static_cast<size_t>(first_op(fused, Op::kKdaFusedCore, 1))].state);
  expect_rejected(plan, "conv state");
  plan = fused;
  plan.ops[static_cast<size_t>(core)].attrs.set("conv_q", static_cast<double>(plan.states.size()));
  expect_rejected(plan, "outside the state table");
  plan = fused;
  plan.ops[static_cast<size_t>(core)].attrs.set("conv_q", -1);
  expect_rejected(plan, "must be an integer >= 0");
}

TEST(ValidatePlan, CountsAreBounded) {
  Plan plan = tiny_plan();
  plan.workers = 5000;
  expect_rejected(plan, "field 'workers' is 5000");
  plan = tiny_plan();
  plan.max_tokens = int64_t{1} << 40;
  expect_rejected(plan, "max_tokens");
  plan = tiny_plan();
  plan.counters = -1;
  expect_rejected(plan, "counters");
  plan = tiny_plan();
  plan.output_op = static_cast<int32_t>(plan.ops.size());
  expect_rejected(plan, "output_op");
}

}  // namespace
}  // namespace plow
