// MoE top-k (spec/MODEL.md §4.5 R2–R7; cpu: ops/moe.cpp cpu_moe_topk), one warp per token row; the
// op's tasks (one per 16 rows of the plan, up to the workers: graph/op_table spread_tasks) split the
// step's rows into near-equal shares, whatever columns the plan gave them: sigmoid or softmax scores
// of the fp32 logits (router_logits, a GEMV in gemv.cuh),
// selection on score + bias with group-limited top-k (group score = sum of its top-2), weights from the
// unbiased scores, renormalized then scaled. Ties go to the lower index, as the CPU's stable sort: every
// top-k here is an iterative argmax whose comparison prefers the lower index on equal values (−∞
// included), which yields the stable order.
#pragma once

#include <climits>

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/limits.h"

namespace plow::cuda {

struct RouterArgs {
  int experts, top_k, groups, keep_groups;
  bool renormalize, softmax;
  float scale;
};

// (value, index) argmax over the warp, lower index on equal values; idx = INT_MAX marks "none".
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, value, o);
    const int i = __shfl_xor_sync(0xffffffffu, index, o);
    if (v > value || (v == value && i < index)) value = v, index = i;
  }
}

// Selects and weights the experts of one row (one warp). logits: the row's E logits (the input row in
// the arena, read only); buf: this warp's shared memory (E values: logits, then scores, the choice
// values during the group scans; then G group scores).
// kPerLane ≥ E / 32 candidates per lane, unrolled, and the scores computed in a plain loop: one body
// for E ≤ 1024 (32 per lane, a score inlined in each) was ~13K SASS instructions, most of them run for
// every row whatever E. On the H200 the op took ~27 µs for one decode row and ~35 µs for 1,024 rows
// on 64 SMs, one warp a row at an IPC of 0.25 (ncu), as if fetching instructions.
// The lane's logits and biases are loaded by one unrolled loop, all in flight together (a loop bounded
// by E issued them one DRAM round trip at a time: one decode row at E = 256 took 15.9 µs, long
// scoreboard); the scores are still computed in a plain loop, from shared memory. `a` by value: a
// reference to a non-inlined function is a pointer into the caller's stack, its fields local loads.
template <int kPerLane>
__device__ __noinline__ void router_select_row(const TaskCtx& ctx, const RouterArgs a, const float* logits, float* buf, float* out) {
  const DeviceWeight& bias = ctx.weight(0);
  const int lane = lane_id(), experts = a.experts;
  float logit[kPerLane], choice[kPerLane];  // candidate e = lane + 32m; choice holds its bias until the choice value
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    const int e = lane + 32 * m;
    logit[m] = e < experts ? logits[e] : 0.0f;
    choice[m] = e < experts ? weight_flat(bias, e) : 0.0f;
  }
  // Stored after all the loads: buf may alias logits as far as the compiler knows, and a store between
  // them would hold the later loads back.
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    if (lane + 32 * m < experts) buf[lane + 32 * m] = logit[m];
  }
  // Each lane reads back only what it wrote until the __syncwarp below.
  float max_logit = 0.0f, soft_total = 1.0f;
  if (a.softmax) {
    float m = -INFINITY;
    for (int e = lane; e < experts; e += 32) m = fmaxf(m, buf[e]);
    max_logit = warp_max(m);
    float sum = 0.0f;
    for (int e = lane; e < experts; e += 32) sum += expf(buf[e] - max_logit);
    soft_total = warp_sum(sum);
  }
  for (int e = lane; e < experts; e += 32) buf[e] = a.softmax ? expf(buf[e] - max_logit) / soft_total : sigmoidf_(buf[e]);
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) choice[m] = lane + 32 * m < experts ? buf[lane + 32 * m] + choice[m] : -INFINITY;
  __syncwarp();  // buf holds the scores: the picks' weights read them there (after the group scans)
  if (a.groups > 1) {
    // The choice values in buf for the per-group scans, the scores in registers meanwhile.
    float score[kPerLane];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int e = lane + 32 * m;
      score[m] = e < experts ? buf[e] : 0.0f;
      if (e < experts) buf[e] = choice[m];
    }
    __syncwarp();
    const int per_group = experts / a.groups;
    float* group_score = buf + experts;
    for (int g = lane; g < a.groups; g += 32) {
      float best = -INFINITY, second = -INFINITY;
      for (int i = 0; i < per_group; ++i) {
        const float v = buf[g * per_group + i];
        if (v > best) second = best, best = v;
        else if (v > second) second = v;
      }
      group_score[g] = per_group >= 2 ? best + second : best;
    }
    __syncwarp();
    // Keep the best keep_groups groups (ties to the lower group); mask the others' experts to −∞.
    uint32_t kept = 0;  // bit i: group lane + 32i kept (groups ≤ kRouterMaxExperts)
    for (int k = 0; k < a.keep_groups; ++k) {
      float value = -INFINITY;
      int index = INT_MAX;
      for (int i = 0, g = lane; g < a.groups; ++i, g += 32) {
        const float v = group_score[g];
        if (!(kept >> i & 1u) && (index == INT_MAX || v > value)) value = v, index = g;
      }
      warp_argmax(value, index);
      if (index != INT_MAX && index % 32 == lane) kept |= 1u << (index / 32);
    }
    // Broadcast the kept flags through buf (group scores are no longer needed).
    for (int i = 0, g = lane; g < a.groups; ++i, g += 32) group_score[g] = (kept >> i & 1u) ? 1.0f : 0.0f;
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int e = lane + 32 * m;
      if (e < experts && group_score[e / per_group] == 0.0f) choice[m] = -INFINITY;
    }
    __syncwarp();  // the masks have read the kept flags
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      if (lane + 32 * m < experts) buf[lane + 32 * m] = score[m];
    }
    __syncwarp();
  }
  // Top-k of the choice values: k rounds of argmax over the candidates not taken yet. Every lane gets
  // each round's winner (the butterfly leaves it in all lanes); lane k % 32 keeps pick k, in pick0 for
  // k < 32, pick1 above (named, not an array indexed by k: that would live in local memory).
  uint32_t taken = 0;
  int pick0 = 0, pick1 = 0;
  for (int k = 0; k < a.top_k; ++k) {
    float value = -INFINITY;
    int index = INT_MAX;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int e = lane + 32 * m;
      if (e < experts && !(taken >> m & 1u) && (index == INT_MAX || choice[m] > value)) value = choice[m], index = e;
    }
    warp_argmax(value, index);
    if (index != INT_MAX && index % 32 == lane) taken |= 1u << (index / 32);  // top_k ≤ E: always found
    if (k == lane) pick0 = index;
    if (k == lane + 32) pick1 = index;
  }
  // Weights from the unbiased scores, each lane its picks' (in parallel), summed in selection order as
  // the CPU does (every lane forms the same sum from the shuffled scores).
  const float picked0 = lane < a.top_k ? buf[pick0] : 0.0f, picked1 = lane + 32 < a.top_k ? buf[pick1] : 0.0f;
  float total = 0.0f;
  for (int k = 0; k < a.top_k; ++k) total += __shfl_sync(0xffffffffu, k < 32 ? picked0 : picked1, k % 32);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int k = lane + 32 * half;
    if (k >= a.top_k) continue;
    float w = half == 0 ? picked0 : picked1;
    if (a.renormalize) w = w / (total + 1e-20f);
    out[k] = round_out(ctx, w * a.scale);
    out[a.top_k + k] = static_cast<float>(half == 0 ? pick0 : pick1);
  }
  __syncwarp();
}

// kMoeTopK (whole, rows shared by its tasks): logits [T, E] fp32 → [T, 2k] fp32: k weights, then k
// expert ids (exact in fp32). Task i of n writes rows [T·i/n, T·(i+1)/n): consumers wait for all n.
// attrs: [0] experts, [1] top_k, [2] groups, [3] topk_groups, [4] renormalize, [5] scale, [6] softmax.
// Weight: bias [E]. Requires E ≤ 1024, top_k ≤ 64, groups | E (pack_misc_attrs checks).
__device__ __noinline__ void op_moe_topk(const TaskCtx& ctx) {
  RouterArgs a;
  a.experts = static_cast<int>(ctx.attr(0));
  a.top_k = static_cast<int>(ctx.attr(1));
  a.groups = static_cast<int>(ctx.attr(2));
  a.keep_groups = static_cast<int>(ctx.attr(3));
  a.renormalize = ctx.attr(4) != 0.0f;
  a.scale = ctx.attr(5);
  a.softmax = ctx.attr(6) != 0.0f;
  // Per warp, E choice values and G group scores in shared memory (as many warps as fit: E ≤ 1024).
  const int per_warp = a.experts + a.groups;
  const int warps = min(kWarps, static_cast<int>(kSharedBytes / (per_warp * sizeof(float))));
  if (warp_id() >= warps) return;  // no block barrier follows
  float* buf = smem_floats(ctx) + warp_id() * per_warp;
  const int64_t tasks = ctx.op->tasks, rows = ctx.rows();
  const auto first = static_cast<int>(rows * ctx.task / tasks), end = static_cast<int>(rows * (ctx.task + 1) / tasks);
  for (int t = first + warp_id(); t < end; t += warps) {
    if (a.experts <= 64) {
      router_select_row<2>(ctx, a, ctx.in(0, t), buf, ctx.out(t));
    } else if (a.experts <= 256) {
      router_select_row<8>(ctx, a, ctx.in(0, t), buf, ctx.out(t));
    } else {
      router_select_row<kRouterMaxExperts / 32>(ctx, a, ctx.in(0, t), buf, ctx.out(t));
    }
  }
}

}  // namespace plow::cuda
