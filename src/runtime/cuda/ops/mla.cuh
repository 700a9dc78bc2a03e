// MLA with NoPE over the latent cache (spec/MODEL.md §4.3, §5; cpu: ops/mla.cpp), in the ABSORBED form:
// per head, q_abs = q_nope·W_UK,h (rank wide), score_τ = (q_abs·c_τ + q_rope·k_r,τ)/√(d_n+d_r),
// u = Σ_τ p_τ c_τ, o = W_UV,h·u. Equal to the CPU's expanded form up to fp32 reassociation, except that
// the CPU rounds the expanded k_nope and v, and P, to the activation dtype (no-ops in fp32; in bf16 a
// difference of order one bf16 ulp, hence the looser bf16 test bound). One sweep over the cache with an
// online softmax: P is never formed normalized, so it is not rounded. Every step runs split-KV, short
// contexts too (a per-head body there was slower once A and C streamed through shared memory).
// Split-KV: the op has one task per worker (spreads_over_workers) and its tasks take work items from a
// ticket counter (OpDesc::sync[0]) in three phases, every item of a phase before any of the next:
//  A (block of kMlaRowBlock query rows × head × part, ≤ kMlaSplitAC parts): q_abs into the workspace, the
//    part's share of its latent columns; the (head 0, part 0) item also appends those rows' fresh latents
//    to the cache (rows of the activation dtype: DeviceState::elem).
//  B (sequence × split of cache positions × group of kMlaGroup queries (token, head)): rows staged in
//    shared memory once serve the group's queries; writes each query's partial (max, sum, u).
//  C (row block × head × part): merges a query's partials with log-sum-exp rescaling (every part of a
//    head, the same merge); o = W_UV,h·u for the part's share of the value rows.
// A B item waits until every A item is done (sync[1]), a C item until every B item is (sync[2]). That
// wait cannot deadlock, in the megakernel or in eager mode with blocks not co-resident: tickets are
// taken in order and only by running blocks, so every item below a waiting one is held by a running
// block that waits only for items lower still. The last task to leave resets the counters to 0 (sync[3]
// counts leavers), so they need no epoch and no host reset. Every task follows the same schedule, a
// pure function of the step and OpDesc::tasks (mla_schedule).
#pragma once

#include "runtime/cuda/ops/common.cuh"
#include "runtime/cuda/ops/half8.cuh"
#include "runtime/cuda/ops/limits.h"
#include "runtime/cuda/ops/mla_common.cuh"
#ifndef PLOW_CUDA_EMU
#include "runtime/cuda/ops/gemv.cuh"  // load_stream, unpack8 (W_UV rows)
#endif

namespace plow::cuda {

inline constexpr int kMlaGroup = kMlaGroupQueries;  // queries of a B item: u accumulators, one register each per thread
inline constexpr int kMlaTileRows = 16;       // cache rows staged in shared memory at a time (one per warp)
inline constexpr int kMlaRowBlock = 8;        // query rows of an A or C item (one read of the head's kv_b rows)
inline constexpr int kMlaMinSplitRows = 64;   // cache rows of a split, at least (a B item loads kMlaGroup q_abs)
inline constexpr int kMlaMaxSplits = 1024;    // splits of one sequence, at most (C weights in shared memory)
// A and C items per (row block, head), at most: at batch 1 one item a head left A and C on `heads` SMs
// (32 of 132 on the H200), each streaming its head's 128 KB of kv_b rows alone. Parts split the columns
// of q_abs (A) and the value rows (C), so each output element is still summed by one thread or warp in
// the same order: the results do not depend on the split. A step splits only as far as its (row block,
// head) pairs leave tasks idle (mla_schedule): every C part redoes its head's merge of the partials, and
// four parts at batch 32 × 4096 (128 pairs for 132 tasks) took MLA from 5.5 to 7.2 ms a step, where at
// batch 8 they took it from 2.6 to 2.1 (H200, 48B shape).
inline constexpr int kMlaSplitAC = 4;
inline constexpr int kMlaStagePerThread = kMlaTileRows * kMlaMaxLatent / kThreads;
static_assert(kMlaTileRows == kWarps && kMlaMaxRank <= kThreads && kMlaTileRows * kMlaMaxLatent % kThreads == 0, "MLA tiling");

// The step's work items. A and C have a_items each (row blocks × heads × ac_parts). B items of
// sequence s: splits(s) × groups(s), split-major (consecutive tickets read the same cache rows for
// different query groups, from L2). split_rows: the positions of a split, chosen so that B has about
// 2 × tasks items (never fewer than kMlaMinSplitRows positions).
struct MlaSchedule {
  int a_items, b_items, split_rows;
  int ac_parts;  // parts of an A or C (row block, head): tasks / pairs, within [1, kMlaSplitAC]
};

// An A or C item: rows [r0, r0 + n), head h, part `part`; the parts of one (row block, head) take
// consecutive tickets (they read neighbouring columns of the same kv_b rows).
struct MlaAcItem {
  int r0, n, h, part;
};
__device__ __forceinline__ MlaAcItem mla_ac_item(const TaskCtx& ctx, const MlaShape& sh, int parts, int item) {
  MlaAcItem it;
  it.part = item % parts;
  it.h = item / parts % sh.heads;
  it.r0 = item / parts / sh.heads * kMlaRowBlock;
  it.n = ctx.rows() - it.r0 < kMlaRowBlock ? ctx.rows() - it.r0 : kMlaRowBlock;
  return it;
}
// Part p's share [begin(p), begin(p + 1)) of `count` columns or rows: near-equal, covering [0, count).
__device__ __forceinline__ int mla_part_begin(int count, int part, int parts) { return count * part / parts; }

__device__ __forceinline__ int mla_groups(const StepView& step, int s, int heads) { return (step.seq_tokens[s] * heads + kMlaGroup - 1) / kMlaGroup; }
__device__ __forceinline__ int mla_splits(const StepView& step, int s, int split_rows) {
  return (step.seq_context[s] + step.seq_tokens[s] + split_rows - 1) / split_rows;
}

__device__ inline MlaSchedule mla_schedule(const TaskCtx& ctx, const MlaShape& sh) {
  const StepView& step = *ctx.step;
  MlaSchedule m;
  const int pairs = (step.tokens + kMlaRowBlock - 1) / kMlaRowBlock * sh.heads;
  const int idle_share = static_cast<int>(ctx.op->tasks) / pairs;
  m.ac_parts = idle_share < 1 ? 1 : idle_share > kMlaSplitAC ? kMlaSplitAC : idle_share;
  m.a_items = pairs * m.ac_parts;
  int64_t work = 0, longest = 0;  // Σ positions × groups; the longest sequence
  for (int s = 0; s < step.num_seqs; ++s) {
    const int64_t visible = static_cast<int64_t>(step.seq_context[s]) + step.seq_tokens[s];
    work += visible * mla_groups(step, s, sh.heads);
    longest = visible > longest ? visible : longest;
  }
  const int64_t target = 2 * static_cast<int64_t>(ctx.op->tasks);
  int64_t rows = (work + target - 1) / target;
  const int64_t by_count = (longest + kMlaMaxSplits - 1) / kMlaMaxSplits;
  rows = rows > by_count ? rows : by_count;
  rows = rows > kMlaMinSplitRows ? rows : kMlaMinSplitRows;
  m.split_rows = static_cast<int>((rows + kMlaTileRows - 1) / kMlaTileRows * kMlaTileRows);
  m.b_items = 0;
  for (int s = 0; s < step.num_seqs; ++s) m.b_items += mla_splits(step, s, m.split_rows) * mla_groups(step, s, sh.heads);
  return m;
}

// The workspace of one step: q_abs [T, heads, latent] padded to a multiple of 4 floats, then per B item
// and query (max, sum) and u [rank]: the partials start 16-byte aligned (C copies them by cp.async; an
// odd latent left them misaligned, a fault on the H200). ops_attrs.cpp sizes it the same way.
struct MlaWorkspace {
  float* qabs;
  float* part_ml;
  float* part_u;
};

__device__ __forceinline__ int64_t mla_qabs_floats(const MlaShape& sh, int tokens) {
  return (static_cast<int64_t>(tokens) * sh.heads * sh.latent + 3) / 4 * 4;
}
__device__ __forceinline__ int64_t mla_workspace_floats(const MlaShape& sh, int tokens, int b_items) {
  return mla_qabs_floats(sh, tokens) + static_cast<int64_t>(b_items) * kMlaGroup * (2 + sh.rank);
}

// Where B item ib of query group gq, split k of sequence s begins: base of s (the items of the
// sequences before it), its group count g and split count.
struct MlaSeqItems {
  int base, groups, splits;
};
__device__ inline MlaSeqItems mla_seq_items(const StepView& step, const MlaShape& sh, int split_rows, int s) {
  MlaSeqItems r{0, 0, 0};
  for (int i = 0; i <= s; ++i) {
    r.base += r.groups * r.splits;
    r.groups = mla_groups(step, i, sh.heads);
    r.splits = mla_splits(step, i, split_rows);
  }
  return r;
}

__device__ __forceinline__ float mla_block_max(float v, float* red) {
  v = warp_max(v);
  __syncthreads();
  if (lane_id() == 0) red[warp_id()] = v;
  __syncthreads();
  return warp_max(lane_id() < kWarps ? red[lane_id()] : -INFINITY);
}

// Step rows [r0, r0 + n) into the cache: c = act(w ⊙ act(c̃·rsqrt(mean(c̃²)+ε))), k_r raw (kv_a's
// output, already rounded to act), at each row's position in its sequence's slot, in the cache's type.
__device__ inline void mla_append_latents(const TaskCtx& ctx, const MlaShape& sh, int r0, int n, float* red) {
  const DeviceWeight& norm = ctx.weight(0);
  const int32_t act = ctx.op->act;
  const StepView& step = *ctx.step;
  const int32_t elem = step.states[ctx.op->state].elem;
  for_each_row_sum(
      n, red,
      [&](int t, int begin, int stride) {
        const float* kv = ctx.in(1, r0 + t);
        float sum = 0.0f;
        for (int i = begin; i < sh.rank; i += stride) sum += kv[i] * kv[i];
        return sum;
      },
      [&](int t, float total, int begin, int stride) {
        const float inv = inv_rms(total, sh.rank, sh.eps);
        const float* kv = ctx.in(1, r0 + t);
        uint8_t* slot = state_bytes_of(ctx, step.seq_slot[step.row_seq[r0 + t]]);
        const int64_t row = static_cast<int64_t>(step.row_pos[r0 + t]) * sh.latent;
        for (int i = begin; i < sh.latent; i += stride) {
          store_state_elem(slot, elem, row + i, i < sh.rank ? round_act(act, weight_flat(norm, i) * round_act(act, kv[i] * inv)) : kv[i]);
        }
      });
}

// Whether A takes mla_absorb_cols: half-precision W_UK whose rows are whole, aligned 16-byte chunks.
__device__ __forceinline__ bool mla_absorb_vector(const DeviceWeight& kv_b, const MlaShape& sh) {
  return (kv_b.type == kWBF16 || kv_b.type == kWF16) && sh.rank % 8 == 0 && (reinterpret_cast<uintptr_t>(kv_b.data) & 15) == 0;
}

// q_abs's rank columns [c0, c1) (multiples of 8) for the block's rows, every thread busy: chunks of
// the part's W_UK rows come by cp.async into shared memory (`stage`, stage_bytes), every copy of a
// chunk in flight; thread t then takes the 8 columns c0 + 8·(t % groups) over the chunk's rows
// i ≡ t / groups (mod slices), and the slices' sums meet in shared memory (`part`, ≤ kThreads·8
// floats), added in slice order. (ncu, batch 1 × 4096: the scalar loop of mla_absorb_item ran 144 of
// 512 threads, each 128 scalar loads of its column; 16-byte loads into registers instead were issued
// two at a time by ptxas, each just before its use.)
template <int kRows>
__device__ __noinline__ void mla_absorb_cols(const TaskCtx& ctx, const MlaShape sh, int h, int r0, int n, int c0, int c1, const float* qs, float* part,
                                             uint8_t* stage, int stage_bytes, float* qabs) {
  const DeviceWeight& kv_b = ctx.weight(1);
  const int tid = static_cast<int>(threadIdx.x), cols = c1 - c0, groups = cols / 8, slices = kThreads / groups;
  const int g = tid % groups, slice = tid / groups;
  const bool active = slice < slices;
  const int chunk_rows = stage_bytes / (cols * 2) < sh.nope ? stage_bytes / (cols * 2) : sh.nope;
  const uint8_t* w = kv_b.data + (static_cast<int64_t>(h) * sh.per_head * sh.rank + c0) * 2;
  float acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.0f;
  }
  for (int i0 = 0; i0 < sh.nope; i0 += chunk_rows) {
    const int m = sh.nope - i0 < chunk_rows ? sh.nope - i0 : chunk_rows;
    for (int idx = tid; idx < m * groups; idx += kThreads) {
      const int i = idx / groups, c = idx % groups;
      const uint8_t* src = w + (static_cast<int64_t>(i0 + i) * sh.rank + 8 * c) * 2;
      cp_async16(reinterpret_cast<float*>(stage + (i * cols + 8 * c) * 2), reinterpret_cast<const float*>(src));
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (active) {
      for (int i = slice; i < m; i += slices) {
        const float4 raw = *reinterpret_cast<const float4*>(stage + (i * cols + 8 * g) * 2);
        const uint32_t words[4] = {__float_as_uint(raw.x), __float_as_uint(raw.y), __float_as_uint(raw.z), __float_as_uint(raw.w)};
        float f[8];
        unpack_half8(words, kv_b.type, f);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= n) break;
          const float x = qs[r * sh.nope + i0 + i];
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[r][c] += x * f[c];
        }
      }
    }
    __syncthreads();  // the stage is rewritten by the next chunk
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= n) break;  // block-uniform
    if (active) {
      float4* dst = reinterpret_cast<float4*>(part + slice * cols + 8 * g);
      dst[0] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      dst[1] = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
    }
    __syncthreads();
    for (int j = tid; j < cols; j += kThreads) {
      float sum = 0.0f;
      for (int k = 0; k < slices; ++k) sum += part[k * cols + j];
      qabs[(static_cast<int64_t>(r0 + r) * sh.heads + h) * sh.latent + c0 + j] = sum;
    }
    __syncthreads();  // part is rewritten by the next row
  }
}

// A item: q_abs[row][h] = [q_nope·W_UK,h | q_rope] for the block's rows, columns of its part: rank
// columns [c0, c1) and rope columns rank + [t0, t1) (one read of the part's columns of W_UK,h).
// (The non-inlined items take the shape, schedule and workspace by value: a reference is a pointer
// into the caller's stack, every field a local-memory load.)
__device__ __noinline__ void mla_absorb_item(const TaskCtx& ctx, const MlaShape sh, int parts, int item, float* qabs, float* red) {
  const DeviceWeight& kv_b = ctx.weight(1);  // [heads·(nope+v), rank]
  const MlaAcItem it = mla_ac_item(ctx, sh, parts, item);
  const int h = it.h, r0 = it.r0, n = it.n;
  const int t0 = mla_part_begin(sh.rope, it.part, parts), t1 = mla_part_begin(sh.rope, it.part + 1, parts);
  // The block's q_nope rows of head h in shared memory (after `red`): the loops below read each often.
  float* qs = red + 32;
  for (int idx = static_cast<int>(threadIdx.x); idx < n * sh.nope; idx += kThreads) qs[idx] = ctx.in(0, r0 + idx / sh.nope)[h * sh.qk + idx % sh.nope];
  __syncthreads();
  if (mla_absorb_vector(kv_b, sh)) {
    // Column shares in multiples of 8 (the 16-byte copies; a part may get none); rope columns are copies.
    const int c0 = 8 * mla_part_begin(sh.rank / 8, it.part, parts), c1 = 8 * mla_part_begin(sh.rank / 8, it.part + 1, parts);
    for (int idx = static_cast<int>(threadIdx.x); idx < n * (t1 - t0); idx += kThreads) {
      const int r = idx / (t1 - t0), e = sh.rank + t0 + idx % (t1 - t0);
      qabs[(static_cast<int64_t>(r0 + r) * sh.heads + h) * sh.latent + e] = ctx.in(0, r0 + r)[h * sh.qk + sh.nope + e - sh.rank];
    }
    float* part = qs + ((n * sh.nope + 3) & ~3);  // 16-byte aligned (qs is: red + 32 floats)
    uint8_t* stage = reinterpret_cast<uint8_t*>(part + kThreads * 8);
    const int stage_bytes = static_cast<int>(kSharedBytes - 4 * (32 + (part + kThreads * 8 - red)));  // red: 32 floats into the op's smem
    // One row (batch 1) keeps 8 accumulators a thread, a block of rows 64.
    if (c1 > c0 && n == 1) {
      mla_absorb_cols<1>(ctx, sh, h, r0, n, c0, c1, qs, part, stage, stage_bytes, qabs);  // ends with __syncthreads
    } else if (c1 > c0) {
      mla_absorb_cols<kMlaRowBlock>(ctx, sh, h, r0, n, c0, c1, qs, part, stage, stage_bytes, qabs);
    }
    if (h == 0 && it.part == 0) mla_append_latents(ctx, sh, r0, n, red);
    return;
  }
  const int c0 = mla_part_begin(sh.rank, it.part, parts), c1 = mla_part_begin(sh.rank, it.part + 1, parts);
  for (int j = static_cast<int>(threadIdx.x); j < c1 - c0 + t1 - t0; j += kThreads) {
    const int e = j < c1 - c0 ? c0 + j : sh.rank + t0 + (j - (c1 - c0));
    float acc[kMlaRowBlock];
#pragma unroll
    for (int r = 0; r < kMlaRowBlock; ++r) acc[r] = r < n && e >= sh.rank ? ctx.in(0, r0 + r)[h * sh.qk + sh.nope + e - sh.rank] : 0.0f;
    if (e < sh.rank) {
      const int64_t base = static_cast<int64_t>(h) * sh.per_head * sh.rank + e;
      // 16 weight loads in flight per thread (8 left the item latency-bound on W_UK: ~16 µs a head).
#pragma unroll 16
      for (int i = 0; i < sh.nope; ++i) {
        const float w = weight_flat(kv_b, base + static_cast<int64_t>(i) * sh.rank);
#pragma unroll
        for (int r = 0; r < kMlaRowBlock; ++r) {
          if (r < n) acc[r] += qs[r * sh.nope + i] * w;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kMlaRowBlock; ++r) {
      if (r < n) qabs[(static_cast<int64_t>(r0 + r) * sh.heads + h) * sh.latent + e] = acc[r];
    }
  }
  if (h == 0 && it.part == 0) mla_append_latents(ctx, sh, r0, n, red);  // ends with __syncthreads
}

// Cache rows [r0, r0 + n) (contiguous, elements of type elem) into registers as fp32,
// kMlaStagePerThread per thread.
__device__ __forceinline__ void mla_fetch_tile(const uint8_t* cache, int32_t elem, int r0, int n, int latent, float (&pre)[kMlaStagePerThread]) {
  const int64_t first = static_cast<int64_t>(r0) * latent;
#pragma unroll
  for (int i = 0; i < kMlaStagePerThread; ++i) {
    const int idx = static_cast<int>(threadIdx.x) + i * kThreads;
    pre[i] = idx < n * latent ? load_state_elem(cache, elem, first + idx) : 0.0f;
  }
}

// Shared memory of a B item (floats): q_abs of the group, the staged rows, scores/probabilities [j][r],
// and per query the running max, sum and this tile's rescale.
struct MlaSplitSmem {
  float *qvec, *tile, *p, *m, *l, *alpha;
};

// Online-softmax update of tile rows [0, n) for every query: max, rescale alpha, p in place of the score.
__device__ inline void mla_tile_softmax(const MlaSplitSmem& sm, int nq, int n) {
  const int j = static_cast<int>(threadIdx.x);
  if (j >= nq) return;
  float* p = sm.p + j * kMlaTileRows;
  float tile_max = -INFINITY;
  for (int r = 0; r < n; ++r) tile_max = fmaxf(tile_max, p[r]);
  const float m_new = fmaxf(sm.m[j], tile_max);
  if (m_new == -INFINITY) {  // nothing visible to this query yet
    sm.alpha[j] = 1.0f;
    for (int r = 0; r < n; ++r) p[r] = 0.0f;
    return;
  }
  sm.alpha[j] = expf(sm.m[j] - m_new);  // 0 while m was −∞
  float sum = 0.0f;
  for (int r = 0; r < n; ++r) sum += (p[r] = expf(p[r] - m_new));
  sm.l[j] = sm.l[j] * sm.alpha[j] + sum;
  sm.m[j] = m_new;
}

// Where B item ib works: its sequence, the sequence's context and first row, its queries [q0, q0 + nq)
// of that sequence (query q: token q / heads, head q % heads) and its cache positions [begin, stop),
// cut at the group's causal bound. Both B bodies (here and mla_mma.cuh) take their item from it.
struct MlaBItem {
  int seq, context, first, q0, nq, begin, stop;
};

__device__ inline MlaBItem mla_b_item(const StepView& step, const MlaShape& sh, const MlaSchedule& sched, int ib) {
  int s = 0;
  MlaSeqItems si = mla_seq_items(step, sh, sched.split_rows, 0);
  while (ib >= si.base + si.groups * si.splits) si = mla_seq_items(step, sh, sched.split_rows, ++s);
  const int k = (ib - si.base) / si.groups, gq = (ib - si.base) % si.groups;
  MlaBItem it;
  it.seq = s;
  it.context = step.seq_context[s];
  it.first = step.seq_first_row[s];
  it.q0 = gq * kMlaGroup;
  it.nq = step.seq_tokens[s] * sh.heads - it.q0 < kMlaGroup ? step.seq_tokens[s] * sh.heads - it.q0 : kMlaGroup;
  it.begin = k * sched.split_rows;
  const int last_visible = it.context + (it.q0 + it.nq - 1) / sh.heads + 1;  // causal bound of the group
  it.stop = it.begin + sched.split_rows < last_visible ? it.begin + sched.split_rows : last_visible;
  return it;
}

// B item ib: positions [k·split_rows, …) of one sequence against query group gq (queries q0 + j, token
// q / heads, head q % heads). Writes (max, sum) and u = Σ exp(s − max)·c of each query.
__device__ __noinline__ void mla_split_item(const TaskCtx& ctx, const MlaShape sh, const MlaSchedule sched, int ib, const MlaWorkspace ws, float* smem) {
  const StepView& step = *ctx.step;
  const MlaBItem it = mla_b_item(step, sh, sched, ib);
  const int s = it.seq, context = it.context, first = it.first, q0 = it.q0, nq = it.nq, begin = it.begin, stop = it.stop;
  MlaSplitSmem st;
  st.qvec = smem;                                  // [kMlaGroup][latent]
  st.tile = st.qvec + kMlaGroup * sh.latent;       // [kMlaTileRows][latent]
  st.p = st.tile + kMlaTileRows * sh.latent;       // [kMlaGroup][kMlaTileRows]
  st.m = st.p + kMlaGroup * kMlaTileRows;          // [kMlaGroup] each
  st.l = st.m + kMlaGroup;
  st.alpha = st.l + kMlaGroup;
  for (int idx = static_cast<int>(threadIdx.x); idx < nq * sh.latent; idx += kThreads) {
    const int qi = q0 + idx / sh.latent;
    st.qvec[idx] = __ldcg(ws.qabs + (static_cast<int64_t>(first + qi / sh.heads) * sh.heads + qi % sh.heads) * sh.latent + idx % sh.latent);
  }
  if (threadIdx.x < kMlaGroup) st.m[threadIdx.x] = -INFINITY, st.l[threadIdx.x] = 0.0f;
  const uint8_t* cache = state_bytes_of(ctx, step.seq_slot[s]);
  const int32_t elem = step.states[ctx.op->state].elem;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  float u[kMlaGroup];
#pragma unroll
  for (int j = 0; j < kMlaGroup; ++j) u[j] = 0.0f;
  float pre[kMlaStagePerThread];
  if (begin < stop) mla_fetch_tile(cache, elem, begin, stop - begin < kMlaTileRows ? stop - begin : kMlaTileRows, sh.latent, pre);
  for (int r0 = begin; r0 < stop; r0 += kMlaTileRows) {
    const int n = stop - r0 < kMlaTileRows ? stop - r0 : kMlaTileRows;
#pragma unroll
    for (int i = 0; i < kMlaStagePerThread; ++i) {
      if (tid + i * kThreads < n * sh.latent) st.tile[tid + i * kThreads] = pre[i];
    }
    __syncthreads();  // the tile (and, the first time, qvec and the stats) are in place
    const int next = r0 + kMlaTileRows;
    if (next < stop) mla_fetch_tile(cache, elem, next, stop - next < kMlaTileRows ? stop - next : kMlaTileRows, sh.latent, pre);  // in flight meanwhile
    if (warp < n) {  // warp w scores row r0 + w against every query
      float x[kMlaLatentPerLane];
      mla_load_row(st.tile + warp * sh.latent, sh.latent, lane, x);
      for (int j = 0; j < nq; ++j) {
        const float score = mla_score(x, st.qvec + j * sh.latent, sh.latent, lane, sh.scale);
        if (lane == 0) st.p[j * kMlaTileRows + warp] = r0 + warp < context + (q0 + j) / sh.heads + 1 ? score : -INFINITY;
      }
    }
    __syncthreads();
    mla_tile_softmax(st, nq, n);
    __syncthreads();
    if (tid < sh.rank) {
#pragma unroll
      for (int j = 0; j < kMlaGroup; ++j) {
        if (j >= nq) continue;
        float acc = u[j] * st.alpha[j];
        for (int r = 0; r < n; ++r) acc += st.p[j * kMlaTileRows + r] * st.tile[r * sh.latent + tid];
        u[j] = acc;
      }
    }
    __syncthreads();  // tile and p are rewritten by the next tile
  }
  __syncthreads();  // the stats, when no tile ran
  const int64_t rec = static_cast<int64_t>(ib) * kMlaGroup;
  if (tid < nq) ws.part_ml[(rec + tid) * 2] = st.m[tid], ws.part_ml[(rec + tid) * 2 + 1] = st.l[tid];
  if (tid < sh.rank) {
#pragma unroll
    for (int j = 0; j < kMlaGroup; ++j) {
      if (j < nq) ws.part_u[(rec + j) * sh.rank + tid] = u[j];
    }
  }
}

#ifndef PLOW_CUDA_EMU
// W_UV with 16-byte weight loads (bf16/f16 kv_b, rank a multiple of 256: two chunks of 8 per lane):
// warp w takes value rows two at a time with all their loads in flight (the scalar loop
// read 2 bytes a lane per load, ~30 µs a head at batch 1).
__device__ __forceinline__ bool mla_uv_vector(const DeviceWeight& kv_b, const MlaShape& sh) {
  return (kv_b.type == kWBF16 || kv_b.type == kWF16) && sh.rank % 256 == 0 && sh.rank <= kMlaMaxRank;
}

// Value rows [i_begin, i_end) of head h for the block's rows r0 + [0, n).
__device__ __noinline__ void mla_uv_rows(const TaskCtx& ctx, const MlaShape sh, int h, int r0, int n, int i_begin, int i_end, const float* usum) {
  const DeviceWeight& kv_b = ctx.weight(1);
  const int lane = lane_id(), chunks = sh.rank / 8 / 32;  // 16-byte chunks per lane and row (≤ 2)
  constexpr int kRowsAtOnce = 2, kMaxChunks = kMlaMaxRank / 8 / 32;
  for (int i0 = i_begin + warp_id() * kRowsAtOnce; i0 < i_end; i0 += kWarps * kRowsAtOnce) {
    uint4 v[kRowsAtOnce][kMaxChunks];
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) {
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        const int64_t row = static_cast<int64_t>(h) * sh.per_head + sh.nope + i0 + q;
        if (i0 + q < i_end && c < chunks) v[q][c] = load_stream(kv_b.data + (row * sh.rank + (lane + 32 * c) * 8) * 2);
      }
    }
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) {
      if (i0 + q >= i_end) break;  // warp-uniform
      float acc[kMlaRowBlock];
#pragma unroll
      for (int r = 0; r < kMlaRowBlock; ++r) acc[r] = 0.0f;
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) {
        if (c >= chunks) break;
        float f[8];
        unpack8(v[q][c], kv_b.type, f);
        const int e = (lane + 32 * c) * 8;
#pragma unroll
        for (int r = 0; r < kMlaRowBlock; ++r) {
          if (r >= n) break;
          const float* u = usum + r * sh.rank + e;
          acc[r] += f[0] * u[0] + f[1] * u[1] + f[2] * u[2] + f[3] * u[3] + f[4] * u[4] + f[5] * u[5] + f[6] * u[6] + f[7] * u[7];
        }
      }
#pragma unroll
      for (int r = 0; r < kMlaRowBlock; ++r) {
        if (r >= n) break;
        const float total = warp_sum(acc[r]);
        if (lane == 0) ctx.out(r0 + r)[static_cast<int64_t>(h) * sh.dv + i0 + q] = round_out(ctx, total);
      }
    }
  }
}
#endif

// C item: for each row of the block, head h: u = Σ_k e^(m_k − M)·u_k / Σ_k e^(m_k − M)·l_k over the
// query's splits (all of u: every part needs it), then out[row][h·dv + i] = act(W_UV,h[i]·u) for the
// part's value rows [i_begin, i_end) (one read of those rows of W_UV,h for the block).
__device__ __noinline__ void mla_combine_item(const TaskCtx& ctx, const MlaShape sh, const MlaSchedule sched, int item, const MlaWorkspace ws, float* smem) {
  const StepView& step = *ctx.step;
  const MlaAcItem it = mla_ac_item(ctx, sh, sched.ac_parts, item);
  const int h = it.h, r0 = it.r0, n = it.n;
  const int i_begin = mla_part_begin(sh.dv, it.part, sched.ac_parts), i_end = mla_part_begin(sh.dv, it.part + 1, sched.ac_parts);
  float* wts = smem;                    // [kMlaMaxSplits]
  float* usum = wts + kMlaMaxSplits;    // [kMlaRowBlock][rank]
  float* red = usum + kMlaRowBlock * sh.rank;  // 32
  const int tid = static_cast<int>(threadIdx.x);
  for (int r = 0; r < n; ++r) {
    const int s = step.row_seq[r0 + r];
    const int qi = (r0 + r - step.seq_first_row[s]) * sh.heads + h;
    const MlaSeqItems si = mla_seq_items(step, sh, sched.split_rows, s);
    auto record = [&](int k) { return (static_cast<int64_t>(si.base + k * si.groups + qi / kMlaGroup)) * kMlaGroup + qi % kMlaGroup; };
    float mx = -INFINITY;
    for (int k = tid; k < si.splits; k += kThreads) mx = fmaxf(mx, __ldcg(ws.part_ml + 2 * record(k)));
    const float top = mla_block_max(mx, red);  // finite: split 0 holds position 0, visible to every query
    float lsum = 0.0f;
    for (int k = tid; k < si.splits; k += kThreads) {
      const float mk = __ldcg(ws.part_ml + 2 * record(k));
      const float w = mk == -INFINITY ? 0.0f : expf(mk - top);
      wts[k] = w;
      lsum += w * __ldcg(ws.part_ml + 2 * record(k) + 1);
    }
    const float total = block_sum(lsum, red);  // its barriers also publish wts
    // Σ_k wts[k]·u_k in split order. The partials come by cp.async into shared memory, a chunk of splits
    // at a time, all of a chunk's copies in flight (ncu, batch 1 × 4096, 65 splits: the loop over
    // __ldcg loads, three or four in flight as ptxas scheduled them, was half the op's time, ~1 µs a
    // split). Ranks off 16-byte rows keep the loads.
    const float* u0 = ws.part_u + record(0) * sh.rank;
    const int64_t step_u = static_cast<int64_t>(si.groups) * kMlaGroup * sh.rank;
    float* stage = red + 32;  // [chunk][rank], in the rest of the item's shared memory
    const int chunk = static_cast<int>((kSharedBytes / 4 - 32 - (stage - smem)) / sh.rank);
    if (sh.rank % 4 == 0 && chunk >= 1) {
      float acc = 0.0f;
      for (int k0 = 0; k0 < si.splits; k0 += chunk) {
        const int m = si.splits - k0 < chunk ? si.splits - k0 : chunk, quads = sh.rank / 4;
        for (int i = tid; i < m * quads; i += kThreads) {
          const int k = i / quads, c = 4 * (i % quads);
          cp_async16(stage + k * sh.rank + c, u0 + (k0 + k) * step_u + c);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        if (tid < sh.rank) {
          for (int k = 0; k < m; ++k) acc += wts[k0 + k] * stage[k * sh.rank + tid];
        }
        __syncthreads();  // the stage is rewritten by the next chunk
      }
      if (tid < sh.rank) usum[r * sh.rank + tid] = acc / total;
    } else {
      for (int e = tid; e < sh.rank; e += kThreads) {
        float acc = 0.0f;
#pragma unroll 8
        for (int k = 0; k < si.splits; ++k) acc += wts[k] * __ldcg(u0 + k * step_u + e);
        usum[r * sh.rank + e] = acc / total;
      }
    }
    __syncthreads();  // wts is rewritten by the next row; usum is read below
  }
  const DeviceWeight& kv_b = ctx.weight(1);
  const int lane = lane_id();
#ifndef PLOW_CUDA_EMU
  if (mla_uv_vector(kv_b, sh)) {
    mla_uv_rows(ctx, sh, h, r0, n, i_begin, i_end, usum);
    return;
  }
#endif
  for (int i = i_begin + warp_id(); i < i_end; i += kWarps) {
    const int64_t row = static_cast<int64_t>(h) * sh.per_head + sh.nope + i;
    float acc[kMlaRowBlock];
#pragma unroll
    for (int r = 0; r < kMlaRowBlock; ++r) acc[r] = 0.0f;
    for (int e = lane; e < sh.rank; e += 32) {
      const float w = weight_flat(kv_b, row * sh.rank + e);
#pragma unroll
      for (int r = 0; r < kMlaRowBlock; ++r) {
        if (r < n) acc[r] += w * usum[r * sh.rank + e];
      }
    }
#pragma unroll
    for (int r = 0; r < kMlaRowBlock; ++r) {
      if (r >= n) continue;  // warp-uniform
      const float v = warp_sum(acc[r]);
      if (lane == 0) ctx.out(r0 + r)[static_cast<int64_t>(h) * sh.dv + i] = round_out(ctx, v);
    }
  }
}

}  // namespace plow::cuda

#include "runtime/cuda/ops/mla_mma.cuh"  // the B item on tensor cores (uses the schedule and workspace above)

namespace plow::cuda {

// Whether every sequence fits its slot and the workspace holds the step; if not, every task reports
// and leaves without touching the counters (all see the same step).
__device__ inline bool mla_step_fits(const TaskCtx& ctx, const MlaShape& sh, const MlaSchedule& sched) {
  const StepView& step = *ctx.step;
  const DeviceState& state = step.states[ctx.op->state];
  for (int s = 0; s < step.num_seqs; ++s) {
    if (static_cast<int64_t>(step.seq_context[s]) + step.seq_tokens[s] > state.depth) {
      if (threadIdx.x == 0) report_error(ctx, kErrContext);
      return false;
    }
  }
  if (ctx.op->sync == nullptr || mla_workspace_floats(sh, step.tokens, sched.b_items) > ctx.op->workspace_floats) {
    if (threadIdx.x == 0) report_error(ctx, kErrWorkspace);
    return false;
  }
  return true;
}

// kMlaAttention (heads; one task per worker, split-KV). Inputs q [T, heads·(nope+rope)], kv_a [T,
// rank+rope]; weights kv_a_layernorm [rank], kv_b [heads·(nope+v), rank]. State: latent cache rows
// [max_context, rank+rope] per slot (DeviceState.depth = max_context rows; past it: kErrContext, the step
// is refused). attrs: [0] heads, [1] nope, [2] rope, [3] v, [4] rank, [5] eps (kv_a norm). Requires
// rank ≤ 512 and rank + rope ≤ 576 (pack_misc_attrs refuses others), OpDesc workspace and sync.
__device__ __noinline__ void op_mla_attention(const TaskCtx& ctx) {
  const MlaShape sh = mla_shape(ctx);
  const MlaSchedule sched = mla_schedule(ctx, sh);
  if (!mla_step_fits(ctx, sh, sched)) return;
  const int a_items = sched.a_items, b_items = sched.b_items, total = 2 * a_items + b_items;  // C: as many as A
  float* const ws_base = ctx.op->workspace;
  const int64_t qabs_floats = mla_qabs_floats(sh, ctx.rows());
  const MlaWorkspace ws{ws_base, ws_base + qabs_floats, ws_base + qabs_floats + static_cast<int64_t>(b_items) * kMlaGroup * 2};
  unsigned* const sync = ctx.op->sync;
  float* const smem = smem_floats(ctx) + 32;  // after the ticket
  for (;;) {
    const int item = take_ticket(ctx, sync);
    if (item >= total) break;  // block-uniform
    if (item < a_items) {
      mla_absorb_item(ctx, sh, sched.ac_parts, item, ws.qabs, smem);
      block_arrive(sync + 1);
    } else if (item < a_items + b_items) {
      block_wait(sync + 1, a_items);
      if (mla_mma_fits(ctx, sh)) {
        mla_split_item_mma(ctx, sh, sched, item - a_items, ws, smem);
      } else {
        mla_split_item(ctx, sh, sched, item - a_items, ws, smem);
      }
      block_arrive(sync + 2);
    } else {
      block_wait(sync + 2, b_items);
      mla_combine_item(ctx, sh, sched, item - a_items - b_items, ws, smem);
      __syncthreads();
    }
  }
  op_leave(ctx, sync + 3);
}

}  // namespace plow::cuda
