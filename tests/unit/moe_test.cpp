// Routed experts as two ops (moe_gate_up, moe_down) against an independent formulation: per token and
// per routed expert, the dense FFN kernels (linear, silu_mul / situ_mul, linear) on that expert's
// weights, summed over k in fp32 in order. Bit-equal in f32 and bf16; column slices that cut across
// experts equal the whole op; moe_down_add equals moe_down then add.
#include <gtest/gtest.h>

#include <fmt/format.h>

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

INSTANTIATE_TEST_SUITE_P(Cases, MoeSplit,
                         ::testing::Values(Case{DType::F32, false, 2}, Case{DType::BF16, false, 2}, Case{DType::BF16, true, 3},
                                           Case{DType::F32, true, 3}),
                         [](const ::testing::TestParamInfo<Case>& param) {
                           return fmt::format("{}_{}_top{}", dtype_name(param.param.act), param.param.situ ? "situ" : "silu", param.param.top_k);
                         });

}  // namespace
}  // namespace plow
