// Routed experts as two ops (moe_gate_up, moe_down) against an independent formulation: per token and
// per routed expert, the dense FFN kernels (linear, silu_mul / situ_mul, linear) on that expert's
// weights, summed over k in fp32 in order. Bit-equal in f32 and bf16; column slices that cut across
// experts equal the whole op; moe_down_add equals moe_down then add. The router's two ops
// (router_logits, moe_topk) against plain loops and a sort.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "graph/random_weights.h"
#include "runtime/cpu/op_context.h"

namespace plow {
namespace {

constexpr int64_t kRows = 3, kExperts = 5, kWidth = 13, kInter = 7;

struct Case {
  DType act;
  bool situ;
  int64_t top_k;
};

class MoeSplit : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case c = GetParam();
    x_ = graph_.add(Op::kInput, {}, {}, {{"width", kWidth}, {"input", 0}}, "x");
    routes_ = graph_.add(Op::kInput, {}, {}, {{"width", 2.0 * static_cast<double>(c.top_k)}, {"input", 1}}, "routes");
    int stacks[3];
    for (int j = 0; j < 3; ++j) {  // w1, w3 [I,W]; w2 [W,I]
      WeightDecl decl;
      for (int64_t e = 0; e < kExperts; ++e) decl.parts.push_back(fmt::format("moe.experts.{}.{}.weight", e, j == 0 ? "w1" : j == 1 ? "w3" : "w2"));
      decl.name = decl.parts.front();
      decl.shape = j == 2 ? std::vector<int64_t>{kWidth, kInter} : std::vector<int64_t>{kInter, kWidth};
      stacks[j] = graph_.add_weight(std::move(decl));
    }
    gate_up_attrs_ = {{"situ", c.situ ? 1.0 : 0.0}, {"beta", 4.0}, {"linear_beta", 25.0}, {"experts", kExperts}, {"top_k", static_cast<double>(c.top_k)}};
    gate_up_ = graph_.add(Op::kMoeGateUp, {x_, routes_}, {stacks[0], stacks[1]}, gate_up_attrs_, "gate_up");
    down_ = graph_.add(Op::kMoeDown, {gate_up_, routes_}, {stacks[2]}, {{"experts", kExperts}, {"top_k", static_cast<double>(c.top_k)}}, "down");
    graph_.set_output(down_);
    checkpoint_ = std::make_unique<Checkpoint>(random_checkpoint(graph_, 11, c.act, "moe test"));
    weights_ = std::make_unique<BoundWeights>(graph_, *checkpoint_);

    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < kRows * kWidth; ++i) x_values_.push_back(round_to(c.act, normal(rng)));
    for (int64_t t = 0; t < kRows; ++t) {  // distinct experts per row, a different set each row
      for (int64_t k = 0; k < c.top_k; ++k) route_values_.push_back(0.3f + 0.7f * static_cast<float>(k + t) / 3.0f);
      for (int64_t k = 0; k < c.top_k; ++k) route_values_.push_back(static_cast<float>((4 - k + 2 * t) % kExperts));
    }
  }

  // Runs `op` (columns [begin, end)) on `inputs` into `out` [rows, width].
  void run(Op op, const Attrs& attrs, int64_t width, std::vector<Activation> inputs, std::vector<const BoundWeight*> weights,
           std::vector<float>& out, int64_t rows, int64_t begin = 0, int64_t end = -1) const {
    Node node;
    node.op = op;
    node.attrs = attrs;
    node.width = width;
    node.dtype = OutDType::kAct;
    out.resize(static_cast<size_t>(rows * width));
    StepInputs step;
    OpContext ctx{node, inputs, weights, out.data(), rows, GetParam().act, step, {}, begin, end};
    cpu_kernel(op)(ctx);
  }

  std::vector<float> gate_up(int64_t begin = 0, int64_t end = -1) const {
    const int64_t k = GetParam().top_k;
    std::vector<float> acts;
    run(Op::kMoeGateUp, gate_up_attrs_, k * kInter, {{x_values_.data(), kWidth}, {route_values_.data(), 2 * k}},
        {&(*weights_)[0], &(*weights_)[1]}, acts, kRows, begin, end);
    return acts;
  }

  std::vector<float> down(const std::vector<float>& acts, int64_t begin = 0, int64_t end = -1) const {
    const int64_t k = GetParam().top_k;
    std::vector<float> out;
    run(Op::kMoeDown, graph_.node(down_).attrs, kWidth, {{acts.data(), k * kInter}, {route_values_.data(), 2 * k}}, {&(*weights_)[2]}, out,
        kRows, begin, end);
    return out;
  }

  // Columns [begin, end) of each row of `from` into `into` (both [kRows, width]).
  static void copy_columns(const std::vector<float>& from, std::vector<float>& into, int64_t width, int64_t begin, int64_t end) {
    for (int64_t t = 0; t < kRows; ++t) {
      for (int64_t col = begin; col < end; ++col) into[static_cast<size_t>(t * width + col)] = from[static_cast<size_t>(t * width + col)];
    }
  }

  Graph graph_;
  int x_ = 0, routes_ = 0, gate_up_ = 0, down_ = 0;
  Attrs gate_up_attrs_;
  std::unique_ptr<Checkpoint> checkpoint_;
  std::unique_ptr<BoundWeights> weights_;
  std::vector<float> x_values_, route_values_;
};

TEST_P(MoeSplit, EqualsDenseFfnPerRoutedExpert) {
  const Case c = GetParam();
  const std::vector<float> got = down(gate_up());
  for (int64_t t = 0; t < kRows; ++t) {
    const float* route = route_values_.data() + t * 2 * c.top_k;
    std::vector<float> acc(kWidth, 0.0f);
    for (int64_t k = 0; k < c.top_k; ++k) {
      const auto e = static_cast<size_t>(route[c.top_k + k]);
      const BoundWeight w1{nullptr, {(*weights_)[0].parts[e]}}, w3{nullptr, {(*weights_)[1].parts[e]}}, w2{nullptr, {(*weights_)[2].parts[e]}};
      const Activation x{x_values_.data() + t * kWidth, kWidth};
      std::vector<float> gate, up, act, down;
      run(Op::kLinear, {}, kInter, {x}, {&w1}, gate, 1);
      run(Op::kLinear, {}, kInter, {x}, {&w3}, up, 1);
      run(c.situ ? Op::kSituMul : Op::kSiluMul, gate_up_attrs_, kInter, {{gate.data(), kInter}, {up.data(), kInter}}, {}, act, 1);
      run(Op::kLinear, {}, kWidth, {{act.data(), kInter}}, {&w2}, down, 1);
      for (int64_t o = 0; o < kWidth; ++o) acc[static_cast<size_t>(o)] += route[k] * down[static_cast<size_t>(o)];
    }
    for (int64_t o = 0; o < kWidth; ++o) {
      const float want = round_to(c.act, acc[static_cast<size_t>(o)]), have = got[static_cast<size_t>(t * kWidth + o)];
      EXPECT_EQ(std::memcmp(&want, &have, sizeof want), 0) << "row " << t << " column " << o << ": " << have << " vs " << want;
    }
  }
}

TEST_P(MoeSplit, SlicesAcrossExpertsEqualTheWholeOp) {
  constexpr int64_t kSlice = 5;  // slices of 5 straddle the expert boundaries at multiples of kInter = 7
  const int64_t width = GetParam().top_k * kInter;
  const std::vector<float> acts = gate_up(), out = down(acts);
  std::vector<float> acts_sliced(acts.size(), -1.0f), out_sliced(out.size(), -1.0f);
  for (int64_t begin = 0; begin < width; begin += kSlice) copy_columns(gate_up(begin, std::min(begin + kSlice, width)), acts_sliced, width, begin, std::min(begin + kSlice, width));
  for (int64_t begin = 0; begin < kWidth; begin += kSlice) copy_columns(down(acts, begin, std::min(begin + kSlice, kWidth)), out_sliced, kWidth, begin, std::min(begin + kSlice, kWidth));
  EXPECT_EQ(acts_sliced, acts);
  EXPECT_EQ(out_sliced, out);
  EXPECT_NE(acts, std::vector<float>(acts.size(), 0.0f));
}

// The fused op is never extracted on the model graphs (the shared expert's linear_add takes the
// add), so its column slices are checked here: moe_down_add = moe_down, then add, bit for bit.
TEST_P(MoeSplit, DownAddSlicesEqualDownThenAdd) {
  const int64_t k = GetParam().top_k;
  const std::vector<float> acts = gate_up(), routed = down(acts);
  std::vector<float> shared(routed.size()), want, fused(routed.size(), -1.0f);
  for (size_t i = 0; i < shared.size(); ++i) shared[i] = round_to(GetParam().act, 0.37f * static_cast<float>(i % 11) - 1.5f);
  run(Op::kAdd, {}, kWidth, {{routed.data(), kWidth}, {shared.data(), kWidth}}, {}, want, kRows);
  for (int64_t begin = 0; begin < kWidth; begin += 4) {
    std::vector<float> part;
    run(Op::kMoeDownAdd, graph_.node(down_).attrs, kWidth, {{acts.data(), k * kInter}, {route_values_.data(), 2 * k}, {shared.data(), kWidth}},
        {&(*weights_)[2]}, part, kRows, begin, std::min(begin + 4, kWidth));
    copy_columns(part, fused, kWidth, begin, std::min(begin + 4, kWidth));
  }
  EXPECT_EQ(fused, want);
}

// The router as two ops (R1, then R2–R7). router_logits: in a bf16 run the logits are the fp32 dots of
// the upcast operands, never rounded to bf16, and column slices equal the whole op. moe_topk on them:
// select by σ(ℓ) + bias (stable order: ties to the lower id), weight by the unbiased σ(ℓ), renormalize,
// then scale — checked against a plain sort of the same formulas.
TEST(MoeRouter, LogitsStayFp32AndTopKSelectsWithTheBias) {
  constexpr int64_t kHidden = 13, kNumExperts = 7, kTopK = 3;
  Graph graph;
  const int x = graph.add(Op::kInput, {}, {}, {{"width", kHidden}, {"input", 0}}, "x");
  const int gate = graph.add_weight({"moe.gate.weight", {"moe.gate.weight"}, {kNumExperts, kHidden}, false});
  const int bias = graph.add_weight({"moe.gate.e_score_correction_bias", {"moe.gate.e_score_correction_bias"}, {kNumExperts}, false});
  const int logits = graph.add(Op::kRouterLogits, {x}, {gate}, {}, "logits");
  const int routes = graph.add(Op::kMoeTopK, {logits}, {bias},
                               {{"experts", kNumExperts}, {"top_k", kTopK}, {"groups", 1}, {"topk_groups", 1}, {"renormalize", 1}, {"scale", 2.5}, {"softmax", 0}},
                               "routes");
  graph.set_output(routes);
  const Checkpoint checkpoint = random_checkpoint(graph, 3, DType::BF16, "router test");
  const BoundWeights weights(graph, checkpoint);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs;
  for (int64_t i = 0; i < kRows * kHidden; ++i) xs.push_back(round_to(DType::BF16, normal(rng)));
  const StepInputs step;
  auto run = [&](int id, const float* in, int64_t in_width, std::vector<float>& out, int64_t begin, int64_t end) {
    const Node& node = graph.node(id);
    out.resize(static_cast<size_t>(kRows * node.width), -1.0f);
    const Activation input{in, in_width};
    const BoundWeight* weight = &weights[node.weights[0]];
    OpContext ctx{node, {&input, 1}, {&weight, 1}, out.data(), kRows, DType::BF16, step, {}, begin, end};
    cpu_kernel(node.op)(ctx);
  };
  std::vector<float> whole, sliced, chosen;
  run(logits, xs.data(), kHidden, whole, 0, -1);
  for (int64_t begin = 0; begin < kNumExperts; begin += 3) run(logits, xs.data(), kHidden, sliced, begin, std::min(begin + 3, kNumExperts));
  EXPECT_EQ(sliced, whole);
  const TensorView& w = *weights[gate].parts[0];
  int unrounded = 0;
  for (int64_t t = 0; t < kRows; ++t) {
    for (int64_t e = 0; e < kNumExperts; ++e) {
      float dot = 0.0f;
      for (int64_t i = 0; i < kHidden; ++i) dot += w.at(static_cast<size_t>(e * kHidden + i)) * xs[static_cast<size_t>(t * kHidden + i)];
      const float have = whole[static_cast<size_t>(t * kNumExperts + e)];
      EXPECT_EQ(std::memcmp(&have, &dot, sizeof dot), 0) << "row " << t << " expert " << e;
      unrounded += round_to(DType::BF16, have) != have;
    }
  }
  EXPECT_GT(unrounded, 0) << "every logit is a bf16 value: the case cannot tell rounded from unrounded";
  run(routes, whole.data(), kNumExperts, chosen, 0, -1);
  const TensorView& b = *weights[bias].parts[0];
  for (int64_t t = 0; t < kRows; ++t) {
    std::vector<float> score(kNumExperts);
    std::vector<int64_t> order(kNumExperts);
    for (int64_t e = 0; e < kNumExperts; ++e) {
      score[static_cast<size_t>(e)] = 1.0f / (1.0f + std::exp(-whole[static_cast<size_t>(t * kNumExperts + e)]));
      order[static_cast<size_t>(e)] = e;
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) {
      return score[static_cast<size_t>(p)] + b.at(static_cast<size_t>(p)) > score[static_cast<size_t>(q)] + b.at(static_cast<size_t>(q));
    });
    float total = 0.0f;
    for (int64_t k = 0; k < kTopK; ++k) total += score[static_cast<size_t>(order[static_cast<size_t>(k)])];
    const float* row = chosen.data() + t * 2 * kTopK;
    for (int64_t k = 0; k < kTopK; ++k) {
      EXPECT_EQ(row[kTopK + k], static_cast<float>(order[static_cast<size_t>(k)])) << "row " << t << " rank " << k;
      EXPECT_EQ(row[k], score[static_cast<size_t>(order[static_cast<size_t>(k)])] / (total + 1e-20f) * 2.5f) << "row " << t << " rank " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeSplit,
                         ::testing::Values(Case{DType::F32, false, 2}, Case{DType::BF16, false, 2}, Case{DType::BF16, true, 3},
                                           Case{DType::F32, true, 3}),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           return fmt::format("{}_{}_top{}", dtype_name(param.param.act), param.param.situ ? "situ" : "silu", param.param.top_k);
                         });

}  // namespace
}  // namespace plow
