// Chunked KDA (spec/MODEL.md §6) against the recurrent definition (K6), including gates strong enough
// that a factored exp(γ_r)·exp(−γ_j) would overflow, and prefill split at arbitrary points.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "graph/op_table.h"
#include "runtime/cpu/op_context.h"

namespace plow {
namespace {

constexpr int64_t kHeads = 2, kDim = 16, kWidth = kHeads * kDim;

struct Inputs {
  std::vector<float> q, k, v, g, beta;  // [n, P] except beta [n, heads]
};

Inputs random_inputs(int64_t n, float gate_scale, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  Inputs in;
  for (int64_t i = 0; i < n * kWidth; ++i) {
    in.q.push_back(normal(rng));
    in.k.push_back(normal(rng));
    in.v.push_back(normal(rng));
    in.g.push_back(-gate_scale * uniform(rng));  // log-decay ≤ 0
  }
  for (int64_t i = 0; i < n * kHeads; ++i) in.beta.push_back(uniform(rng));
  return in;
}

// Runs the op over rows [begin, begin+count) of `in` as one step of one sequence, for output columns
// [col_begin, col_end) (−1: all).
void run_step(const Inputs& in, int64_t begin, int64_t count, SlotState& slot, std::vector<float>& out, int64_t col_begin = 0,
              int64_t col_end = -1) {
  Node node;
  node.op = Op::kKdaDeltaRule;
  node.attrs = {{"heads", kHeads}, {"head_dim", kDim}};
  node.state = 0;
  node.width = kWidth;
  node.dtype = OutDType::kAct;
  const Activation args[5] = {{in.q.data() + begin * kWidth, kWidth}, {in.k.data() + begin * kWidth, kWidth},
                              {in.v.data() + begin * kWidth, kWidth}, {in.g.data() + begin * kWidth, kWidth},
                              {in.beta.data() + begin * kHeads, kHeads}};
  StepInputs step;
  step.token_ids.assign(static_cast<size_t>(count), 0);
  step.sequences = {{0, count}};
  std::span<SlotState> slots(&slot, 1);
  OpContext ctx{node, args, {}, out.data() + begin * kWidth, count, DType::F32, step, slots};
  ctx.col_begin = col_begin;
  ctx.col_end = col_end;
  cpu_kda_delta_rule(ctx);
}

SlotState fresh_slot() {
  SlotState slot;
  slot.buffers.assign(1, std::vector<float>(static_cast<size_t>(kHeads * kDim * kDim), 0.0f));
  return slot;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

class KdaChunkedVsRecurrent : public ::testing::TestWithParam<float> {};

TEST_P(KdaChunkedVsRecurrent, AgreesWithTokenByToken) {
  const int64_t n = 150;  // two full chunks and a partial one
  const Inputs in = random_inputs(n, GetParam(), 7);
  std::vector<float> recurrent(static_cast<size_t>(n * kWidth)), chunked(recurrent.size()), split(recurrent.size());
  SlotState a = fresh_slot(), b = fresh_slot(), c = fresh_slot();
  for (int64_t t = 0; t < n; ++t) run_step(in, t, 1, a, recurrent);
  run_step(in, 0, n, b, chunked);
  run_step(in, 0, 33, c, split);   // split prefill: 33 + 80 + 37, chunk boundaries move with the split
  run_step(in, 33, 80, c, split);
  run_step(in, 113, 37, c, split);
  const float out_error = max_abs_diff(recurrent, chunked);
  const float state_error = max_abs_diff(a.buffers[0], b.buffers[0]);
  const float split_error = max_abs_diff(chunked, split);
  std::printf("gate scale %.1f: |chunked − recurrent| out %.2e state %.2e, |split − whole| %.2e\n", GetParam(), out_error,
              state_error, split_error);
  EXPECT_LT(out_error, 2e-5f);
  EXPECT_LT(state_error, 2e-5f);
  EXPECT_LT(split_error, 2e-5f);
}

// 0.05: slow decay (state accumulates over many tokens); 5: K3's bounded gate range (−5, 0), where
// γ reaches about −160 in a chunk; 60: strong Kimi-Linear decays (γ ≈ −2000, far past exp overflow).
INSTANTIATE_TEST_SUITE_P(GateScales, KdaChunkedVsRecurrent, ::testing::Values(0.05f, 5.0f, 60.0f));

// The plan's unit for the op: gcd(head dim, 32) columns, so the 48B shape (32 heads of 128) gives 128
// tasks on an H200's 132 workers instead of 32.
TEST(KdaColumnSlices, UnitIsAGroupOfValueColumns) {
  for (const auto& [d, unit] : {std::pair<int64_t, int64_t>{128, 32}, {64, 32}, {32, 32}, {24, 8}, {16, 16}}) {
    Node node;
    node.op = Op::kKdaDeltaRule;
    node.attrs = {{"heads", 4}, {"head_dim", d}};
    node.width = 4 * d;
    EXPECT_EQ(slice_granularity(node), unit) << "head dim " << d;
  }
}

// Plans slice the op by groups of value columns inside a head (slice_granularity): each column of the
// state evolves on its own, so slices that cut heads anywhere give the whole op's outputs and state bit
// for bit, token by token and chunked.
TEST(KdaColumnSlices, MatchTheWholeOpBitForBit) {
  const Inputs in = random_inputs(90, 5.0f, 11);  // a chunk and 26
  const std::vector<std::pair<int64_t, int64_t>> slices = {{0, 5}, {5, 16}, {16, 19}, {19, kWidth}};  // cut inside both heads
  for (const int64_t tokens : {int64_t{1}, int64_t{90}}) {
    std::vector<float> whole(static_cast<size_t>(tokens * kWidth), NAN), sliced(whole.size(), NAN);
    SlotState a = fresh_slot(), b = fresh_slot();
    run_step(in, 0, tokens, a, whole);
    for (const auto& [begin, end] : slices) run_step(in, 0, tokens, b, sliced, begin, end);
    EXPECT_EQ(std::memcmp(whole.data(), sliced.data(), whole.size() * sizeof(float)), 0) << tokens << " tokens: outputs";
    EXPECT_EQ(a.buffers[0], b.buffers[0]) << tokens << " tokens: state";
  }
}

}  // namespace
}  // namespace plow
