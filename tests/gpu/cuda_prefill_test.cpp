// The cuda backend's prefill GEMM path (runtime/cuda/prefill_gemm.h, moe_gemm.h) vs cpu/reference
// (label gpu): every checkpoint fixture through an unfused prefill plan (chunks of ≥ 32 rows run their
// linears as cuBLAS GEMMs and their routed experts as grouped expert GEMMs), logits of every prompt row
// within cuda_model_test's bound and 16 greedy tokens after it identical to the reference's; the GEMM
// path alone on odd shapes (rows 33 and 100, out 97, in 200), chained and side by side; router logits
// as an fp32 GEMM (unrounded); and the expert
// GEMMs alone (router, top-k, gate/up, down, down + shared) with routings where some experts get no
// token and some get every token; MLA as GEMMs (mla_gemm.h) over first chunks, chunks with a cached
// prefix and several sequences of different contexts in one step, against the op body and under a
// scores budget small enough to split every sequence; fp32 and bf16, megakernel and eager, against the
// CPU ops; bf16 through the fused attention kernels (mla_flash.cuh on mma.sync for small heads,
// mla_wgmma.cu on wgmma for the real head shape and odd dims past the small kernel's, which also runs
// on the mma.sync kernel once), also over long prefixes at the real head shape; KDA's delta rule as
// planned launches: cuda_prefill_kda_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>

#include "engine/generate.h"
#include "engine/model.h"
#include "engine/plans.h"
#include "graph/random_weights.h"
#include "graph/weights.h"
#include "model/safetensors.h"
#include "plan/lower.h"
#include "runtime/cpu/reference.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/mla_gemm.h"
#include "runtime/cuda/moe_gemm.h"
#include "gpu_test_util.h"
#include "prefill_test_util.h"

namespace plow {
namespace {

namespace fs = std::filesystem;

using gpu_test::data_dir;
using gpu_test::declare_weight;
using gpu_test::exact_bf16;
using gpu_test::prompt;
using gpu_test::script_step;

constexpr int64_t kPromptTokens = 100;  // chunks of 64 and 36: both take the GEMM path
constexpr int64_t kChunk = 64;
constexpr int64_t kNewTokens = 16;
constexpr int64_t kMaxContext = 256;

// cuda_model_test's bound on one logit row: fp32 reassociation; bf16 a few ulps of the logit scale.
float bound(DType act, const float* row, int64_t vocab) {
  float scale = 0;
  for (int64_t i = 0; i < vocab; ++i) scale = std::max(scale, std::fabs(row[i]));
  return act == DType::F32 ? 2e-3f * std::max(1.0f, scale) : 0.05f * std::max(1.0f, scale);
}

class CudaPrefillFixtureTest : public ::testing::TestWithParam<gpu_test::FixtureCase> {};

// fp32: free-running greedy tokens identical, every row within the bound. bf16: teacher-forced with the
// reference's tokens (as cuda_model_test); each row within the bound and the argmax the reference's
// except a near tie (margin within twice the row's error), at most one row in 32.
TEST_P(CudaPrefillFixtureTest, PromptLogitsAndGreedyTokensMatchTheReference) {
  const gpu_test::FixtureCase& c = GetParam();
  const auto model = LoadedModel::load((fs::path(data_dir()) / c.fixture).string());
  const DType act = model->weights->storage_dtype();
  const int64_t vocab = model->config.vocab_size;
  GenerateOptions options;
  options.prompt = prompt(3, vocab, kPromptTokens);
  options.max_new_tokens = kNewTokens;
  options.keep_logits = true;
  ReferenceBackend reference(model->graph, *model->weights, act, 1);
  const GenerateResult want = generate(reference, 0, options);

  std::vector<Plan> plans;
  plans.push_back(compile_plan(*model, PlanPhase::kDecode, 1, c.workers, kMaxContext));
  plans.push_back(compile_plan(*model, PlanPhase::kPrefill, kChunk, c.workers, kMaxContext, /*fuse=*/false));
  cuda::CudaOptions cuda_options;
  cuda_options.act_dtype = act;
  cuda_options.max_context_tokens = kMaxContext;
  cuda_options.eager = c.eager;
  cuda_options.poison_arena = true;
  cuda::CudaBackend gpu(model->graph, cuda::upload_weights(model->graph, *model->weights), std::move(plans), cuda_options);
  options.prefill_chunk_tokens = kChunk;
  if (act != DType::F32) options.forced_tokens = want.generated;
  const GenerateResult have = generate(gpu, 0, options);
  EXPECT_GT(gpu.prefill_gemms(), 0) << "the prompt never took the GEMM path";
  // Both chunks (64 and 36 rows, one sequence) run MLA as GEMMs: kv_b is of the activation dtype.
  const bool has_mla = std::any_of(model->graph.nodes().begin(), model->graph.nodes().end(), [](const Node& n) { return n.op == Op::kMlaAttention; });
  EXPECT_EQ(gpu.prefill_mla_ops() > 0, has_mla) << "MLA layers vs MLA ops run as GEMMs: " << gpu.prefill_mla_ops();
  // K3's MLA output gate (a sigmoid_mul of the attention) runs in the MLA epilogue.
  const bool gated = std::any_of(model->graph.nodes().begin(), model->graph.nodes().end(), [](const Node& n) { return n.op == Op::kSigmoidMul; });
  EXPECT_EQ(gpu.prefill_mla_gated() > 0, has_mla && gated) << "gated MLA ops: " << gpu.prefill_mla_gated();
  // Dense routed experts take the expert GEMMs; MXFP4 ones (tiny-k3) keep the GEMV bodies by design.
  bool mxfp4_experts = false;
  for (const WeightDecl& w : model->graph.weights()) mxfp4_experts = mxfp4_experts || w.mxfp4;
  if (mxfp4_experts) {
    EXPECT_EQ(gpu.prefill_expert_ops(), 0) << "MXFP4 experts ran as expert GEMMs";
  } else {
    EXPECT_GT(gpu.prefill_expert_ops(), 0) << "the prompt's routed experts never ran as expert GEMMs";
  }

  // The GEMM linears whose readers round their outputs as they load them (prefill_gemm.h round_in_mask;
  // bf16: the KDA projections, the output projections, the FFN's gate/up/down) skip their rounding
  // pass: the same bits as a backend where every linear's tasks round.
  if (act != DType::F32) {
    EXPECT_GT(gpu.prefill_linears_rounded_by_readers(), 0) << "no linear's output was left to its readers to round";
    std::vector<Plan> plans_off;
    plans_off.push_back(compile_plan(*model, PlanPhase::kDecode, 1, c.workers, kMaxContext));
    plans_off.push_back(compile_plan(*model, PlanPhase::kPrefill, kChunk, c.workers, kMaxContext, /*fuse=*/false));
    cuda::CudaOptions off_options = cuda_options;
    off_options.prefill_round_in_readers = false;
    cuda::CudaBackend off(model->graph, cuda::upload_weights(model->graph, *model->weights), std::move(plans_off), off_options);
    EXPECT_EQ(off.prefill_linears_rounded_by_readers(), 0);
    const GenerateResult rounded_by_tasks = generate(off, 0, options);
    ASSERT_EQ(rounded_by_tasks.logits.size(), have.logits.size());
    EXPECT_EQ(std::memcmp(rounded_by_tasks.logits.data(), have.logits.data(), have.logits.size() * sizeof(float)), 0)
        << c.fixture << ": the readers' rounding changed the logits";
  } else {
    EXPECT_EQ(gpu.prefill_linears_rounded_by_readers(), 0) << "fp32 activations have nothing to round";
  }

  if (act == DType::F32) {
    EXPECT_EQ(have.generated, want.generated);
    // Without keep_logits a prefill step returns its last row only, which the host computes alone
    // (GemmPath::output_on_host): the same greedy tokens.
    GenerateOptions last_rows = options;
    last_rows.keep_logits = false;
    gpu.reset_slot(0);
    EXPECT_EQ(generate(gpu, 0, last_rows).generated, want.generated) << "the last-row logits of the prefill chunks";
  }
  ASSERT_EQ(have.logits.size(), want.logits.size());
  // fp32: every row within the bound. bf16: as cuda_model_test.cpp, a row may exceed it where a MoE
  // routing decision flips (the GEMM sums in another order than the reference): at most 1 row in 32,
  // and the median row stays within.
  int flips = 0, outliers = 0;
  std::vector<float> row_errors;
  const int64_t rows = static_cast<int64_t>(want.logits.size()) / vocab;
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = want.logits.data() + r * vocab;
    const float* h = have.logits.data() + r * vocab;
    const float limit = bound(act, w, vocab);
    float worst = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      ASSERT_FALSE(std::isnan(h[v])) << c.fixture << " row " << r << " logit " << v;
      worst = std::max(worst, std::fabs(h[v] - w[v]));
    }
    if (act == DType::F32) {
      ASSERT_LE(worst, limit) << c.fixture << " row " << r << (r < kPromptTokens ? " (prompt)" : " (decode)");
    }
    row_errors.push_back(worst / limit);
    if (worst > limit) {
      outliers += 1;
      std::printf("  %s row %lld%s: %g past a bound of %g\n", c.fixture.c_str(), static_cast<long long>(r), r < kPromptTokens ? " (prompt)" : " (decode)",
                  static_cast<double>(worst), static_cast<double>(limit));
    }
    const auto expected = std::max_element(w, w + vocab) - w;
    const auto got = std::max_element(h, h + vocab) - h;
    if (got == expected) continue;
    ASSERT_NE(act, DType::F32) << c.fixture << " row " << r << ": argmax " << got << ", the reference's " << expected;
    ASSERT_LE(w[expected] - w[got], 2 * worst) << c.fixture << " row " << r << ": not a near tie";
    flips += 1;
  }
  // Each flip is already explained by the row's measured error; the cap guards against systematic
  // error. 1 in 32 as in cuda_model_test.cpp (493 rows there), plus 2 for this sample of ~115 rows
  // (the bf16 fixture shows 4 here: 3.5%, against 2.2% over the model test's larger sample).
  EXPECT_LE(flips, rows / 32 + 2) << flips << " near-tie flips in " << rows << " rows";
  EXPECT_LE(outliers * 32, rows) << outliers << " rows past the logit bound in " << rows;
  std::nth_element(row_errors.begin(), row_errors.begin() + static_cast<std::ptrdiff_t>(row_errors.size() / 2), row_errors.end());
  EXPECT_LE(row_errors[row_errors.size() / 2], 1.0f) << "median row error over its bound";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaPrefillFixtureTest, ::testing::ValuesIn(gpu_test::fixture_cases()),
                         [](const auto& param_info) { return gpu_test::case_name(param_info.param); });

// tokens → embedding [50, in] → the linears of `shape`, output y:
//  single: y = linear(x; [out, in]);
//  chain: y = linear(linear(x; [out, in]); [61, out]) (the second GEMM reads the first's rounded output);
//  siblings: y = linear(x; [out, in]) + linear(x; [out, in]) (two GEMMs in one host group).
enum class Shape { kSingle, kChain, kSiblings };

Graph linear_graph(Shape shape, int64_t in, int64_t out) {
  Graph g;
  auto weight = [&](const std::string& name, std::vector<int64_t> dims) { return declare_weight(g, name, std::move(dims)); };
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  const int x = g.add(Op::kEmbedding, {tokens}, {weight("model.embed_tokens.weight", {50, in})}, {}, "embed");
  const int a = g.add(Op::kLinear, {x}, {weight("a", {out, in})}, {}, "a");
  int y = a;
  if (shape == Shape::kChain) y = g.add(Op::kLinear, {a}, {weight("b", {61, out})}, {}, "b");
  if (shape == Shape::kSiblings) y = g.add(Op::kAdd, {a, g.add(Op::kLinear, {x}, {weight("c", {out, in})}, {}, "c")}, {}, {}, "sum");
  g.set_output(y);
  g.verify();
  return g;
}

// What one step did on the GEMM path: plain GEMMs and routed-expert ops run.
struct PathCounts {
  int64_t gemms = 0, expert_ops = 0;
};

// `graph` on the GPU (one prefill plan of `plan_rows` rows, default 100, a poisoned arena: an unwritten
// element reads back as NaN) against cpu/reference, 7 and 132 workers, megakernel and eager, steps of 33
// and plan_rows rows (the GEMM path) and 5 (the GEMV bodies of the same plan), each once with every
// row's output and once as three sequences returning their last rows only (an output linear then runs
// on those rows alone: GemmPath::output_on_host); `expert_cublas`: the expert GEMMs on cuBLAS's grouped
// call instead of the wgmma kernel. check(gpu, rows, counts, where) after each step of every row;
// every output within `fp32_rel` (fp32) or `bf16_ulps` output ulps (bf16) of the largest output, and
// bf16 outputs bf16 values (rounded). An fp32 output (`fp32_out`: router logits, never rounded) is held
// to `fp32_rel` whatever the activation dtype.
template <typename Check>
void expect_gpu_matches_cpu(const Graph& graph, const Checkpoint& checkpoint, DType dtype, const std::string& what, float fp32_rel, float bf16_ulps,
                            Check check, bool fp32_out = false, bool expert_cublas = false, int64_t plan_rows = 100) {
  const BoundWeights bound_weights(graph, checkpoint);
  auto weights = cuda::upload_weights(graph, bound_weights);
  for (int workers : {7, 132}) {
    for (bool eager : {false, true}) {
      const std::string where = what + " " + std::string(dtype_name(dtype)) + " workers " + std::to_string(workers) + (eager ? " eager" : " megakernel");
      std::vector<Plan> plans = {lower_to_plan(graph, {PlanPhase::kPrefill, plan_rows, workers, 0, 0})};
      cuda::CudaOptions options;
      options.act_dtype = dtype;
      options.max_context_tokens = std::max<int64_t>(128, plan_rows);
      options.num_slots = 3;
      options.eager = eager;
      options.poison_arena = true;
      cuda::CudaBackend gpu(graph, weights, std::move(plans), options);
      gpu.set_expert_gemm_cublas(expert_cublas);
      ReferenceBackend cpu(graph, bound_weights, dtype, 3);
      for (int64_t rows : {int64_t{33}, plan_rows, int64_t{5}}) {
        for (bool every_row : {true, false}) {
          const std::string at = where + " rows " + std::to_string(rows) + (every_row ? "" : ", last rows of three sequences");
          const PathCounts before{gpu.prefill_gemms(), gpu.prefill_expert_ops()};
          StepInputs in;
          in.all_logits = every_row;
          for (int64_t i = 0; i < rows; ++i) in.token_ids.push_back(static_cast<int32_t>((i * 13 + rows) % 50));
          in.sequences = {{0, rows}};
          if (!every_row) in.sequences = {{0, rows / 3}, {1, rows / 3 + 1}, {2, rows - 2 * (rows / 3) - 1}};
          const StepOutput want = cpu.step(in);
          const StepOutput have = gpu.step(in);
          if (every_row) check(gpu, rows, PathCounts{gpu.prefill_gemms() - before.gemms, gpu.prefill_expert_ops() - before.expert_ops}, at);
          ASSERT_EQ(have.rows, want.rows) << at;
          ASSERT_EQ(have.logits.size(), want.logits.size()) << at;
          float scale = 0;
          for (float v : want.logits) scale = std::max(scale, std::fabs(v));
          const float limit = (dtype == DType::F32 || fp32_out ? fp32_rel : bf16_ulps * 0.0079f) * std::max(1.0f, scale);
          for (size_t i = 0; i < want.logits.size(); ++i) {
            ASSERT_FALSE(std::isnan(have.logits[i])) << at << " element " << i;
            ASSERT_LE(std::fabs(have.logits[i] - want.logits[i]), limit) << at << " element " << i;
            if (dtype == DType::BF16 && !fp32_out) {
              ASSERT_TRUE(exact_bf16(have.logits[i])) << at << " element " << i << " was not rounded";
            }
          }
          for (int slot = 0; slot < 3; ++slot) {
            cpu.reset_slot(slot);
            gpu.reset_slot(slot);
          }
        }
      }
    }
  }
}

// Bounds as cuda_gemv_test: fp32 reassociation; bf16 one output ulp where a sum lands next to a
// rounding boundary, plus that through a second rounding.
TEST(CudaPrefillGemm, OddShapesMatchTheCpuLinear) {
  for (Shape shape : {Shape::kSingle, Shape::kChain, Shape::kSiblings}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      const Graph graph = linear_graph(shape, 200, 97);
      const int64_t gemms = shape == Shape::kSingle ? 1 : 2;
      expect_gpu_matches_cpu(graph, random_checkpoint(graph, 5, dtype, "prefill-gemm"), dtype, "shape " + std::to_string(static_cast<int>(shape)), 1e-5f, 2.0f,
                             [&](const cuda::CudaBackend&, int64_t rows, PathCounts ran, const std::string& where) {
                               EXPECT_EQ(ran.gemms, rows >= cuda::kGemmMinRows ? gemms : 0) << where;
                             });
    }
  }
}

// Router logits on the GEMM path: tokens → embedding [50, 200] → router_logits ([97, 200]) as the
// output, fp32 and never rounded. Bound: fp32 reassociation for both activation dtypes (bf16 inputs
// are exact, so a logit rounded to bf16, ~2⁻⁹ of the scale, fails it); one GEMM a step of ≥ 32 rows.
TEST(CudaPrefillGemm, RouterLogitsMatchTheCpuUnrounded) {
  Graph g;
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  const int x = g.add(Op::kEmbedding, {tokens}, {declare_weight(g, "model.embed_tokens.weight", {50, 200})}, {}, "embed");
  g.set_output(g.add(Op::kRouterLogits, {x}, {declare_weight(g, "block_sparse_moe.gate.weight", {97, 200})}, {}, "router_logits"));
  g.verify();
  for (DType dtype : {DType::F32, DType::BF16}) {
    expect_gpu_matches_cpu(
        g, random_checkpoint(g, 7, dtype, "prefill-router"), dtype, "router logits", 1e-5f, 0.0f,
        [&](const cuda::CudaBackend&, int64_t rows, PathCounts ran, const std::string& where) { EXPECT_EQ(ran.gemms, rows >= cuda::kGemmMinRows ? 1 : 0) << where; }, true);
  }
}

// tokens → embedding [50, hidden] → router logits → top-k (bias [E]) → moe_gate_up (w1, w3: [inter,
// hidden] × E) → moe_down (w2: [hidden, inter] × E), or moe_down_add with shared = linear(x; [hidden,
// hidden]) as its third input.
struct MoeCase {
  const char* name;
  int64_t hidden, inter, experts, top_k;
  std::vector<float> bias;  // e_score_correction_bias; empty: the random one (small, every expert in play)
  bool add, situ;
  bool grouped;  // bf16 takes one grouped launch (16-byte rows): the wgmma kernel, or cuBLAS's grouped call; else one GEMM per expert
  bool gemv = false;  // some rows route on the device and take the expert GEMV (cuda::kMoeDevicePairsPerExpert)
  int64_t plan_rows = 100;  // the prefill plan's rows and the longest step
};

Graph moe_graph(const MoeCase& c) {
  Graph g;
  auto weight = [&](const std::string& name, std::vector<int64_t> dims, int64_t parts) {
    WeightDecl decl;
    for (int64_t e = 0; e < parts; ++e) decl.parts.push_back(parts == 1 ? name : name + "." + std::to_string(e));
    decl.name = decl.parts.front();
    decl.shape = std::move(dims);
    return g.add_weight(std::move(decl));
  };
  const auto experts = static_cast<double>(c.experts), top_k = static_cast<double>(c.top_k);
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  const int x = g.add(Op::kEmbedding, {tokens}, {weight("model.embed_tokens.weight", {50, c.hidden}, 1)}, {}, "embed");
  const int logits = g.add(Op::kRouterLogits, {x}, {weight("block_sparse_moe.gate.weight", {c.experts, c.hidden}, 1)}, {}, "router_logits");
  const int routes = g.add(Op::kMoeTopK, {logits}, {weight("block_sparse_moe.gate.e_score_correction_bias", {c.experts}, 1)},
                           {{"experts", experts}, {"top_k", top_k}, {"groups", 1}, {"topk_groups", 1}, {"renormalize", 1}, {"scale", 1}, {"softmax", 0}},
                           "router");
  const int w1 = weight("experts.w1", {c.inter, c.hidden}, c.experts), w3 = weight("experts.w3", {c.inter, c.hidden}, c.experts);
  const int w2 = weight("experts.w2", {c.hidden, c.inter}, c.experts);
  const int acts = g.add(Op::kMoeGateUp, {x, routes}, {w1, w3},
                         {{"experts", experts}, {"top_k", top_k}, {"situ", c.situ ? 1.0 : 0.0}, {"beta", 4}, {"linear_beta", 25}}, "experts_gate_up");
  const Attrs routing = {{"experts", experts}, {"top_k", top_k}};
  int y = 0;
  if (c.add) {
    const int shared = g.add(Op::kLinear, {x}, {weight("shared.weight", {c.hidden, c.hidden}, 1)}, {}, "shared");
    y = g.add(Op::kMoeDownAdd, {acts, routes, shared}, {w2}, routing, "experts_down_add");
  } else {
    y = g.add(Op::kMoeDown, {acts, routes}, {w2}, routing, "experts_down");
  }
  g.set_output(y);
  g.verify();
  return g;
}

// `random` with the router bias replaced by `bias` (stored fp32, as random_checkpoint stores it).
Checkpoint with_bias(const Checkpoint& random, const std::vector<float>& bias) {
  Checkpoint out = Checkpoint::in_memory("prefill-moe");
  for (const auto& [name, view] : random.tensors()) {
    std::vector<uint8_t> bytes(view->data, view->data + view->nbytes);
    if (name.ends_with("e_score_correction_bias") && !bias.empty()) {
      EXPECT_EQ(view->dtype, DType::F32);
      bytes.resize(bias.size() * sizeof(float));
      std::memcpy(bytes.data(), bias.data(), bytes.size());
    }
    out.add_tensor(name, view->dtype, view->shape, std::move(bytes));
  }
  return out;
}

// Rows 33 and 100 (or the case's plan_rows) take the expert GEMMs (two host ops a step: gate/up and
// down), 5 rows the GEMV bodies. A bias of +4 puts an expert in every token's top-k (scores are in
// (0, 1)), −4 in none. Each case runs with the wgmma kernel and with cuBLAS's grouped call.
// Bounds: fp32 reassociation; bf16 three output ulps (a gate, up or per-expert dot next to a rounding
// boundary moves one ulp, weighted by routes summing to 1, then the sum's own rounding).
TEST(CudaPrefillGemm, RoutedExpertsMatchTheCpuOps) {
  const std::vector<MoeCase> cases = {
      {"one expert takes every token, two take none", 200, 40, 6, 2, {4, 0, 0, 0, -4, -4}, false, false, true},
      {"three experts take every token (top-3), three none, + shared, SiTU", 200, 40, 6, 3, {4, 4, 4, -4, -4, -4}, true, true, true},
      {"random routing, odd widths (per-expert GEMMs), + shared", 100, 36, 7, 2, {}, true, false, false},
      {"128 experts, top-2: 33 rows routed on the device (expert GEMV), 100 on the host, + shared", 256, 64, 128, 2, {}, true, false, true, true},
      {"128 experts, top-3, odd widths, SiTU: the expert GEMV on scalar loads at 33 rows", 100, 36, 128, 3, {}, false, true, false, true},
      {"8 experts, top-2, wide rows (gate/up 1032 -> 520, down 520 -> 1032)", 1032, 520, 8, 2, {}, true, false, true},
      {"expert 0 takes every token beside seven random ones", 200, 40, 8, 2, {4, 0, 0, 0, 0, 0, 0, 0}, false, false, true},
      {"experts 0 and 5 take all 300 tokens (jobs of 128, 128 and 44 rows), 8 experts, top-3", 1024, 256, 8, 3, {4, 0, 0, 0, 0, 4, 0, 0}, true, false, true,
       false, 300},
      {"16 experts, top-4, 300 tokens: jobs of up to 128 rows, ragged widths (gate/up 264 -> 136)", 264, 136, 16, 4, {}, false, true, true, false, 300},
  };
  for (const MoeCase& c : cases) {
    for (const bool cublas : {false, true}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        const Graph graph = moe_graph(c);
        bool gemv_ran = false;
        auto check = [&](const cuda::CudaBackend& gpu, int64_t rows, PathCounts ran, const std::string& where) {
          ASSERT_EQ(ran.expert_ops, rows >= cuda::kGemmMinRows ? 2 : 0) << where;
          EXPECT_EQ(ran.gemms, rows >= cuda::kGemmMinRows ? (c.add ? 2 : 1) : 0) << where << ": the router logits (and the shared linear) as GEMMs";
          if (rows < cuda::kGemmMinRows) return;
          const std::vector<int32_t> tokens = gpu.last_expert_tokens();
          ASSERT_EQ(static_cast<int64_t>(tokens.size()), c.experts) << where;
          int64_t pairs = 0;
          for (int64_t e = 0; e < c.experts; ++e) {
            pairs += tokens[static_cast<size_t>(e)];
            const float b = c.bias.empty() ? 0.0f : c.bias[static_cast<size_t>(e)];
            const int64_t expected = b > 1 ? rows : b < -1 ? 0 : -1;  // −1: free to vary
            if (expected >= 0) {
              EXPECT_EQ(tokens[static_cast<size_t>(e)], expected) << where << " expert " << e;
            }
          }
          EXPECT_EQ(pairs, rows * c.top_k) << where;
          const bool device = pairs <= cuda::kMoeDevicePairsPerExpert * c.experts;
          EXPECT_EQ(gpu.last_expert_gemv(), device) << where << ": " << pairs << " pairs over " << c.experts << " experts";
          const std::string path = device                              ? "expert gemv"
                                   : dtype == DType::F32 || !c.grouped ? "cublas per expert"
                                   : cublas                            ? "cublas grouped"
                                                                       : "wgmma grouped";
          EXPECT_EQ(gpu.last_expert_gemm(), path) << where << ": one grouped launch expected for bf16 with 16-byte rows";
          gemv_ran = gemv_ran || gpu.last_expert_gemv();
        };
        const std::string name = std::string(c.name) + (cublas ? " (cuBLAS grouped)" : "");
        expect_gpu_matches_cpu(graph, with_bias(random_checkpoint(graph, 11, dtype, "prefill-moe"), c.bias), dtype, name, 2e-5f, 3.0f, check, false, cublas,
                               c.plan_rows);
        if (c.gemv) {
          EXPECT_TRUE(gemv_ran) << name << " " << dtype_name(dtype) << ": the case is meant for the expert GEMV, which never ran";
        }
      }
    }
  }
}

// ---- MLA as GEMMs (mla_gemm.h) ---------------------------------------------------------------------

// tokens → embedding [50, hidden] → q = linear(x; [heads·(nope+rope), hidden]), kv_a = linear(x;
// [rank+rope, hidden]) → mla_attention (kv_a_layernorm [rank], kv_b [heads·(nope+v), rank]) → output;
// `gate`: K3's output gate, sigmoid_mul(attention, linear(x; [heads·v, hidden])) as the output (the
// gate computed before the attention, as the model graph does).
struct MlaCase {
  const char* name;
  int64_t hidden, heads, nope, rope, dv, rank;
  bool gate = false;
};

Graph mla_graph(const MlaCase& c) {
  Graph g;
  auto weight = [&](const std::string& name, std::vector<int64_t> dims) { return declare_weight(g, name, std::move(dims)); };
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  const int x = g.add(Op::kEmbedding, {tokens}, {weight("model.embed_tokens.weight", {50, c.hidden})}, {}, "embed");
  const int q = g.add(Op::kLinear, {x}, {weight("self_attn.q_proj.weight", {c.heads * (c.nope + c.rope), c.hidden})}, {}, "q_proj");
  const int kv_a = g.add(Op::kLinear, {x}, {weight("self_attn.kv_a_proj_with_mqa.weight", {c.rank + c.rope, c.hidden})}, {}, "kv_a");
  const int gate = c.gate ? g.add(Op::kLinear, {x}, {weight("self_attn.g_proj.weight", {c.heads * c.dv, c.hidden})}, {}, "g_proj") : -1;
  const int cache = g.add_state({StateKind::kMlaLatent, c.rank + c.rope, 0, "latent"});
  const Attrs attrs = {{"heads", static_cast<double>(c.heads)}, {"nope", static_cast<double>(c.nope)}, {"rope", static_cast<double>(c.rope)},
                       {"v", static_cast<double>(c.dv)},       {"rank", static_cast<double>(c.rank)}, {"eps", 1e-6}};
  int o = g.add(Op::kMlaAttention, {q, kv_a},
                {weight("self_attn.kv_a_layernorm.weight", {c.rank}), weight("self_attn.kv_b_proj.weight", {c.heads * (c.nope + c.dv), c.rank})}, attrs,
                "attention", cache);
  if (gate >= 0) o = g.add(Op::kSigmoidMul, {o, gate}, {}, {}, "output_gate");
  g.set_output(o);
  g.verify();
  return g;
}

// `random` with tensor `name` multiplied by `factor`, a power of two (exact in fp32 and bf16).
Checkpoint scaled(const Checkpoint& random, const std::string& name, float factor) {
  Checkpoint out = Checkpoint::in_memory("prefill-mla");
  for (const auto& [tensor, view] : random.tensors()) {
    std::vector<uint8_t> bytes(view->data, view->data + view->nbytes);
    if (tensor == name) {
      EXPECT_TRUE(view->dtype == DType::F32 || view->dtype == DType::BF16) << tensor;
      const size_t size = dtype_size(view->dtype);
      for (size_t i = 0; i < bytes.size() / size; ++i) {
        if (view->dtype == DType::F32) {
          float v = 0;
          std::memcpy(&v, bytes.data() + 4 * i, 4);
          v *= factor;
          std::memcpy(bytes.data() + 4 * i, &v, 4);
        } else {
          uint16_t b = 0;
          std::memcpy(&b, bytes.data() + 2 * i, 2);
          b = f32_to_bf16(bf16_to_f32(b) * factor);
          std::memcpy(bytes.data() + 2 * i, &b, 2);
        }
      }
    }
    out.add_tensor(tensor, view->dtype, view->shape, std::move(bytes));
  }
  return out;
}

// One step of the MLA script and whether its MLA must run as GEMMs (a sequence of ≥ 32 tokens).
struct MlaStep {
  std::vector<SequenceStep> seqs;
  bool gemm;
};

enum class MlaMode { kGemm, kGemmSmallBudget, kBody };

// Steps over three slots: a first chunk (45 rows); a second chunk over its 45 cached positions; 3 rows
// (GEMV bodies and MLA's op body); three sequences of 83, 3 and 0 cached positions in one step; decode
// (the op body reads rows the GEMMs appended); a chunk of 40 beside 2 rows of another sequence; 20 + 20
// rows (the GEMM path, but no sequence brings 32 tokens: MLA on its op body). The outputs are the MLA
// op's rows [T, heads·v], compared with cpu/reference after every step: fp32 within 1e-5 of the step's
// largest output (reassociation); bf16 within 3 output ulps of it as GEMMs (kv and the output are
// rounded where the CPU rounds them, P by the fused kernel before normalizing, a fraction of an ulp:
// mla_flash.cuh; one ulp where a sum lands next to a rounding boundary) and 4 on the op body (absorbed
// form: it does not round kv, as cuda_ops_test bounds it), and every output a bf16 value. q's weights
// are scaled by 8 so the softmax is far from uniform (a wrong causal bound or a missing position moves
// outputs by a large part of the scale). fp32 attends in score blocks (one per sequence, or many
// under the small budget); bf16 in the fused kernel, one launch per sequence, whatever the budget.
// The gated cases' outputs are sigmoid_mul's (σ < 1 scales an output's error down with it; its own
// rounding is the CPU's, on the same operands where the attention's output agrees), and every GEMM step
// must have applied the gate in the MLA epilogue.
TEST(CudaPrefillMla, GemmFormMatchesTheCpuOverChunksAndSequences) {
  const std::vector<MlaCase> cases = {
      {"3 heads, odd head dims", 72, 3, 13, 7, 11, 36},
      {"2 heads of the real head shape", 64, 2, 128, 64, 128, 512},
      // The wgmma kernel below its instantiation's dims: K boxes past ld_k (104) and Vᵀ rows past dv
      // (72: the next head's, then past the last head) as the tensor copies fill them.
      {"2 heads past the small kernel, odd dims", 64, 2, 71, 33, 72, 40},
      // K3's output gate in the epilogue: the score blocks' scatter (fp32), the mma.sync kernel (small
      // heads) and the wgmma kernel (the real head shape).
      {"3 heads, odd head dims, output gate", 72, 3, 13, 7, 11, 36, true},
      {"2 heads of the real head shape, output gate", 64, 2, 128, 64, 128, 512, true},
  };
  const std::vector<MlaStep> steps = {
      {{{0, 45}}, true},         {{{0, 38}}, true},         {{{1, 3}}, false}, {{{0, 7}, {1, 33}, {2, 12}}, true},
      {{{0, 1}, {1, 1}, {2, 1}}, false}, {{{2, 40}, {0, 2}}, true}, {{{0, 20}, {1, 20}}, false},
  };
  for (const MlaCase& c : cases) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      const Graph graph = mla_graph(c);
      const Checkpoint checkpoint = scaled(random_checkpoint(graph, 21, dtype, "prefill-mla"), "self_attn.q_proj.weight", 8.0f);
      const BoundWeights bound_weights(graph, checkpoint);
      auto weights = cuda::upload_weights(graph, bound_weights);
      for (int workers : {7, 132}) {
        for (bool eager : {false, true}) {
          for (MlaMode mode : {MlaMode::kGemm, MlaMode::kGemmSmallBudget, MlaMode::kBody}) {
            const char* mode_name = mode == MlaMode::kGemm ? "GEMMs" : mode == MlaMode::kBody ? "op body" : "GEMMs, 4 KiB scores";
            const std::string where = std::string(c.name) + " " + std::string(dtype_name(dtype)) + " workers " + std::to_string(workers) +
                                      (eager ? " eager " : " megakernel ") + mode_name;
            std::vector<Plan> plans = {lower_to_plan(graph, {PlanPhase::kDecode, 4, workers, 0, 0}), lower_to_plan(graph, {PlanPhase::kPrefill, 64, workers, 0, 0})};
            cuda::CudaOptions options;
            options.act_dtype = dtype;
            options.num_slots = 3;
            options.max_context_tokens = 128;
            options.eager = eager;
            options.poison_arena = true;
            options.prefill_mla_gemm = mode != MlaMode::kBody;
            if (mode == MlaMode::kGemmSmallBudget) options.mla_scores_bytes = 4096;  // 1,024 floats: a few query rows of one head per block
            cuda::CudaBackend gpu(graph, weights, std::move(plans), options);
            ReferenceBackend cpu(graph, bound_weights, dtype, 3);
            for (size_t k = 0; k < steps.size(); ++k) {
              const std::string at = where + " step " + std::to_string(k);
              const StepInputs in = script_step(steps[k].seqs, k);
              const int64_t ops_before = gpu.prefill_mla_ops(), blocks_before = gpu.prefill_mla_blocks(), flash_before = gpu.prefill_mla_flash();
              const int64_t gated_before = gpu.prefill_mla_gated();
              const StepOutput want = cpu.step(in);
              const StepOutput have = gpu.step(in);
              const bool gemm = steps[k].gemm && mode != MlaMode::kBody;
              ASSERT_EQ(gpu.prefill_mla_ops() - ops_before, gemm ? 1 : 0) << at;
              ASSERT_EQ(gpu.prefill_mla_gated() - gated_before, gemm && c.gate ? 1 : 0) << at << ": the output gate in the MLA epilogue";
              const int64_t blocks = gpu.prefill_mla_blocks() - blocks_before, flash = gpu.prefill_mla_flash() - flash_before;
              const auto seqs = static_cast<int64_t>(in.sequences.size());
              if (!gemm) {
                EXPECT_EQ(blocks + flash, 0) << at;
              } else if (dtype != DType::F32) {
                EXPECT_EQ(flash, seqs) << at;
                EXPECT_EQ(blocks, 0) << at;
              } else {
                // One block per sequence when the scores fit; the small budget splits every sequence.
                EXPECT_EQ(flash, 0) << at;
                if (mode == MlaMode::kGemm) {
                  EXPECT_EQ(blocks, seqs) << at;
                } else {
                  EXPECT_GT(blocks, 2 * seqs) << at;
                }
              }
              ASSERT_EQ(have.logits.size(), want.logits.size()) << at;
              float scale = 0;
              for (float v : want.logits) scale = std::max(scale, std::fabs(v));
              ASSERT_GT(scale, 0.0f) << at << ": the reference output is all zero, the step cannot fail";
              const float limit = dtype == DType::F32 ? 1e-5f * scale : (mode == MlaMode::kBody ? 4.0f : 3.0f) * 0.0079f * scale;
              for (size_t i = 0; i < want.logits.size(); ++i) {
                const int64_t row = static_cast<int64_t>(i) / have.vocab, col = static_cast<int64_t>(i) % have.vocab;
                ASSERT_FALSE(std::isnan(have.logits[i])) << at << " row " << row << " col " << col;
                ASSERT_LE(std::fabs(have.logits[i] - want.logits[i]), limit)
                    << at << " row " << row << " col " << col << ": gpu " << have.logits[i] << " cpu " << want.logits[i];
                if (dtype == DType::BF16) {
                  ASSERT_TRUE(exact_bf16(have.logits[i])) << at << " row " << row << " col " << col << " was not rounded";
                }
              }
            }
            for (int slot = 0; slot < 3; ++slot) EXPECT_EQ(gpu.context_tokens(slot), cpu.context_tokens(slot)) << where;
          }
        }
      }
    }
  }
}

// The fused attention kernel (mla_flash.cuh) at the real head shape (q·k 192, v 128) over prefixes of
// hundreds of positions, where the step above reaches two key tiles: a first chunk of 300 rows (5 query
// tiles, the last partial); 517 rows over those 300 cached positions beside a second sequence's first
// 70 (context off the 64-position tiles, two sequences' rows in one op); 700 rows over 817 (24 key tiles
// through the two-stage pipeline); 64 rows over 70. bf16, megakernel and eager against cpu/reference
// after every step, with the bound and checks of the test above; every sequence through the kernel.
TEST(CudaPrefillMla, FusedKernelOverLongPrefixesAtTheRealHeadShape) {
  const MlaCase c = {"3 heads of the real head shape", 64, 3, 128, 64, 128, 64};
  // Slot 1's first chunk of 40 rows is a block of one K/V tile (the kernel's shortest path).
  const std::vector<std::vector<SequenceStep>> steps = {{{0, 300}, {1, 40}}, {{0, 517}, {1, 70}}, {{0, 700}}, {{1, 64}}};
  const Graph graph = mla_graph(c);
  const Checkpoint checkpoint = scaled(random_checkpoint(graph, 23, DType::BF16, "prefill-mla"), "self_attn.q_proj.weight", 8.0f);
  const BoundWeights bound_weights(graph, checkpoint);
  auto weights = cuda::upload_weights(graph, bound_weights);
  // Megakernel and eager on the wgmma kernel (mla_wgmma.cu), and the megakernel on the mma.sync one
  // (mla_flash.cuh), which these heads take only when asked (set_mla_flash_mma_sync).
  std::vector<std::unique_ptr<cuda::CudaBackend>> gpus;
  for (bool eager : {false, true, false}) {
    std::vector<Plan> plans = {lower_to_plan(graph, {PlanPhase::kDecode, 4, 132, 0, 0}), lower_to_plan(graph, {PlanPhase::kPrefill, 704, 132, 0, 0})};
    cuda::CudaOptions options;
    options.act_dtype = DType::BF16;
    options.num_slots = 2;
    options.max_context_tokens = 1600;
    options.eager = eager;
    options.poison_arena = true;
    gpus.push_back(std::make_unique<cuda::CudaBackend>(graph, weights, std::move(plans), options));
  }
  gpus[2]->set_mla_flash_mma_sync(true);
  ReferenceBackend cpu(graph, bound_weights, DType::BF16, 2);
  for (size_t k = 0; k < steps.size(); ++k) {
    const StepInputs in = script_step(steps[k], k);
    const StepOutput want = cpu.step(in);
    float scale = 0;
    for (float v : want.logits) scale = std::max(scale, std::fabs(v));
    ASSERT_GT(scale, 0.0f) << "step " << k << ": the reference output is all zero, the step cannot fail";
    const float limit = 3.0f * 0.0079f * scale;
    for (size_t b = 0; b < gpus.size(); ++b) {
      const std::string at = std::string(b == 0 ? "megakernel" : b == 1 ? "eager" : "megakernel, mma.sync kernel") + " step " + std::to_string(k);
      cuda::CudaBackend& gpu = *gpus[b];
      const int64_t flash_before = gpu.prefill_mla_flash(), blocks_before = gpu.prefill_mla_blocks(), wgmma_before = gpu.prefill_mla_wgmma();
      const StepOutput have = gpu.step(in);
      EXPECT_EQ(gpu.prefill_mla_flash() - flash_before, static_cast<int64_t>(in.sequences.size())) << at;
      EXPECT_EQ(gpu.prefill_mla_wgmma() - wgmma_before, b < 2 ? static_cast<int64_t>(in.sequences.size()) : 0) << at;
      EXPECT_EQ(gpu.prefill_mla_blocks() - blocks_before, 0) << at;
      ASSERT_EQ(have.logits.size(), want.logits.size()) << at;
      float worst = 0;
      for (size_t i = 0; i < want.logits.size(); ++i) {
        const int64_t row = static_cast<int64_t>(i) / have.vocab, col = static_cast<int64_t>(i) % have.vocab;
        ASSERT_FALSE(std::isnan(have.logits[i])) << at << " row " << row << " col " << col;
        ASSERT_LE(std::fabs(have.logits[i] - want.logits[i]), limit) << at << " row " << row << " col " << col << ": gpu " << have.logits[i] << " cpu " << want.logits[i];
        ASSERT_TRUE(exact_bf16(have.logits[i])) << at << " row " << row << " col " << col << " was not rounded";
        worst = std::max(worst, std::fabs(have.logits[i] - want.logits[i]));
      }
      std::printf("  %s: max error %.3g (%.3g ulps of the scale %.3g)\n", at.c_str(), worst, worst / (0.0079f * scale), scale);
    }
  }
  for (int slot = 0; slot < 2; ++slot) {
    for (const auto& gpu : gpus) EXPECT_EQ(gpu->context_tokens(slot), cpu.context_tokens(slot));
  }
}

TEST(CudaPrefillMla, ScoreBlocksStayWithinTheBudget) {
  for (int64_t tokens : {1, 5, 33, 64, 100, 257, 1024}) {
    for (int64_t context : {0, 7, 1000, 32768}) {
      for (int64_t heads : {1, 3, 32}) {
        for (int64_t floats : {int64_t{40000}, int64_t{1} << 20, int64_t{128} << 20}) {
          const int64_t visible = context + tokens, ld = (visible + 7) / 8 * 8;
          const cuda::MlaBlocking b = cuda::mla_blocking(tokens, visible, heads, floats);
          const std::string at = "tokens " + std::to_string(tokens) + " context " + std::to_string(context) + " heads " + std::to_string(heads) + " floats " +
                                 std::to_string(floats);
          ASSERT_GE(b.query_rows, 1) << at;
          ASSERT_GE(b.head_group, 1) << at;
          EXPECT_LE(b.query_rows, std::min<int64_t>(tokens, 256)) << at;
          EXPECT_LE(b.head_group, heads) << at;
          EXPECT_LE(b.query_rows * b.head_group * ld, floats) << at;
          if (b.head_group < heads) {
            EXPECT_EQ(b.query_rows, std::min<int64_t>({tokens, 64, floats / ld})) << at;
          }
          if (heads * std::min<int64_t>(tokens, 256) * ld <= floats) {
            EXPECT_EQ(b.query_rows, std::min<int64_t>(tokens, 256)) << at;
            EXPECT_EQ(b.head_group, heads) << at;
          }
        }
      }
    }
  }
  // The 48B shape at 32K positions in 512 MiB of scores: 4,096 (head, row) pairs, 128 rows of 32 heads.
  const cuda::MlaBlocking big = cuda::mla_blocking(1024, 32768, 32, int64_t{128} << 20);
  EXPECT_EQ(big.query_rows, 128);
  EXPECT_EQ(big.head_group, 32);
}

}  // namespace
}  // namespace plow

