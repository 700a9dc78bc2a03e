// MLA attention of a prefill step on tensor cores (issue H): on the GEMM path (prefill_gemm.h) a plan's
// mla_attention op runs on the host between megakernel segments, in the EXPANDED form of the CPU
// reference (cpu/ops/mla.cpp) with its rounding points: the step's latent rows appended to the cache
// (the op body's rounding), then per sequence kv = act(c·kv_bᵀ) over every visible position (two
// strided-batched GEMMs, heads as the batch), then the attention: bf16 and f16 models in one fused
// flash-attention kernel (mla_flash.cuh: P rounded before P·V, not after normalizing; the error it
// adds is bounded there); fp32 models (and heads wider than the kernel's) as S = q·Kᵀ·scale (fp32), a
// causal softmax with P rounded to the activation dtype, O = P·V (fp32 accumulate), rounded as the
// op's output, the scores in blocks of query rows × heads that never exceed a fixed budget. Internal
// to src/runtime/cuda (backend.cpp, prefill_gemm.cpp).
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "plan/plan.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/mla_flash.h"
#include "runtime/cuda/stream_timer.h"

namespace plow::cuda {

// A step takes the MLA GEMMs when one of its sequences brings at least this many tokens: the expansion
// c·kv_bᵀ costs as much per cached position as ~400 query rows' attention (48B shape), so steps of
// decode rows only (short sequences beside each other) keep the absorbed op body.
inline constexpr int64_t kMlaGemmMinTokens = 32;

// One mla_attention op as GEMMs. Inputs q [T, heads·(nope+rope)] and kv_a [T, rank+rope] (rows at
// arena + offset, row stride in floats); output [T, heads·v] at out_offset (row stride width). The
// state index names the latent cache (fp32 rows [max_context, rank+rope] per slot).
// K3's output gate fused (gate_op ≥ 0): the op's only reader is the sigmoid_mul `gate_op` of its output
// and a gate computed before it (rows at gate_offset, row stride gate_stride); the epilogue writes
// that op's output (out_offset is then gate_op's), whose tasks only round in place (a no-op), and the
// attention's own output rows are left unwritten.
struct MlaGemmOp {
  DeviceWeight norm, kv_b;  // kv_a_layernorm [rank]; kv_b [heads·(nope+v), rank] (this rank's heads)
  int64_t q_offset = 0, q_stride = 0, kv_a_offset = 0, kv_a_stride = 0;
  int64_t out_offset = 0, width = 0;
  int32_t gate_op = -1;
  int64_t gate_offset = 0, gate_stride = 0;
  int64_t heads = 0, nope = 0, rope = 0, dv = 0, rank = 0;
  float eps = 0, scale = 0;  // kv_a norm ε; (nope + rope)^(−1/2)
  int32_t state = -1;
  int32_t act = kAF32;
  int32_t type = kWF32;   // GEMM element type: kv_b's, which is the activations' (bf16, f16 or fp32)
  bool round_out = true;  // the op's output is in the activation dtype

  int64_t latent() const { return rank + rope; }
  int64_t qk() const { return nope + rope; }
  int64_t per_head() const { return nope + dv; }
  bool flash() const { return mla_flash_fits(qk(), dv, type); }  // attention in the fused kernel, not in score blocks
  bool wgmma() const { return mla_wgmma_fits(qk(), dv, type); }  // that kernel on wgmma, over values expanded transposed
};

// The GEMM form of `op` (a kMlaAttention) with its weights on the device, when it has one: kv_b dense
// and of the activation dtype (bf16 and f16 with those activations, fp32 with fp32 ones), so every GEMM
// input (latents, raw k_r, q, P) is exact in it; q and kv_a in the activation dtype. Else nullopt.
// `index`: op's index in the plan (its readers decide whether the output gate fuses).
std::optional<MlaGemmOp> mla_gemm_form(const Plan& plan, int32_t index, const std::vector<DeviceWeight>& weights, int32_t act);

// Device memory the MLA GEMMs of some plans need: the most step rows and heads, the widest rows (padded
// to 8 elements), the GEMM element size and whether an op attends in score blocks (the queries, scores,
// probabilities and outputs buffers exist only then); with the backend's max context it sizes
// MlaGemmRunner.
struct MlaGemmCapacity {
  int64_t rows = 0, heads = 0, rank = 0, qk = 0, dv = 0, head_rows = 0;  // head_rows: heads·rows
  int64_t elem_bytes = 0;
  bool blocks = false;
  void add(const MlaGemmOp& op, int64_t max_rows);
  void merge(const MlaGemmCapacity& other);
};

// One sequence of the step as the host uploaded it: slot, first row, query tokens, cached positions.
struct MlaSequence {
  int32_t slot = 0;
  int64_t first_row = 0, tokens = 0, context = 0;
};

// How a sequence's scores are split: blocks of query_rows rows × head_group heads, each block's fp32
// scores [head_group, query_rows, ≤ visible padded] within scores_floats.
struct MlaBlocking {
  int64_t query_rows = 0, head_group = 0;
};
MlaBlocking mla_blocking(int64_t tokens, int64_t visible, int64_t heads, int64_t scores_floats);

// Runs MLA ops on one stream. Per GEMM step: new_step(), then run() for each MLA host op in plan order.
class MlaGemmRunner {
 public:
  // Buffers for `capacity` at max_context positions; the scores of one block stay within scores_bytes
  // (at least one head's one query row at max_context).
  MlaGemmRunner(const MlaGemmCapacity& capacity, int64_t max_context, int64_t scores_bytes, cudaStream_t stream);
  ~MlaGemmRunner();
  MlaGemmRunner(const MlaGemmRunner&) = delete;
  MlaGemmRunner& operator=(const MlaGemmRunner&) = delete;

  void new_step() {  // the last step has finished: its timing events are read
    timer_.harvest();
    attend_timer_.harvest();
  }
  // The op over the step: its latent rows appended to `cache`, its output rows written, final.
  void run(const MlaGemmOp& op, float* arena, const DeviceState& cache, const std::vector<MlaSequence>& seqs);

  int64_t calls() const { return calls_; }    // ops run
  int64_t blocks() const { return blocks_; }  // score blocks run (tests: that the budget split a sequence)
  int64_t flash() const { return flash_; }    // sequences attended by the fused kernel
  int64_t wgmma_flash() const { return wgmma_flash_; }  // of those, on the wgmma kernel
  int64_t gated() const { return gated_; }   // ops run with the output gate in their epilogue
  // Benchmarks: the heads that take the wgmma kernel on the mma.sync one (mla_flash.cuh) instead, over
  // values expanded row by row.
  void set_prefer_mma_sync(bool on) { mma_sync_ = on; }
  // Timing (benchmarks): with it on, each op's stream time is added up, and apart the attention alone
  // (the fused kernel, or the score blocks: the work PyTorch SDPA does, without the latents' append
  // and the K/V expansion); timed_ms() and attend_ms() synchronize.
  void set_timing(bool on) { timing_ = on; }
  double timed_ms() { return timer_.total_ms(); }
  double attend_ms() { return attend_timer_.total_ms(); }
  void reset_timed_ms() {
    timer_.reset();
    attend_timer_.reset();
  }

 private:
  void expand(const MlaGemmOp& op, const uint8_t* cache_slot, int32_t cache_elem, int64_t visible);
  void attend(const MlaGemmOp& op, float* arena, const MlaSequence& seq);

  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  MlaGemmCapacity capacity_;
  int64_t max_context_ = 0, scores_floats_ = 0;
  DeviceBuffer workspace_, latents_, keys_, values_, queries_, scores_, probs_, outputs_;
  int64_t calls_ = 0, blocks_ = 0, flash_ = 0, wgmma_flash_ = 0, gated_ = 0;
  bool mma_sync_ = false;
  bool wgmma(const MlaGemmOp& op) const { return op.wgmma() && !mma_sync_; }
  bool timing_ = false;
  StreamTimer timer_, attend_timer_;
};

// ---- device side (mla_gemm.cu) ------------------------------------------------------------------------

// Rows [0, tokens) of kv_a (row stride kv_stride) into cache rows [0, tokens) (row stride rank + rope,
// elements of type cache_elem, DeviceState::elem): c = act(w ⊙ act(c̃·rsqrt(mean c̃² + ε))), k_r raw, as
// the op body (ops/mla.cuh mla_append_latents).
void launch_mla_append(const float* kv_a, int64_t kv_stride, int64_t tokens, const DeviceWeight& norm, float eps, int64_t rank, int64_t rope, int32_t act,
                       uint8_t* cache, int32_t cache_elem, cudaStream_t stream);
// Cache rows [0, visible) (elements of type cache_elem) into the GEMM inputs of type `type`: latents
// [visible, ld_c] (the rank part), and k_r into columns [nope, nope + rope) of every head's key rows
// keys[h][τ][ld_k] (head h at h·visible·ld_k), zeros into their columns [nope + rope, ld_k) (the fused
// kernel reads whole rows).
void launch_mla_inputs(const uint8_t* cache, int32_t cache_elem, int64_t visible, int64_t rank, int64_t rope, int64_t heads, int64_t nope, void* latents,
                       int64_t ld_c, void* keys, int64_t ld_k, int32_t type, cudaStream_t stream);
// q rows [0, tokens) (row stride q_stride; head h at h·qk) into queries[t][h·ld_q + i] of type `type`.
void launch_mla_queries(const float* q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t qk, void* queries, int64_t ld_q, int32_t type,
                        cudaStream_t stream);
// Per row r of `rows` (row r = query r % query_rows of its head, scores at r·ld): the softmax over the
// first first_visible + r % query_rows positions (the causal bound), written as act-rounded P of type
// `type` at probs + r·ld, zeros at positions [visible, length).
void launch_mla_softmax(const float* scores, int64_t ld, int64_t rows, int64_t query_rows, int64_t first_visible, int64_t length, void* probs, int32_t type,
                        int32_t act, cudaStream_t stream);
// The fused attention of one sequence (mla_flash.cuh), `type` bf16 or f16; every head, every query row.
void launch_mla_flash(const MlaFlashArgs& args, int32_t type, cudaStream_t stream);
// The same on wgmma (mla_wgmma.cu) for heads that mla_wgmma_fits, values transposed (args.ld_vt > 0).
void launch_mla_wgmma(const MlaFlashArgs& args, int32_t type, cudaStream_t stream);
// The block's outputs o[g][t][ld_o] (fp32) into out rows [t]: out[t·width + g·dv + i], rounded to the
// activation dtype when round_out; with `gate` (row t's at gate + t·gate_stride, the block's first head
// at column 0) then act(o'·σ(g)) as sigmoid_mul computes it.
void launch_mla_scatter(const float* o, int64_t ld_o, int64_t group, int64_t rows, int64_t dv, float* out, int64_t width, int32_t act, bool round_out,
                        const float* gate, int64_t gate_stride, cudaStream_t stream);

}  // namespace plow::cuda
