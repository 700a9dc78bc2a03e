// KDA's delta rule as planned launches (kda_prefill.h) vs cpu/reference (label gpu): partial chunks,
// cached states, several sequences, Kimi's and K3's bounded gate, steps that fall back to the op body
// and a step split into batches; fp32 and bf16, megakernel and eager, logits within a per-dtype bound
// and bf16 outputs rounded. Split from cuda_prefill_test.cpp (the GEMM, expert and MLA paths).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "graph/random_weights.h"
#include "graph/weights.h"
#include "plan/lower.h"
#include "runtime/cpu/reference.h"
#include "runtime/cuda/backend.h"
#include "prefill_test_util.h"

namespace plow {
namespace {

using gpu_test::declare_weight;
using gpu_test::exact_bf16;
using gpu_test::script_step;

// tokens → embedding tables [50, ·] for q, k, v, the gate's input f and β's logit b → kda_gate (A_log,
// dt_bias; `lower_bound` < 0: K3's bounded form) → kda_delta_rule with its state → output. The inputs
// are exact on both backends, so a difference is the delta rule's own.
struct KdaCase {
  const char* name;
  int64_t heads, d;
  double lower_bound;  // 0: Kimi's gate, −exp(A_log)·softplus(f + dt_bias)
};

Graph kda_graph(const KdaCase& c) {
  Graph g;
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  auto table = [&](const std::string& name, int64_t width) { return g.add(Op::kEmbedding, {tokens}, {declare_weight(g, name, {50, width})}, {}, name); };
  const int q = table("q_table", c.heads * c.d), k = table("k_table", c.heads * c.d), v = table("v_table", c.heads * c.d);
  const int f = table("f_table", c.heads * c.d), b = table("b_table", c.heads);
  Attrs gate_attrs = {{"heads", static_cast<double>(c.heads)}, {"head_dim", static_cast<double>(c.d)}};
  if (c.lower_bound < 0) gate_attrs.set("lower_bound", c.lower_bound);
  const int gate = g.add(Op::kKdaGate, {f}, {declare_weight(g, "A_log", {c.heads}), declare_weight(g, "dt_bias", {c.heads * c.d})}, gate_attrs, "gate");
  const int beta = g.add(Op::kSigmoid, {b}, {}, {}, "beta");
  const int state = g.add_state({StateKind::kKdaRecurrent, c.heads * c.d, c.heads, "state"});
  const int o = g.add(Op::kKdaDeltaRule, {q, k, v, gate, beta}, {}, {{"heads", static_cast<double>(c.heads)}, {"head_dim", static_cast<double>(c.d)}}, "kda",
                      state);
  g.set_output(o);
  g.verify();
  return g;
}

// One step of a KDA script and whether the planned launches take it (every sequence ≥ 16 tokens).
struct KdaStep {
  std::vector<SequenceStep> seqs;
  bool planned;
};

// The delta rule's output rows [T, heads·d] after every step of `steps`, planned launches against the
// op body (prefill_kda_planned off) and cpu/reference, fp32 and bf16, megakernel and eager. Bounds as
// cuda_ops_test's kda cases: fp32 within 128 units of 2⁻²³ of the step's scale (chunked forms, fp32
// rounding and the 3xTF32 products); bf16 within two output ulps of max(|ref|, 1% of the scale), every
// output a bf16 value. The plan holds `plan_rows` rows; `slots` sequences.
void expect_kda_matches_cpu(const KdaCase& c, const std::vector<KdaStep>& steps, int64_t plan_rows, int slots, bool expect_batches) {
  const Graph graph = kda_graph(c);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Checkpoint checkpoint = random_checkpoint(graph, 31, dtype, "prefill-kda");
    const BoundWeights bound_weights(graph, checkpoint);
    auto weights = cuda::upload_weights(graph, bound_weights);
    for (bool planned : {true, false}) {
      for (bool eager : {false, true}) {
        const std::string where = std::string(c.name) + " " + std::string(dtype_name(dtype)) + (eager ? " eager" : " megakernel") + (planned ? "" : ", op body");
        std::vector<Plan> plans = {lower_to_plan(graph, {PlanPhase::kDecode, 4, 132, 0, 0}), lower_to_plan(graph, {PlanPhase::kPrefill, plan_rows, 132, 0, 0})};
        cuda::CudaOptions options;
        options.act_dtype = dtype;
        options.num_slots = slots;
        options.max_context_tokens = 2048;
        options.eager = eager;
        options.poison_arena = true;
        options.prefill_kda_planned = planned;
        cuda::CudaBackend gpu(graph, weights, std::move(plans), options);
        ReferenceBackend cpu(graph, bound_weights, dtype, slots);
        float worst_units = 0;
        for (size_t k = 0; k < steps.size(); ++k) {
          const std::string at = where + " step " + std::to_string(k);
          const StepInputs in = script_step(steps[k].seqs, k);
          const int64_t ops_before = gpu.prefill_kda_ops(), batches_before = gpu.prefill_kda_batches();
          const StepOutput want = cpu.step(in);
          const StepOutput have = gpu.step(in);
          ASSERT_EQ(gpu.prefill_kda_ops() - ops_before, planned && steps[k].planned ? 1 : 0) << at;
          if (planned && steps[k].planned && expect_batches) {
            EXPECT_GT(gpu.prefill_kda_batches() - batches_before, 1) << at << ": the step was never split";
          }
          ASSERT_EQ(have.logits.size(), want.logits.size()) << at;
          float scale = 0;
          for (float v : want.logits) scale = std::max(scale, std::fabs(v));
          ASSERT_GT(scale, 0.0f) << at << ": the reference output is all zero, the step cannot fail";
          for (size_t i = 0; i < want.logits.size(); ++i) {
            const int64_t row = static_cast<int64_t>(i) / have.vocab, col = static_cast<int64_t>(i) % have.vocab;
            ASSERT_FALSE(std::isnan(have.logits[i])) << at << " row " << row << " col " << col;
            const float err = std::fabs(have.logits[i] - want.logits[i]);
            const float unit = dtype == DType::F32 ? 0x1p-23f * scale : 0x1p-7f * std::max(std::fabs(want.logits[i]), 0.01f * scale);
            ASSERT_LE(err, (dtype == DType::F32 ? 128.0f : 2.0f) * unit) << at << " row " << row << " col " << col << ": gpu " << have.logits[i] << " cpu " << want.logits[i];
            if (dtype == DType::BF16) {
              ASSERT_TRUE(exact_bf16(have.logits[i])) << at << " row " << row << " col " << col << " was not rounded";
            }
            worst_units = std::max(worst_units, err / unit);
          }
        }
        std::printf("  %s: max error %.3g units\n", where.c_str(), worst_units);
        for (int slot = 0; slot < slots; ++slot) EXPECT_EQ(gpu.context_tokens(slot), cpu.context_tokens(slot)) << where;
      }
    }
  }
}

// Over three slots: a chunk and one (65); 130 over that state beside a first 17; decode rows (the op
// body, reading the planned states); 300 (four chunks and 44) beside 16 (the threshold); 15 beside 40
// (a sequence under the threshold: the whole step on the op body); 20 + 20 + 20; decode again. Heads
// of 32 with Kimi's gate (strong decays), of the real head dim with K3's bounded gate (γ to −320 in a
// chunk: the pairwise decays must not overflow), and of 72 (off the 32-column groups) with a weak
// bounded gate (the state carries across chunks).
TEST(CudaPrefillKda, PlannedLaunchesMatchTheCpuOverChunksAndSequences) {
  const std::vector<KdaStep> steps = {
      {{{0, 65}}, true},           {{{0, 130}, {1, 17}}, true}, {{{0, 1}, {1, 1}, {2, 1}}, false}, {{{2, 300}, {1, 16}}, true},
      {{{0, 15}, {1, 40}}, false}, {{{0, 20}, {1, 20}, {2, 20}}, true}, {{{0, 1}, {1, 1}, {2, 1}}, false},
  };
  for (const KdaCase& c : {KdaCase{"3 heads of 32, Kimi gate", 3, 32, 0.0}, KdaCase{"2 heads of 128, K3 bounded gate", 2, 128, -5.0},
                           KdaCase{"2 heads of 72, weak bounded gate", 2, 72, -0.1}}) {
    expect_kda_matches_cpu(c, steps, 320, 3, false);
  }
}

// A step of more short prompts than the records hold (plan rows / 64 + 16 chunks a batch): 25 prompts
// of 16 tokens run as two launch pairs, then 100 + 100 + 100 over their states.
TEST(CudaPrefillKda, ManyShortPromptsSplitIntoBatches) {
  std::vector<SequenceStep> many;
  for (int slot = 0; slot < 25; ++slot) many.push_back({slot, 16});
  const std::vector<KdaStep> steps = {{many, true}};
  expect_kda_matches_cpu(KdaCase{"3 heads of 32, Kimi gate", 3, 32, 0.0}, steps, 400, 25, true);
  expect_kda_matches_cpu(KdaCase{"3 heads of 32, Kimi gate", 3, 32, 0.0}, {{{{0, 100}, {7, 100}, {24, 100}}, true}}, 400, 25, false);
}

// The blocks of one sequence's scores (host arithmetic): every block within the budget, never more
// than 256 query rows, all heads at once unless fewer than 64 rows would fit, and the whole step when
// it fits. Padded rows: visible positions rounded up to 8.

}  // namespace
}  // namespace plow
