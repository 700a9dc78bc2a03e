// KDA (spec/MODEL.md §4.2, §5, §6): causal short conv + SiLU over the conv window, the forget gate,
// and the gated delta rule — recurrent for single-token steps, chunked (C = 64) for longer ones.
#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

namespace {

constexpr int64_t kChunk = 64;

// Calls fn(slot, first_row, tokens) for each sequence of the step.
template <typename Fn>
void for_each_sequence(const OpContext& ctx, Fn fn) {
  int64_t row = 0;
  for (const SequenceStep& seq : ctx.step.sequences) {
    fn(seq.slot, row, seq.query_tokens);
    row += seq.query_tokens;
  }
}

float softplus(float z) { return z > 20.0f ? z : std::log(1.0f + std::exp(z)); }  // PyTorch's threshold, HF's form

}  // namespace

void cpu_short_conv_silu(OpContext& ctx) {
  const TensorView& conv = *ctx.weights[0]->parts[0];  // [P,1,K]
  const int64_t kernel = ctx.node.attrs.i("kernel"), keep = kernel - 1;
  for_each_sequence(ctx, [&](int slot, int64_t first, int64_t tokens) {
    std::vector<float>& window = ctx.state(slot);  // [P, K−1], oldest column first
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) {
      // history = window ++ this step's inputs for channel c
      std::vector<float> history(static_cast<size_t>(keep + tokens));
      for (int64_t j = 0; j < keep; ++j) history[static_cast<size_t>(j)] = window[static_cast<size_t>(c * keep + j)];
      for (int64_t t = 0; t < tokens; ++t) history[static_cast<size_t>(keep + t)] = ctx.in(0, first + t)[c];
      for (int64_t t = 0; t < tokens; ++t) {
        float sum = 0.0f;
        for (int64_t j = 0; j < kernel; ++j) sum += conv.at(static_cast<size_t>(c * kernel + j)) * history[static_cast<size_t>(t + j)];
        ctx.out_row(first + t)[c] = ctx.round_out(silu(sum));
      }
      for (int64_t j = 0; j < keep; ++j) window[static_cast<size_t>(c * keep + j)] = history[static_cast<size_t>(tokens + j)];
    }
  });
}

void cpu_kda_gate(OpContext& ctx) {
  const TensorView& a_log = *ctx.weights[0]->parts[0];
  const TensorView& dt_bias = *ctx.weights[1]->parts[0];
  const int64_t d = ctx.node.attrs.i("head_dim");
  const bool bounded = ctx.node.attrs.has("lower_bound");
  const float lower_bound = bounded ? ctx.node.attrs.f("lower_bound") : 0.0f;
  for (int64_t t = 0; t < ctx.rows; ++t) {
    const float* f = ctx.in(0, t);
    float* g = ctx.out_row(t);
    for (int64_t c = ctx.begin(); c < ctx.end(); ++c) {
      const float rate = std::exp(a_log.at(static_cast<size_t>(c / d)));
      const float z = f[c] + dt_bias.at(static_cast<size_t>(c));
      g[c] = bounded ? lower_bound * sigmoid(rate * z) : -rate * softplus(z);  // K3 gate lies in (lb, 0)
    }
  }
}

namespace {

// One head of one sequence, in fp32. q,k,v: [n, d] (q already l2-normalized and scaled, k normalized);
// g: [n, d] log-decay per key channel; beta: [n]; S: [d_k, d_v] updated in place; o: [n, d]. A task may own
// only the value columns [c0, c1) of a head (slice_granularity): each value column of S evolves on its
// own, so the functions below compute and store those columns alone, with the same arithmetic per column
// as a whole head.
struct HeadInputs {
  std::vector<float> q, k, v, g, beta;
};

void recurrent_head(const HeadInputs& in, int64_t n, int64_t d, int64_t c0, int64_t c1, float* S, std::vector<float>& o) {
  std::vector<float> error(static_cast<size_t>(d));
  for (int64_t t = 0; t < n; ++t) {
    const float* q = &in.q[static_cast<size_t>(t * d)];
    const float* k = &in.k[static_cast<size_t>(t * d)];
    const float* v = &in.v[static_cast<size_t>(t * d)];
    const float* g = &in.g[static_cast<size_t>(t * d)];
    for (int64_t j = 0; j < d; ++j) {
      const float decay = std::exp(g[j]);
      for (int64_t c = c0; c < c1; ++c) S[j * d + c] *= decay;
    }
    for (int64_t c = c0; c < c1; ++c) {
      float predicted = 0.0f;
      for (int64_t j = 0; j < d; ++j) predicted += S[j * d + c] * k[j];
      error[static_cast<size_t>(c)] = (v[c] - predicted) * in.beta[static_cast<size_t>(t)];
    }
    for (int64_t j = 0; j < d; ++j) {
      for (int64_t c = c0; c < c1; ++c) S[j * d + c] += k[j] * error[static_cast<size_t>(c)];
    }
    for (int64_t c = c0; c < c1; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < d; ++j) sum += S[j * d + c] * q[j];
      o[static_cast<size_t>(t * d + c)] = sum;
    }
  }
}

// spec/MODEL.md §6, one chunk of L ≤ 64 positions starting at `r0`. Pairwise decays are computed as
// exp(γ_r − γ_j), never factored, so the bounded K3 gate cannot overflow.
void chunk_head(const HeadInputs& in, int64_t r0, int64_t L, int64_t d, int64_t c0, int64_t c1, float* S, std::vector<float>& o) {
  auto at = [d](const std::vector<float>& m, int64_t r, int64_t c) { return m[static_cast<size_t>(r * d + c)]; };
  std::vector<float> gamma(static_cast<size_t>(L * d));
  for (int64_t c = 0; c < d; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < L; ++r) gamma[static_cast<size_t>(r * d + c)] = (sum += at(in.g, r0 + r, c));
  }
  auto decayed_dot = [&](const std::vector<float>& a, int64_t r, int64_t j) {  // Σ_c a_r[c] k_j[c] e^{γ_r−γ_j}
    float sum = 0.0f;
    for (int64_t c = 0; c < d; ++c) sum += at(a, r0 + r, c) * at(in.k, r0 + j, c) * std::exp(gamma[static_cast<size_t>(r * d + c)] - gamma[static_cast<size_t>(j * d + c)]);
    return sum;
  };
  // U = (I + A)⁻¹ · diag(β)(V − (K ⊙ e^γ) S₀), by forward substitution.
  std::vector<float> U(static_cast<size_t>(L * d));
  for (int64_t r = 0; r < L; ++r) {
    const float beta = in.beta[static_cast<size_t>(r0 + r)];
    for (int64_t c = c0; c < c1; ++c) {
      float predicted = 0.0f;
      for (int64_t j = 0; j < d; ++j) predicted += at(in.k, r0 + r, j) * std::exp(gamma[static_cast<size_t>(r * d + j)]) * S[j * d + c];
      U[static_cast<size_t>(r * d + c)] = beta * (at(in.v, r0 + r, c) - predicted);
    }
    for (int64_t j = 0; j < r; ++j) {
      const float a = beta * decayed_dot(in.k, r, j);
      for (int64_t c = c0; c < c1; ++c) U[static_cast<size_t>(r * d + c)] -= a * U[static_cast<size_t>(j * d + c)];
    }
  }
  // O = (Q ⊙ e^γ) S₀ + M·U
  for (int64_t r = 0; r < L; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < d; ++j) sum += at(in.q, r0 + r, j) * std::exp(gamma[static_cast<size_t>(r * d + j)]) * S[j * d + c];
      o[static_cast<size_t>((r0 + r) * d + c)] = sum;
    }
    for (int64_t j = 0; j <= r; ++j) {
      const float m = decayed_dot(in.q, r, j);
      for (int64_t c = c0; c < c1; ++c) o[static_cast<size_t>((r0 + r) * d + c)] += m * U[static_cast<size_t>(j * d + c)];
    }
  }
  // S_C = diag(e^{γ_L}) S₀ + Σ_j (k_j ⊙ e^{γ_L − γ_j}) ⊗ u_j
  const float* last = &gamma[static_cast<size_t>((L - 1) * d)];
  for (int64_t j = 0; j < d; ++j) {
    const float decay = std::exp(last[j]);
    for (int64_t c = c0; c < c1; ++c) S[j * d + c] *= decay;
  }
  for (int64_t r = 0; r < L; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      const float kj = at(in.k, r0 + r, j) * std::exp(last[j] - gamma[static_cast<size_t>(r * d + j)]);
      for (int64_t c = c0; c < c1; ++c) S[j * d + c] += kj * U[static_cast<size_t>(r * d + c)];
    }
  }
}

void l2_normalize(float* x, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float norm = std::sqrt(sum + 1e-6f);  // ε inside the root, on the SUM (MODEL.md §9.5)
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / norm * scale;
}

}  // namespace

void cpu_kda_delta_rule(OpContext& ctx) {
  const int64_t d = ctx.node.attrs.i("head_dim");
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(d));
  for_each_sequence(ctx, [&](int slot, int64_t first, int64_t n) {
    std::vector<float>& state = ctx.state(slot);  // [heads, d, d] fp32
    for (int64_t h = ctx.begin() / d; h * d < ctx.end(); ++h) {  // the heads the slice touches, and their columns in it
      const int64_t c0 = std::max(ctx.begin() - h * d, int64_t{0}), c1 = std::min(ctx.end() - h * d, d);
      HeadInputs in;
      for (auto* m : {&in.q, &in.k, &in.v, &in.g}) m->resize(static_cast<size_t>(n * d));
      in.beta.resize(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = 0; j < d; ++j) {
          const auto at = static_cast<size_t>(t * d + j);
          in.q[at] = ctx.in(0, first + t)[h * d + j];
          in.k[at] = ctx.in(1, first + t)[h * d + j];
          in.v[at] = ctx.in(2, first + t)[h * d + j];
          in.g[at] = ctx.in(3, first + t)[h * d + j];
        }
        in.beta[static_cast<size_t>(t)] = ctx.in(4, first + t)[h];
        l2_normalize(&in.q[static_cast<size_t>(t * d)], d, q_scale);
        l2_normalize(&in.k[static_cast<size_t>(t * d)], d, 1.0f);
      }
      float* S = state.data() + h * d * d;
      std::vector<float> o(static_cast<size_t>(n * d));
      if (n == 1) {
        recurrent_head(in, n, d, c0, c1, S, o);
      } else {
        for (int64_t r0 = 0; r0 < n; r0 += kChunk) chunk_head(in, r0, std::min(kChunk, n - r0), d, c0, c1, S, o);
      }
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = c0; c < c1; ++c) ctx.out_row(first + t)[h * d + c] = ctx.round_out(o[static_cast<size_t>(t * d + c)]);
      }
    }
  });
}

}  // namespace plow
