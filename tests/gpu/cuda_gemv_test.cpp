// The weight-streaming op bodies of the cuda backend (ops/gemv.cuh) vs cpu/reference, test-backend-ops
// style: one small graph per case (tokens → embedding → the op's inputs → the op), odd widths (rows
// that are not 16-byte aligned take the scalar path), batches and prefill chunks, fp32 and bf16,
// megakernel and eager (the same bodies on the same slices: bit-identical), several worker counts.
// Outputs are poisoned by the previous case's run and the arena is reused, so an unwritten column
// shows up as a mismatch; NaN fails. "_view" cases read the embedding through a slice of a wider table
// (a plan reads it in place: row stride > width, odd offset).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>

#include "graph/random_weights.h"
#include "graph/weights.h"
#include "plan/lower.h"
#include "runtime/cpu/reference.h"
#include "runtime/cuda/backend.h"

namespace plow {
namespace {

struct GemvCase {
  std::string name;
  Op op;
  int64_t hidden;
  int64_t out;
  DType dtype;
  bool mxfp4 = false;  // MoE cases: experts stored as MXFP4
  bool view = false;   // x = columns [5, 5 + hidden) of an embedding [V, hidden + 13]
};

// Builds tokens → embedding [V, hidden] → (inputs) → op; returns the graph.
Graph build(const GemvCase& c) {
  Graph g;
  const int64_t vocab = 50;
  auto weight = [&](const std::string& name, std::vector<int64_t> shape) {
    WeightDecl decl;
    decl.name = name;
    decl.parts = {name};
    decl.shape = std::move(shape);
    return g.add_weight(std::move(decl));
  };
  const int tokens = g.add(Op::kTokens, {}, {}, {}, "tokens");
  const int64_t table_width = c.view ? c.hidden + 13 : c.hidden;
  int x = g.add(Op::kEmbedding, {tokens}, {weight("model.embed_tokens.weight", {vocab, table_width})}, {}, "embed");
  if (c.view) x = g.add(Op::kSlice, {x}, {}, {{"offset", 5.0}, {"width", static_cast<double>(c.hidden)}}, "embed.view");
  auto linear = [&](int in, int64_t width, const std::string& name) { return g.add(Op::kLinear, {in}, {weight(name, {width, c.hidden})}, {}, name); };
  // Two [T, hidden] operands: linears of x, or (view cases) columns [3, 3 + hidden) and [3 + hidden, 3 +
  // 2·hidden) of one multi_linear, as horizontal fusion makes them.
  auto operands = [&](const std::string& a, const std::string& b) -> std::pair<int, int> {
    if (!c.view) return {linear(x, c.hidden, a), linear(x, c.hidden, b)};
    const int both = g.add(Op::kMultiLinear, {x}, {weight("pad", {3, c.hidden}), weight(a, {c.hidden, c.hidden}), weight(b, {c.hidden, c.hidden})}, {}, a + b);
    const auto part = [&](int64_t offset, const std::string& name) {
      return g.add(Op::kSlice, {both}, {}, {{"offset", static_cast<double>(offset)}, {"width", static_cast<double>(c.hidden)}}, name);
    };
    return {part(3, a), part(3 + c.hidden, b)};
  };
  int y = -1;
  switch (c.op) {
    case Op::kLinear: y = linear(x, c.out, "w"); break;
    case Op::kNormLinear:
      y = g.add(Op::kNormLinear, {x}, {weight("input_layernorm.weight", {c.hidden}), weight("w", {c.out, c.hidden})}, {{"eps", 1e-5}}, "y");
      break;
    case Op::kMultiLinear:
      y = g.add(Op::kMultiLinear, {x}, {weight("a", {c.out, c.hidden}), weight("b", {7, c.hidden}), weight("c", {c.out + 3, c.hidden})}, {}, "y");
      break;
    case Op::kNormMultiLinear:
      y = g.add(Op::kNormMultiLinear, {x}, {weight("n.norm.weight", {c.hidden}), weight("a", {c.out, c.hidden}), weight("b", {5, c.hidden})}, {{"eps", 1e-6}},
                "y");
      break;
    case Op::kAddNormMultiLinear: {  // the residual sum's terms: two projections of x, or two views of one
      const auto [a, b] = operands("a", "b");
      y = g.add(Op::kAddNormMultiLinear, {a, b}, {weight("n.norm.weight", {c.hidden}), weight("p", {c.out, c.hidden}), weight("q", {5, c.hidden})},
                {{"eps", 1e-6}}, "y");
      break;
    }
    case Op::kAddNormRouterLogits: {  // out = experts
      const auto [a, b] = operands("a", "b");
      y = g.add(Op::kAddNormRouterLogits, {a, b}, {weight("post_attention_layernorm.weight", {c.hidden}), weight("mlp.block_sparse_moe.gate.weight", {c.out, c.hidden})},
                {{"eps", 1e-5}}, "y");
      break;
    }
    case Op::kLinearAdd: {
      const int r = linear(x, c.out, "r");
      y = g.add(Op::kLinearAdd, {x, r}, {weight("w", {c.out, c.hidden})}, {}, "y");
      break;
    }
    case Op::kGateUpAct:
      y = g.add(Op::kGateUpAct, {x}, {weight("g", {c.out, c.hidden}), weight("u", {c.out, c.hidden})},
                {{"act", c.out % 3 == 0 ? 1.0 : 0.0}, {"beta", 4.0}, {"linear_beta", 25.0}}, "y");
      break;
    case Op::kActLinear: {
      const auto [a, b] = operands("a", "b");
      y = g.add(Op::kActLinear, {a, b}, {weight("w", {c.out, c.hidden})}, {{"act", static_cast<double>(c.out % 3)}, {"beta", 4.0}, {"linear_beta", 0.0}}, "y");
      break;
    }
    case Op::kGatedNormLinear: {
      const int64_t d = c.hidden / 2;
      const auto [o, z] = operands("o", "z");
      y = g.add(Op::kGatedNormLinear, {o, z}, {weight("o_norm.weight", {d}), weight("w", {c.out, c.hidden})},
                {{"heads", 2.0}, {"head_dim", static_cast<double>(d)}, {"eps", 1e-5}}, "y");
      break;
    }
    case Op::kLinearKdaGate: {  // heads of out / 3 or out columns; an odd head dim takes K3's bounded gate
      const int64_t heads = c.out % 3 == 0 ? 3 : 1, d = c.out / heads;
      Attrs attrs{{"heads", static_cast<double>(heads)}, {"head_dim", static_cast<double>(d)}};
      if (d % 2 != 0) attrs.set("lower_bound", -5.0);
      y = g.add(Op::kLinearKdaGate, {x}, {weight("w", {c.out, c.hidden}), weight("kda.A_log", {heads}), weight("kda.dt_bias", {c.out})}, attrs, "y");
      break;
    }
    case Op::kRouterLogits:  // out = experts; the router's name draws the router's scale (random_weights.cpp)
      y = g.add(Op::kRouterLogits, {x}, {weight("mlp.block_sparse_moe.gate.weight", {c.out, c.hidden})}, {}, "y");
      break;
    case Op::kMoeDown:
    case Op::kMoeDownAdd: {  // router logits → top-k → gate/up → down over 8 experts, top-3; inter = c.out
      const int64_t experts = 8, top_k = 3;
      const int logits = g.add(Op::kRouterLogits, {x}, {weight("mlp.block_sparse_moe.gate.weight", {experts, c.hidden})}, {}, "router_logits");
      const int routes = g.add(Op::kMoeTopK, {logits}, {weight("mlp.block_sparse_moe.gate.e_score_correction_bias", {experts})},
                               {{"experts", 8.0}, {"top_k", 3.0}, {"groups", 1.0}, {"topk_groups", 1.0}, {"renormalize", 1.0}, {"scale", 2.5}, {"softmax", 0.0}},
                               "router");
      int stacks[3];
      for (int j = 0; j < 3; ++j) {
        WeightDecl decl;
        for (int64_t e = 0; e < experts; ++e) decl.parts.push_back("experts." + std::to_string(e) + ".w" + std::to_string(j));
        decl.name = decl.parts.front();
        decl.shape = j == 2 ? std::vector<int64_t>{c.hidden, c.out} : std::vector<int64_t>{c.out, c.hidden};
        decl.mxfp4 = c.mxfp4;
        stacks[j] = g.add_weight(std::move(decl));
      }
      const Attrs act = {{"situ", c.out % 64 == 0 ? 1.0 : 0.0}, {"beta", 4.0}, {"linear_beta", 25.0}, {"experts", 8.0}, {"top_k", 3.0}};
      const int h = g.add(Op::kMoeGateUp, {x, routes}, {stacks[0], stacks[1]}, act, "gate_up");
      const Attrs routing = {{"experts", 8.0}, {"top_k", static_cast<double>(top_k)}};
      y = c.op == Op::kMoeDown ? g.add(Op::kMoeDown, {h, routes}, {stacks[2]}, routing, "down")
                               : g.add(Op::kMoeDownAdd, {h, routes, x}, {stacks[2]}, routing, "down");
      break;
    }
    default: ADD_FAILURE() << "no graph for " << op_name(c.op);
  }
  g.set_output(y);
  g.verify();
  return g;
}

std::vector<int32_t> token_ids(int64_t n, int seed) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((i * 17 + seed * 5 + 3) % 50));
  return ids;
}

class CudaGemvTest : public ::testing::TestWithParam<GemvCase> {};

TEST_P(CudaGemvTest, MatchesTheReference) {
  const GemvCase& c = GetParam();
  const Graph graph = build(c);
  const Checkpoint checkpoint = random_checkpoint(graph, 11, c.dtype, "gemv-case");
  const BoundWeights bound(graph, checkpoint);
  auto weights = cuda::upload_weights(graph, bound);
  const std::array<int64_t, 5> batches = {1, 3, 8, 13, 19};  // 19: one prefill sequence
#ifdef PLOW_EMU_TEST
  // The host emulator (tests/gpu/emu) runs a task at a time, eager or not: two worker counts, one mode.
  const std::vector<int> worker_counts = {3, 132};
  const std::vector<bool> modes = {false};
#else
  const std::vector<int> worker_counts = {3, 7, 132};
  const std::vector<bool> modes = {false, true};
#endif
  for (int workers : worker_counts) {
    std::vector<std::vector<float>> megakernel_out;  // per step below: eager must give the same bits
    for (bool eager : modes) {
      std::vector<Plan> plans;
      for (int64_t batch : {1, 3, 8, 13}) plans.push_back(lower_to_plan(graph, {PlanPhase::kDecode, batch, workers, 0, 0}));
      plans.push_back(lower_to_plan(graph, {PlanPhase::kPrefill, 19, workers, 0, 0}));
      cuda::CudaOptions options;
      options.act_dtype = c.dtype;
      options.num_slots = 13;
      options.max_context_tokens = 64;
      options.eager = eager;
      options.poison_arena = true;  // an unwritten column reads back as NaN
      cuda::CudaBackend gpu(graph, weights, std::move(plans), options);
      ReferenceBackend cpu(graph, bound, c.dtype, 13);
      for (size_t b = 0; b < batches.size(); ++b) {
        const int64_t batch = batches[b];
        StepInputs in;
        in.all_logits = true;
        if (batch == 19) {  // one prefill sequence
          in.token_ids = token_ids(19, workers);
          in.sequences = {{0, 19}};
        } else {
          in.token_ids = token_ids(batch, workers + static_cast<int>(batch));
          for (int s = 0; s < batch; ++s) in.sequences.push_back({s, 1});
        }
        const StepOutput want = cpu.step(in);
        const StepOutput have = gpu.step(in);
        ASSERT_EQ(have.logits.size(), want.logits.size());
        float scale = 0;
        for (float v : want.logits) scale = std::max(scale, std::fabs(v));
        // fp32 (and the router logits, fp32 whatever the dtype: bf16 products are exact in fp32):
        // reassociation of dots of ≤ 2304 terms; bf16: one bf16 ulp of the output where a sum lands next
        // to a rounding boundary (2⁻⁷ relative), plus that through a second rounding (the router logits
        // after a bf16 norm too: an element of the normed row one ulp apart moves the logits by as much).
        const bool f32_out = c.dtype == DType::F32 || c.op == Op::kRouterLogits;
        const float bound_abs = f32_out ? 1e-5f * std::max(1.0f, scale) : 2.0f * 0.0079f * std::max(1.0f, scale);
        for (size_t i = 0; i < want.logits.size(); ++i) {
          ASSERT_FALSE(std::isnan(have.logits[i])) << c.name << " batch " << batch << " element " << i;
          ASSERT_LE(std::fabs(have.logits[i] - want.logits[i]), bound_abs)
              << c.name << " workers " << workers << (eager ? " eager" : " megakernel") << " batch " << batch << " element " << i << " (row "
              << static_cast<int64_t>(i) / want.vocab << ")";
        }
        // Same bodies on the same slices: the megakernel's and eager's bits agree.
        if (!eager) {
          megakernel_out.push_back(have.logits);
        } else {
          const std::vector<float>& mega = megakernel_out.at(b);
          ASSERT_EQ(0, std::memcmp(mega.data(), have.logits.data(), mega.size() * sizeof(float))) << c.name << " workers " << workers << " batch " << batch;
        }
        for (const SequenceStep& s : in.sequences) {
          cpu.reset_slot(s.slot);
          gpu.reset_slot(s.slot);
        }
      }
    }
    // A one-row plan runs kernels whose GEMV bodies carry the one-row pass alone (gemv_task's kCap);
    // the general kernels on a 3-row plan give the same row the same bits.
    cuda::CudaOptions options;
    options.act_dtype = c.dtype;
    options.num_slots = 13;
    options.max_context_tokens = 64;
    options.poison_arena = true;
    cuda::CudaBackend general(graph, weights, {lower_to_plan(graph, {PlanPhase::kDecode, 3, workers, 0, 0})}, options);
    StepInputs in;
    in.all_logits = true;
    in.token_ids = token_ids(1, workers + 1);
    in.sequences = {{0, 1}};
    const StepOutput have = general.step(in);
    const std::vector<float>& one_row = megakernel_out.at(0);
    ASSERT_EQ(have.logits.size(), one_row.size());
    EXPECT_EQ(0, std::memcmp(one_row.data(), have.logits.data(), one_row.size() * sizeof(float))) << c.name << " workers " << workers;
  }
}

std::vector<GemvCase> cases() {
  std::vector<GemvCase> all;
  for (Op op : {Op::kLinear, Op::kNormLinear, Op::kMultiLinear, Op::kNormMultiLinear, Op::kAddNormMultiLinear, Op::kLinearAdd, Op::kGateUpAct,
                Op::kActLinear, Op::kGatedNormLinear, Op::kLinearKdaGate}) {
    for (auto [hidden, out] : {std::pair<int64_t, int64_t>{64, 37}, {96, 257}, {130, 1}, {256, 96}}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        if (op == Op::kGatedNormLinear && hidden % 2 != 0) continue;
        all.push_back({std::string(op_name(op)) + "_" + std::to_string(hidden) + "x" + std::to_string(out) + "_" + std::string(dtype_name(dtype)), op, hidden,
                       out, dtype});
      }
    }
  }
  // Wide rows (2 KB) and tasks of ~200 KB at 3 workers: several rounds of kRowBatch loads a row, and
  // many rows a warp.
  for (Op op : {Op::kLinear, Op::kNormLinear, Op::kMultiLinear, Op::kNormMultiLinear, Op::kAddNormMultiLinear, Op::kLinearAdd, Op::kGateUpAct,
                Op::kActLinear, Op::kGatedNormLinear, Op::kLinearKdaGate}) {
    all.push_back({std::string(op_name(op)) + "_1024x300_bf16", op, 1024, 300, DType::BF16});
  }
  // Wide rows: 4,104 and 7,176 columns (K3's hidden plus 8; in bf16 513 and 897 16-byte chunks, one
  // past a multiple of a warp's 32), and 4,100 (not a multiple of 8: the scalar tail).
  for (Op op : {Op::kLinear, Op::kNormMultiLinear, Op::kGatedNormLinear, Op::kLinearAdd}) {
#ifdef PLOW_EMU_TEST
    const std::vector<int64_t> widths = {4104, 4100};  // the emulator's 7,176 cases took ~95 s and run 4,104's paths
#else
    const std::vector<int64_t> widths = {4104, 7176, 4100};
#endif
    for (int64_t hidden : widths) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        all.push_back({std::string(op_name(op)) + "_" + std::to_string(hidden) + "x45_" + std::string(dtype_name(dtype)), op, hidden, 45, dtype});
      }
    }
  }
  // Rows wider than shared memory (36,832 floats): staged in the block's global scratch (gemv.cuh
  // staging); gate_up_act's rows through lane_dot2.
  for (Op op : {Op::kLinear, Op::kNormLinear, Op::kGateUpAct}) {
    all.push_back({std::string(op_name(op)) + "_36880x9_bf16", op, 36880, 9, DType::BF16});
  }
  // Router logits (out = experts): odd expert counts and widths (unaligned rows take the scalar path),
  // the 48B shape (256 × 2304) and more experts than a block has warps; the same with the residual
  // sum's norm in the prologue.
  for (Op op : {Op::kRouterLogits, Op::kAddNormRouterLogits}) {
    for (auto [hidden, out] : {std::pair<int64_t, int64_t>{97, 61}, {130, 257}, {256, 8}, {2304, 256}}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        all.push_back({std::string(op_name(op)) + "_" + std::to_string(hidden) + "x" + std::to_string(out) + "_" + std::string(dtype_name(dtype)), op,
                       hidden, out, dtype});
      }
    }
  }
  // Routed experts (inter = out): bf16/f32 experts at odd sizes, MXFP4 experts (sizes multiples of 32:
  // rows of 2 to 33 blocks, so 1 to 16 lanes a row, lanes with fewer blocks than others).
  for (Op op : {Op::kMoeDown, Op::kMoeDownAdd}) {
    for (auto [hidden, out, mxfp4] :
         {std::tuple<int64_t, int64_t, bool>{96, 40, false}, {130, 64, false}, {64, 96, true}, {256, 64, true}, {1056, 160, true}}) {
      for (DType dtype : {DType::F32, DType::BF16}) {
        all.push_back({std::string(op_name(op)) + "_" + std::to_string(hidden) + "x" + std::to_string(out) + (mxfp4 ? "_mxfp4_" : "_") +
                           std::string(dtype_name(dtype)),
                       op, hidden, out, dtype, mxfp4});
      }
    }
  }
  // K3's MXFP4 experts: gate/up rows 3,584 wide (112 blocks: 32 lanes a row, half of them one block
  // short), down rows 384 wide (12 blocks: 4 lanes a row). ~40 s: the reference decodes every code.
  all.push_back({"moe_down_3584x384_mxfp4_BF16", Op::kMoeDown, 3584, 384, DType::BF16, true});
  // Inputs through views (x read in place at stride hidden + 13), every op of the family once per dtype;
  // moe_down_add also reads x as its residual.
  for (Op op : {Op::kLinear, Op::kNormLinear, Op::kMultiLinear, Op::kNormMultiLinear, Op::kAddNormMultiLinear, Op::kLinearAdd, Op::kGateUpAct,
                Op::kActLinear, Op::kGatedNormLinear, Op::kLinearKdaGate, Op::kRouterLogits, Op::kAddNormRouterLogits, Op::kMoeDownAdd}) {
    for (DType dtype : {DType::F32, DType::BF16}) {
      const int64_t out = op == Op::kMoeDownAdd ? 40 : 37;
      all.push_back({std::string(op_name(op)) + "_96x" + std::to_string(out) + "_view_" + std::string(dtype_name(dtype)), op, 96, out, dtype, false, true});
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaGemvTest, ::testing::ValuesIn(cases()), [](const auto& param_info) { return param_info.param.name; });

}  // namespace
}  // namespace plow
