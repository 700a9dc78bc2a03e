// Weight-streaming op bodies: x·Wᵀ and its fused forms (norm / activation / gated norm in
// the prologue, residual add or gate·up activation in the epilogue), the router logits and the routed
// experts.
// Shape of the work: a task owns output columns [col_begin, col_end); one warp per column streams that
// weight row with 16-byte non-allocating loads (kRowBatch in flight per lane) against up to kMaxGroup
// token rows staged in shared memory (fp32, already rounded as the CPU rounds them), fp32 accumulate,
// one warp reduction per (column, token). Rounding points are those of src/runtime/cpu/ops.
#pragma once

#include "graph/op_table.h"
#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/gemv_dot.cuh"
#include "runtime/cuda/ops/norm.cuh"

namespace plow::cuda {

// Shared memory past the staged rows that prologues reduce in (block_sum's 32 floats).
inline constexpr int kStageRedFloats = 32;
__device__ __forceinline__ float* stage_red(const TaskCtx& ctx) { return reinterpret_cast<float*>(smem_bytes(ctx) + kSharedBytes) - kStageRedFloats; }

// The staging buffer for `n`-wide token rows, with `extra` floats after the staged rows: shared
// memory when a group of at least one row fits there (before stage_red's floats), else the block's
// global scratch. Returns the rows per group; 0 when not even one row and the extra fit the scratch.
__device__ __forceinline__ float* staging(const TaskCtx& ctx, int n, int& ld, int& group, int64_t extra = 0) {
  ld = (n + 3) & ~3;
  const int64_t in_smem = kSharedBytes / static_cast<int64_t>(sizeof(float)) - kStageRedFloats;
  const bool smem = ld + extra <= in_smem;
  const int64_t usable = ((smem ? in_smem : kScratchFloats) - extra) / ld;
  group = usable >= 8 ? 8 : usable >= 4 ? 4 : usable >= 2 ? 2 : usable >= 1 ? 1 : 0;  // a power of two: padded rows fit
  return smem ? reinterpret_cast<float*>(ctx.smem) : ctx.scratch;
}

// A weight row an output column reads: weight index, part (expert) and row.
struct RowRef {
  int weight;
  int64_t part;
  int64_t row;
};

// Two rows a column reads (NDOT = 2: gate and up) streamed together by lane_dot2 into acc (zeroed),
// when both are half-precision rows it can stream; false (nothing done) otherwise.
template <int NDOT, int G, class Ref>
__device__ __forceinline__ bool dot_pair(const TaskCtx& ctx, Ref ref, int64_t c, int t, const float* xs, int ld, int n, float (&acc)[NDOT][G]) {
  if constexpr (NDOT != 2) {
    return false;
  } else {
    const RowRef ra = ref(0, c, t), rb = ref(1, c, t);
    const DeviceWeight &wa = ctx.op->weights[ra.weight], &wb = ctx.op->weights[rb.weight];
    const uint8_t* a = half_row(wa, ra.part, ra.row, xs, n);
    const uint8_t* b = half_row(wb, rb.part, rb.row, xs, n);
    if (a == nullptr || b == nullptr || wa.type != wb.type) return false;
    lane_dot2<G>(wa.type, a, xs, b, xs, ld, n, acc[0], acc[1]);
    return true;
  }
}

// Lane sums of a group of `lanes` aligned lanes (a power of two) to every lane of the group.
__device__ __forceinline__ float lanes_sum(float v, int lanes) {
  for (int o = lanes >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Whether staging() put the token rows `xs` in shared memory. The MXFP4 passes then read them through
// smem_floats(ctx), a pointer ptxas knows to be shared: LDS instead of generic loads (8 a 16-byte block
// of codes, which queued with the codes' global loads: ncu had K3's moe_gate_up at 1.1 cycles of
// lg_throttle an instruction); rows staged in the global scratch take lane_dot's MXFP4 path.
__device__ __forceinline__ bool staged_in_smem(const TaskCtx& ctx, const float* xs) { return xs == reinterpret_cast<const float*>(ctx.smem); }

// Whether the NDOT rows the op's columns read are MXFP4 (routed experts), n a whole number of blocks.
template <int NDOT, class Ref>
__device__ __forceinline__ bool mx_rows(const TaskCtx& ctx, Ref ref, int t, int n) {
  bool all = n % 32 == 0;
#pragma unroll
  for (int j = 0; j < NDOT; ++j) all = all && ctx.op->weights[ref(j, ctx.col_begin, t).weight].type == kWMXFP4;
  return all;
}

// gemv_pass's per-token form over MXFP4 rows: groups of mx_row_lanes(n / 32) lanes each take a column's
// NDOT rows at once (gate and up), a warp as many columns as it has groups; one round of loads a column
// where K3's latent-wide rows (3,584 columns, 112 blocks) take the whole warp.
template <int NDOT, class Ref, class Epi>
__device__ __forceinline__ void gemv_pass_mx(const TaskCtx& ctx, const float* xs, int ld, int n, int t0, int count, Ref ref, Epi epi) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int blocks = n / 32, lanes = mx_row_lanes(blocks), groups = 32 / lanes, grp = lane / lanes, sub = lane % lanes;
  for (int g = 0; g < count; ++g) {
    const int t = t0 + g;
    for (int64_t c0 = ctx.col_begin + static_cast<int64_t>(warp) * groups; c0 < ctx.col_end; c0 += static_cast<int64_t>(kWarps) * groups) {
      const int64_t c = c0 + grp;
      const bool live = c < ctx.col_end;
      MxRow rows[NDOT];
      float acc[NDOT];
#pragma unroll
      for (int j = 0; j < NDOT; ++j) {
        const RowRef r = ref(j, live ? c : c0, t);
        rows[j] = mx_row(ctx.op->weights[r.weight], r.part, r.row, xs + g * ld);
        acc[j] = 0.0f;
      }
      mx_lane_dots<NDOT>(rows, live ? blocks : 0, sub, lanes, acc);
#pragma unroll
      for (int j = 0; j < NDOT; ++j) acc[j] = lanes_sum(acc[j], lanes);
      if (live && sub == 0) epi(t, c, acc);
    }
  }
}

// The driver: for token groups of the step, stage(xs, ld, t0, count) fills the staged rows (all
// threads; rows ≥ count are zero), then for each column c of the slice (one warp each) and each of
// NDOT weight rows ref(j, c, t) the warp computes the dots; epi(t, c, dots) writes (lane 0).
// PER_TOKEN: the rows depend on the token (routed experts) — one token per pass.
template <int NDOT, int G, bool PER_TOKEN, class Ref, class Epi>
__device__ __forceinline__ void gemv_pass(const TaskCtx& ctx, const float* xs, int ld, int n, int t0, int count, Ref ref, Epi epi) {
  if constexpr (PER_TOKEN) {
    if (mx_rows<NDOT>(ctx, ref, t0, n) && staged_in_smem(ctx, xs)) {
      gemv_pass_mx<NDOT>(ctx, smem_floats(ctx), ld, n, t0, count, ref, epi);
      return;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t c = ctx.col_begin + warp; c < ctx.col_end; c += kWarps) {
    float acc[NDOT][G];
#pragma unroll
    for (int j = 0; j < NDOT; ++j) {
#pragma unroll
      for (int g = 0; g < G; ++g) acc[j][g] = 0.0f;
    }
    if constexpr (PER_TOKEN) {
      for (int g = 0; g < count; ++g) {
#pragma unroll
        for (int j = 0; j < NDOT; ++j) acc[j][0] = 0.0f;
        if (!dot_pair<NDOT, 1>(ctx, ref, c, t0 + g, xs + g * ld, ld, n, acc)) {
#pragma unroll
          for (int j = 0; j < NDOT; ++j) {
            const RowRef r = ref(j, c, t0 + g);
            float one[1] = {0.0f};
            lane_dot<1>(ctx.op->weights[r.weight], r.part, r.row, xs + g * ld, ld, n, one);
            acc[j][0] = one[0];
          }
        }
#pragma unroll
        for (int j = 0; j < NDOT; ++j) acc[j][0] = warp_sum(acc[j][0]);
        if (lane == 0) {
          float dots[NDOT];
#pragma unroll
          for (int j = 0; j < NDOT; ++j) dots[j] = acc[j][0];
          epi(t0 + g, c, dots);
        }
      }
    } else {
      if (!dot_pair<NDOT, G>(ctx, ref, c, t0, xs, ld, n, acc)) {
#pragma unroll
        for (int j = 0; j < NDOT; ++j) {
          const RowRef r = ref(j, c, t0);
          lane_dot<G>(ctx.op->weights[r.weight], r.part, r.row, xs, ld, n, acc[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < NDOT; ++j) {
#pragma unroll
        for (int g = 0; g < G; ++g) acc[j][g] = warp_sum(acc[j][g]);
      }
      if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < count) {
            float dots[NDOT];
#pragma unroll
            for (int j = 0; j < NDOT; ++j) dots[j] = acc[j][g];
            epi(t0 + g, c, dots);
          }
        }
      }
    }
  }
}

// kCap: the most token rows a pass serves, kMaxGroup or 1. The kernels of one-row plans (batch-1
// decode) instantiate their bodies with 1: they then carry the one-row pass alone, not beside it the
// passes of 2, 4 and 8 rows that such a plan never takes (a body was 14–35 K SASS instructions, of which
// a task ran ~2 K, scattered: ncu had instruction fetch at ~45% of a small GEMV task's stalls).
template <int NDOT, bool PER_TOKEN, int kCap = kMaxGroup, class Stage, class Ref, class Epi>
__device__ __forceinline__ void gemv_task(const TaskCtx& ctx, int n, Stage stage, Ref ref, Epi epi) {
  static_assert(kCap == 1 || kCap == kMaxGroup, "a pass serves 1 or kMaxGroup rows");
  int ld = 0, group = 0;
  float* xs = staging(ctx, n, ld, group);
  if (group == 0) {  // a row wider than the block's scratch
    if (threadIdx.x == 0) report_error(ctx, kErrWorkspace);
    return;
  }
  if (kCap == 1) group = 1;
  const int rows = ctx.rows();
  for (int t0 = 0; t0 < rows; t0 += group) {
    const int count = rows - t0 < group ? rows - t0 : group;
    __syncthreads();  // the previous group's readers are done with xs
    stage(xs, ld, t0, count);
    __syncthreads();
    if (PER_TOKEN || kCap == 1 || count == 1) {
      gemv_pass<NDOT, 1, PER_TOKEN>(ctx, xs, ld, n, t0, count, ref, epi);
    } else if (count == 2) {
      gemv_pass<NDOT, 2, false>(ctx, xs, ld, n, t0, count, ref, epi);
    } else if (count <= 4) {
      gemv_pass<NDOT, 4, false>(ctx, xs, ld, n, t0, count, ref, epi);
    } else {
      gemv_pass<NDOT, kMaxGroup, false>(ctx, xs, ld, n, t0, count, ref, epi);
    }
  }
}

// ---- staging (prologues) --------------------------------------------------------------------------

// Rows [t0, t0+count) of input `i`, zero rows up to `pad_to` and zero columns up to ld; kLoadBatch
// loads a thread in flight (one at a time, a 2,304-wide row waited five L2 latencies a task).
__device__ __forceinline__ void stage_rows(const TaskCtx& ctx, int i, float* xs, int ld, int t0, int count, int pad_to) {
  const int n = static_cast<int>(ctx.in_width(i));
  const Rows<const float> x = ctx.in_rows(i);
  for_each_element(
      0, pad_to, 0, ld, [&](int g, int64_t k) { return g < count && k < n ? x[t0 + g][k] : 0.0f; },
      [&](int g, int64_t k, float v) { xs[g * ld + k] = v; });
}

__device__ __forceinline__ int padded(int count) { return count == 1 ? 1 : count == 2 ? 2 : count <= 4 ? 4 : kMaxGroup; }

// RMSNorm (HF: cast back before the weight multiply) of the staged rows in place: x = round(w ⊙
// round(x · rsqrt(mean x² + ε))), the whole block on one row at a time, reduced as op_rms_norm reduces
// a decode step's rows (few rows: the block; the same sums). One warp a row waited an L2 latency per 32
// elements: ~30 µs a task at 2,304 wide, half of a decode step's norm_multi_linear.
__device__ __forceinline__ void norm_staged_rows(const TaskCtx& ctx, const DeviceWeight nw, float eps, float* xs, int ld, int n, int count) {
  const int32_t act = ctx.op->act;
  float* red = stage_red(ctx);
  const int first = static_cast<int>(threadIdx.x);
  for (int g = 0; g < count; ++g) {
    float* x = xs + g * ld;
    const float total = block_sum(strided_sum(first, n, kThreads, [&](int64_t k) { return x[k]; }, [](float sum, float v) { return sum + v * v; }), red);
    const float inv = inv_rms(total, n, eps);
    for_each_strided(
        first, n, kThreads, [&](int64_t k) { return Operands{x[k], weight_flat(nw, k)}; },
        [&](int64_t k, Operands v) { x[k] = round_act(act, v.b * round_act(act, v.a * inv)); });
  }
}

// rms_norm of input 0's rows [t0, t0+count) into the staged rows.
__device__ __forceinline__ void stage_rms_norm(const TaskCtx& ctx, const DeviceWeight nw, float eps, float* xs, int ld, int t0, int count) {
  stage_rows(ctx, 0, xs, ld, t0, count, padded(count));
  __syncthreads();
  norm_staged_rows(ctx, nw, eps, xs, ld, static_cast<int>(ctx.in_width(0)), count);
}

// rms_norm(a + b) of inputs 0 and 1's rows [t0, t0+count) into the staged rows, the sum rounded as
// op_add rounds it: the norm of a residual sum read directly, without waiting for an add_norm's tasks.
__device__ __forceinline__ void stage_add_rms_norm(const TaskCtx& ctx, const DeviceWeight nw, float eps, float* xs, int ld, int t0, int count) {
  const int n = static_cast<int>(ctx.in_width(0));
  const int32_t act = ctx.op->act;
  const Rows<const float> a = ctx.in_rows(0), b = ctx.in_rows(1);
  for_each_element(
      0, padded(count), 0, ld,
      [&](int g, int64_t k) { return g < count && k < n ? Operands{a[t0 + g][k], b[t0 + g][k]} : Operands{0.0f, 0.0f}; },
      [&](int g, int64_t k, Operands v) { xs[g * ld + k] = g < count && k < n ? round_act(act, v.a + v.b) : 0.0f; });
  __syncthreads();
  norm_staged_rows(ctx, nw, eps, xs, ld, n, count);
}

// ---- op bodies --------------------------------------------------------------------------------------

__device__ __forceinline__ auto plain_stage(const TaskCtx& ctx) {
  return [&ctx](float* xs, int ld, int t0, int count) { stage_rows(ctx, 0, xs, ld, t0, count, padded(count)); };
}
__device__ __forceinline__ auto store_rounded(const TaskCtx& ctx) {
  return [&ctx](int t, int64_t c, const float* dots) { ctx.out(t)[c] = round_out(ctx, dots[0]); };
}

// kLinear: out = x·Wᵀ.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_linear(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [](int, int64_t c, int) { return RowRef{0, 0, c}; },
                            store_rounded(ctx));
}

// kRouterLogits: logits = x·Wᵀ in fp32, never rounded (moe_topk reads them). attrs: none.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_router_logits(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [](int, int64_t c, int) { return RowRef{0, 0, c}; },
                            [&ctx](int t, int64_t c, const float* dots) { ctx.out(t)[c] = dots[0]; });
}

// kNormLinear: linear(rms_norm(x; w); W). attr0 = ε.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_norm_linear(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(
      ctx, static_cast<int>(ctx.in_width(0)),
      [&ctx](float* xs, int ld, int t0, int count) { stage_rms_norm(ctx, ctx.weight(0), ctx.attr(0), xs, ld, t0, count); },
      [](int, int64_t c, int) { return RowRef{1, 0, c}; }, store_rounded(ctx));
}

// Column c of concat_i(linear(x; W_i)) for weights first.. : the weight holding it and its row.
__device__ __forceinline__ RowRef multi_row(const TaskCtx& ctx, int first, int64_t c) {
  int i = first;
  while (i + 1 < ctx.op->num_weights && c >= ctx.op->weights[i].rows) {
    c -= ctx.op->weights[i].rows;
    ++i;
  }
  return RowRef{i, 0, c};
}

// kMultiLinear: concat_i linear(x; W_i).
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_multi_linear(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [&ctx](int, int64_t c, int) { return multi_row(ctx, 0, c); },
                            store_rounded(ctx));
}

// kNormMultiLinear: multi_linear(rms_norm(x; w); W_1..W_n). attr0 = ε.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_norm_multi_linear(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(
      ctx, static_cast<int>(ctx.in_width(0)),
      [&ctx](float* xs, int ld, int t0, int count) { stage_rms_norm(ctx, ctx.weight(0), ctx.attr(0), xs, ld, t0, count); },
      [&ctx](int, int64_t c, int) { return multi_row(ctx, 1, c); }, store_rounded(ctx));
}

// kAddNormMultiLinear: multi_linear(rms_norm(a + b; w); W_1..W_n), inputs a, b. attr0 = ε.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_add_norm_multi_linear(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(
      ctx, static_cast<int>(ctx.in_width(0)),
      [&ctx](float* xs, int ld, int t0, int count) { stage_add_rms_norm(ctx, ctx.weight(0), ctx.attr(0), xs, ld, t0, count); },
      [&ctx](int, int64_t c, int) { return multi_row(ctx, 1, c); }, store_rounded(ctx));
}

// kAddNormRouterLogits: router_logits(rms_norm(a + b; w); W), fp32, inputs a, b. attr0 = ε.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_add_norm_router_logits(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(
      ctx, static_cast<int>(ctx.in_width(0)),
      [&ctx](float* xs, int ld, int t0, int count) { stage_add_rms_norm(ctx, ctx.weight(0), ctx.attr(0), xs, ld, t0, count); },
      [](int, int64_t c, int) { return RowRef{1, 0, c}; }, [&ctx](int t, int64_t c, const float* dots) { ctx.out(t)[c] = dots[0]; });
}

// kLinearAdd: r + linear(y; W), inputs y, r: round(r + round(y·Wᵀ)).
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_linear_add(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [](int, int64_t c, int) { return RowRef{0, 0, c}; },
                            [&ctx](int t, int64_t c, const float* dots) {
                              ctx.out(t)[c] = round_out(ctx, ctx.in(1, t)[c] + round_act(ctx.op->act, dots[0]));
                            });
}

// kLinearKdaGate: kda_gate(round(f·Wᵀ)), fp32 out; weights W, A_log, dt_bias; attrs as kKdaGate
// ([0] head_dim, [1] bounded, [2] lower_bound).
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_linear_kda_gate(const TaskCtx& ctx) {
  gemv_task<1, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [](int, int64_t c, int) { return RowRef{0, 0, c}; },
                            [&ctx](int t, int64_t c, const float* dots) {
                              const float z = round_act(ctx.op->act, dots[0]) + weight_flat(ctx.weight(2), c);
                              const float a_log = weight_flat(ctx.weight(1), static_cast<int>(c) / static_cast<int>(ctx.attr(0)));
                              ctx.out(t)[c] = round_out(ctx, kda_gate_value(z, a_log, ctx.attr(1) != 0.0f, ctx.attr(2)));
                            });
}

// The activations of the fused FFN ops: attr0 = act (0 SiLU·mul, 1 SiTU, 2 a·σ(b)), attr1 = β,
// attr2 = β_lin; inputs already rounded; the result rounded once more as the unfused op's output.
__device__ __forceinline__ float fused_act(const TaskCtx& ctx, float a, float b) {
  const int32_t act = ctx.op->act;
  switch (static_cast<int>(ctx.attr(0))) {
    case 1: return round_act(act, situf_(a, b, ctx.attr(1), ctx.attr(2)));
    case 2: return round_act(act, a * sigmoidf_(b));
    default: return round_act(act, round_act(act, siluf_(a)) * b);
  }
}

// kGateUpAct: act(round(x·W_gᵀ), round(x·W_uᵀ)). attrs as fused_act.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_gate_up_act(const TaskCtx& ctx) {
  gemv_task<2, false, kCap>(ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx), [](int j, int64_t c, int) { return RowRef{j, 0, c}; },
                            [&ctx](int t, int64_t c, const float* dots) {
                              const int32_t act = ctx.op->act;
                              ctx.out(t)[c] = round_out(ctx, fused_act(ctx, round_act(act, dots[0]), round_act(act, dots[1])));
                            });
}

// kActLinear: linear(act(a, b); W). attrs as fused_act.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_act_linear(const TaskCtx& ctx) {
  const int n = static_cast<int>(ctx.in_width(0));
  gemv_task<1, false, kCap>(
      ctx, n,
      [&ctx, n](float* xs, int ld, int t0, int count) {
        const Rows<const float> a = ctx.in_rows(0), b = ctx.in_rows(1);
        for_each_element(
            0, padded(count), 0, ld,
            [&](int g, int64_t k) { return g < count && k < n ? Operands{a[t0 + g][k], b[t0 + g][k]} : Operands{0.0f, 0.0f}; },
            [&](int g, int64_t k, Operands v) { xs[g * ld + k] = g < count && k < n ? fused_act(ctx, v.a, v.b) : 0.0f; });
      },
      [](int, int64_t c, int) { return RowRef{0, 0, c}; }, store_rounded(ctx));
}

// kGatedNormLinear: linear(gated_rms_norm(o, z; w); W), per head of d = attr1 columns:
// round(w_j · (o_j · rsqrt(mean o² + ε)) · σ(z_j)) in fp32. attr0 = ε, attr1 = head_dim.
template <int kCap = kMaxGroup>
__device__ __noinline__ void op_gated_norm_linear(const TaskCtx& ctx) {
  const int n = static_cast<int>(ctx.in_width(0));
  const int d = static_cast<int>(ctx.attr(1));
  const float eps = ctx.attr(0);
  gemv_task<1, false, kCap>(
      ctx, n,
      [&ctx, n, d, eps](float* xs, int ld, int t0, int count) {
        const int pad = padded(count);
        for (int g = 0; g < pad; ++g) {
          for (int k = threadIdx.x; k < ld; k += kThreads) xs[g * ld + k] = 0.0f;
        }
        __syncthreads();
        // gated_rms_norm's units (its sums and rounding), one per (row, head), into the staged rows.
        const int heads = n / d;
        const Rows<const float> o = ctx.in_rows(0), z = ctx.in_rows(1);
        gated_norm_units(ctx.weight(0), d, eps, ctx.op->act, kAF32, kAF32, static_cast<int64_t>(count) * heads, [&](int64_t u) {
          const int g = static_cast<int>(u / heads);
          const int64_t col = u % heads * d;
          return GatedUnit{o[t0 + g] + col, z[t0 + g] + col, xs + g * ld + col};
        });
      },
      [](int, int64_t c, int) { return RowRef{1, 0, c}; }, store_rounded(ctx));
}

// kMoeGateUp: inputs x [T, io], routes [T, 2k]; weights w1, w3 stacks [I, io]; output column
// k·I + i = act(round(x·w1_e[i]), round(x·w3_e[i])) for e = the k-th routed expert of the token.
// attr0 = top_k, attr1 = SiTU (1) or SiLU·mul (0), attr2 = β, attr3 = β_lin.
__device__ __noinline__ void op_moe_gate_up(const TaskCtx& ctx) {
  const int top_k = static_cast<int>(ctx.attr(0));
  const int inter = static_cast<int>(ctx.weight(0).rows);
  gemv_task<2, true>(
      ctx, static_cast<int>(ctx.in_width(0)), plain_stage(ctx),
      [&ctx, top_k, inter](int j, int64_t c, int t) {
        const int col = static_cast<int>(c);  // < k·I columns: 32-bit division, a few instructions where 64-bit takes dozens
        const int64_t e = static_cast<int64_t>(ctx.in(1, t)[top_k + col / inter]);
        return RowRef{j, e, col % inter};
      },
      [&ctx](int t, int64_t c, const float* dots) {
        const int32_t act = ctx.op->act;
        const float gate = round_act(act, dots[0]), up = round_act(act, dots[1]);
        const float v = ctx.attr(1) != 0.0f ? round_act(act, situf_(gate, up, ctx.attr(2), ctx.attr(3)))
                                             : round_act(act, round_act(act, siluf_(gate)) * up);
        ctx.out(t)[c] = round_out(ctx, v);
      });
}

// The dot of one (output column, slot) pair of moe_down for the staged token x: expert slot k's row
// `o` against its I columns of x. Two pairs at once where lane_dot2 can stream both rows.
__device__ __forceinline__ void moe_down_dots(const DeviceWeight& w2, const float* route, int top_k, int inter, const float* x, int ld, int64_t o_a,
                                              int k_a, int64_t o_b, int k_b, bool two, float& da, float& db) {
  const auto ea = static_cast<int64_t>(route[top_k + k_a]), eb = static_cast<int64_t>(route[top_k + k_b]);
  const float *xa = x + k_a * inter, *xb = x + k_b * inter;
  float acc_a[1] = {0.0f}, acc_b[1] = {0.0f};
  const uint8_t* a = half_row(w2, ea, o_a, xa, inter);
  const uint8_t* b = two ? half_row(w2, eb, o_b, xb, inter) : nullptr;
  if (a != nullptr && b != nullptr) {
    lane_dot2<1>(w2.type, a, xa, b, xb, ld, inter, acc_a, acc_b);
  } else {
    lane_dot<1, 4>(w2, ea, o_a, xa, ld, inter, acc_a);  // rows lane_dot2 cannot stream: rare, so a light batch
    if (two) lane_dot<1, 4>(w2, eb, o_b, xb, ld, inter, acc_b);
  }
  da = warp_sum(acc_a[0]);
  db = warp_sum(acc_b[0]);
}

// moe_down's (column, slot) pairs over MXFP4 rows, each pair's rounded dot into dots[p]: groups of
// mx_row_lanes(I / 32) lanes take two pairs at once, a warp as many pairs as twice its groups. K3's
// 384-wide rows (12 blocks of 16 bytes) took 12 lanes of a warp one load each, two rows at a time: a
// DRAM latency for 384 bytes, ~170 GB/s over the op.
__device__ __forceinline__ void moe_down_mx_dots(const TaskCtx& ctx, const DeviceWeight& w2, const float* route, int top_k, int inter, const float* x,
                                                 int pairs, float* dots) {
  constexpr int kPer = 2;  // pairs a lane group takes at once
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int blocks = inter / 32, lanes = mx_row_lanes(blocks), groups = 32 / lanes, grp = lane / lanes, sub = lane % lanes;
  for (int w0 = warp * groups * kPer; w0 < pairs; w0 += kWarps * groups * kPer) {  // the warp's pairs: every lane stays for the sums
    const int p0 = w0 + grp * kPer;
    const bool live = p0 < pairs;
    MxRow rows[kPer];
    float acc[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int p = live ? (p0 + i < pairs ? p0 + i : p0) : w0;  // a missing pair reads a live one's row (not summed)
      const int k = p % top_k;
      rows[i] = mx_row(w2, static_cast<int64_t>(route[top_k + k]), ctx.col_begin + p / top_k, x + k * inter);
      acc[i] = 0.0f;
    }
    mx_lane_dots<kPer>(rows, live ? blocks : 0, sub, lanes, acc);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      acc[i] = lanes_sum(acc[i], lanes);
      if (live && sub == 0 && p0 + i < pairs) dots[p0 + i] = round_out(ctx, acc[i]);
    }
  }
}

// kMoeDown (and kMoeDownAdd with a third input `shared`): out[t, o] = round(Σ_k route_k ·
// round(h_k · w2_{e_k}[o])) (+ shared, rounded again), k in order; a tensor-parallel partial sum
// (round_out 0) rounds neither. attr0 = top_k.
// Per token, the task's (column, slot) pairs are the warps' work items, two at a time (one weight row
// each): a decode task of the 48B shape has ~17.5 columns of 8 slots, and one warp a column left most
// warps idle while two had a second column. The rounded dots meet past the staged rows, and each
// column's sum runs over its slots in order.
template <bool ADD>
__device__ __noinline__ void op_moe_down_impl(const TaskCtx& ctx) {
  const int top_k = static_cast<int>(ctx.attr(0));
  const DeviceWeight& w2 = ctx.weight(0);
  const int inter = static_cast<int>(w2.cols);
  const int n = static_cast<int>(ctx.in_width(0));  // k·I
  const int cols = static_cast<int>(ctx.col_end - ctx.col_begin);
  const int pairs = cols * top_k;  // 32-bit pair arithmetic below (a task's columns × k)
  int ld = 0, group = 0;
  float* xs = staging(ctx, n, ld, group, pairs);
  if (group == 0) {  // beyond any model's shapes (k·I + the pairs > 1 MiB of scratch)
    if (threadIdx.x == 0) report_error(ctx, kErrWorkspace);
    return;
  }
  float* dots = xs + static_cast<int64_t>(group) * ld;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int t0 = 0; t0 < ctx.rows(); t0 += group) {
    const int count = ctx.rows() - t0 < group ? ctx.rows() - t0 : group;
    __syncthreads();
    stage_rows(ctx, 0, xs, ld, t0, count, count);
    __syncthreads();
    for (int g = 0; g < count; ++g) {
      const float* route = ctx.in(1, t0 + g);
      const float* x = xs + g * ld;
      auto emit = [&](int64_t o, float total) {
        float v = round_out(ctx, total);
        if (ADD) v = round_out(ctx, v + ctx.in(2, t0 + g)[o]);
        ctx.out(t0 + g)[o] = v;
      };
      if (w2.type == kWMXFP4 && staged_in_smem(ctx, xs)) {
        moe_down_mx_dots(ctx, w2, route, top_k, inter, smem_floats(ctx) + g * ld, pairs, dots);
      } else {
        for (int p = 2 * warp; p < pairs; p += 2 * kWarps) {  // pair p: column col_begin + p / top_k, slot p % top_k
          const bool two = p + 1 < pairs;
          float da = 0.0f, db = 0.0f;
          moe_down_dots(w2, route, top_k, inter, x, ld, ctx.col_begin + p / top_k, p % top_k, ctx.col_begin + (p + 1) / top_k, (p + 1) % top_k, two,
                        da, db);
          if (lane == 0) {
            dots[p] = round_out(ctx, da);
            if (two) dots[p + 1] = round_out(ctx, db);
          }
        }
      }
      __syncthreads();
      for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
        float total = 0.0f;
        for (int k = 0; k < top_k; ++k) total += route[k] * dots[c * top_k + k];
        emit(ctx.col_begin + c, total);
      }
      __syncthreads();  // the next token rewrites the dots
    }
  }
}

// Whether `opcode` is one of this file's bodies (host side too: for the backends' has_op).
__host__ __device__ constexpr bool is_gemv_op(uint8_t opcode) {
  switch (static_cast<Op>(opcode)) {
    case Op::kLinear: case Op::kRouterLogits: case Op::kNormLinear: case Op::kMultiLinear: case Op::kNormMultiLinear:
    case Op::kAddNormMultiLinear: case Op::kAddNormRouterLogits: case Op::kLinearAdd: case Op::kLinearKdaGate: case Op::kGateUpAct:
    case Op::kActLinear: case Op::kGatedNormLinear: case Op::kMoeGateUp: case Op::kMoeDown: case Op::kMoeDownAdd:
      return true;
    default:
      return false;
  }
}

// Runs the body of `opcode` (ctx.op's) when it is one of this file's (the linear family, the router
// logits, the routed experts) and returns true; false for any other opcode. kCap as gemv_task's. The kernels'
// dispatch (kernels.cu) and the host emulator's (tests/gpu/emu) both come through here.
template <int kCap>
__device__ __forceinline__ bool run_gemv_op(const TaskCtx& ctx, int32_t opcode) {
  switch (static_cast<Op>(opcode)) {
    case Op::kLinear: op_linear<kCap>(ctx); return true;
    case Op::kRouterLogits: op_router_logits<kCap>(ctx); return true;
    case Op::kNormLinear: op_norm_linear<kCap>(ctx); return true;
    case Op::kMultiLinear: op_multi_linear<kCap>(ctx); return true;
    case Op::kNormMultiLinear: op_norm_multi_linear<kCap>(ctx); return true;
    case Op::kAddNormMultiLinear: op_add_norm_multi_linear<kCap>(ctx); return true;
    case Op::kAddNormRouterLogits: op_add_norm_router_logits<kCap>(ctx); return true;
    case Op::kLinearAdd: op_linear_add<kCap>(ctx); return true;
    case Op::kLinearKdaGate: op_linear_kda_gate<kCap>(ctx); return true;
    case Op::kGateUpAct: op_gate_up_act<kCap>(ctx); return true;
    case Op::kActLinear: op_act_linear<kCap>(ctx); return true;
    case Op::kGatedNormLinear: op_gated_norm_linear<kCap>(ctx); return true;
    case Op::kMoeGateUp: op_moe_gate_up(ctx); return true;
    case Op::kMoeDown: op_moe_down_impl<false>(ctx); return true;
    case Op::kMoeDownAdd: op_moe_down_impl<true>(ctx); return true;
    default: return false;
  }
}

}  // namespace plow::cuda
