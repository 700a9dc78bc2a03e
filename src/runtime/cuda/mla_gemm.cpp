// MLA prefill as GEMMs (mla_gemm.h): which mla_attention ops take them, the buffers sized for a plan's
// largest step at the backend's maximum context, and per sequence the expansion through cuBLAS
// (strided-batched over heads; fp32 accumulate, pedantic fp32 for fp32), then the fused attention
// kernel (bf16, f16) or the blocked scores, softmax and P·V through cuBLAS (fp32).
#include "runtime/cuda/mla_gemm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace plow::cuda {

namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("cuda: cuBLAS MLA {}: {}", what, cublasGetStatusString(status));
}

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Query rows of a score block, at most: a block computes every row's scores up to its last row's
// causal bound, so a first chunk of n·256 rows does (n+1)/n of the causal work (1.25 at 1024).
constexpr int64_t kMaxQueryRows = 256;
// Query rows below which a block splits heads instead (fewer rows make thin GEMMs).
constexpr int64_t kMinQueryRows = 64;

// Rows of the GEMM buffers in whole 16-byte units (8 half elements), so every head's and block's
// first element is aligned as cuBLAS's tensor-core kernels want.
int64_t padded(int64_t cols) { return (cols + 7) / 8 * 8; }

int64_t type_bytes(int32_t type) { return type == kWF32 ? 4 : 2; }

cudaDataType data_type(int32_t type) { return type == kWBF16 ? CUDA_R_16BF : type == kWF16 ? CUDA_R_16F : CUDA_R_32F; }

// fp32: pedantic, never TF32, whatever NVIDIA_TF32_OVERRIDE says (as GemmRunner).
cublasComputeType_t compute_type(int32_t type) { return type == kWF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F; }

bool dense(const DeviceWeight& w) { return w.parts == 1 && (w.type == kWF32 || w.type == kWBF16 || w.type == kWF16); }

int64_t attr(const PlanOp& op, const char* name) { return op.attrs.has(name) ? static_cast<int64_t>(op.attrs.get(name)) : 0; }

// One strided-batched GEMM; pointers in bytes, strides and leading dimensions in elements.
struct Operand {
  const void* ptr;
  cudaDataType type;
  int64_t ld, stride;
};

// Arena floats a view's rows [0, rows) span.
struct Span {
  int64_t begin, end;
};
Span span(const ActivationView& v, int64_t rows) { return {v.offset, v.offset + (rows - 1) * v.row_stride + v.width}; }
bool overlap(Span a, Span b) { return a.begin < b.end && b.begin < a.end; }

// K3's output gate into op `index`'s epilogue (MlaGemmOp): its only reader is a sigmoid_mul of its
// output with a gate of the activation dtype that an earlier op computed, whose own output is of the
// activation dtype and shares no arena float with the attention's inputs or the gate (the epilogue
// writes it while other blocks still read them).
void fuse_output_gate(const Plan& plan, int32_t index, MlaGemmOp& m) {
  int32_t reader = -1;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    for (int32_t in : plan.ops[i].inputs) {
      if (in != index) continue;
      if (reader >= 0) return;
      reader = static_cast<int32_t>(i);
    }
  }
  if (reader < 0 || plan.output_op == index) return;
  const PlanOp& mul = plan.op(reader);
  if (mul.op() != Op::kSigmoidMul || mul.inputs.size() != 2 || mul.inputs[0] != index || mul.inputs[1] >= index) return;
  if (mul.dtype != OutDType::kAct || mul.width != m.width || plan.op(mul.inputs[1]).dtype != OutDType::kAct) return;
  const ActivationView gate = activation_view(plan, mul.inputs[1]);
  if (gate.width != m.width) return;
  const int64_t rows = plan.max_tokens;
  const Span out{mul.offset, mul.offset + rows * mul.width};
  const PlanOp& op = plan.op(index);
  for (int32_t in : op.inputs) {
    if (overlap(out, span(activation_view(plan, in), rows))) return;
  }
  if (overlap(out, span(gate, rows))) return;
  m.gate_op = reader;
  m.gate_offset = gate.offset;
  m.gate_stride = gate.row_stride;
  m.out_offset = mul.offset;
}

}  // namespace

std::optional<MlaGemmOp> mla_gemm_form(const Plan& plan, int32_t index, const std::vector<DeviceWeight>& weights, int32_t act) {
  const PlanOp& op = plan.op(index);
  if (op.op() != Op::kMlaAttention || op.inputs.size() != 2 || weights.size() != 2 || op.state < 0) return std::nullopt;
  MlaGemmOp m;
  m.norm = weights[0];
  m.kv_b = weights[1];
  m.heads = attr(op, "heads");
  m.nope = attr(op, "nope");
  m.rope = attr(op, "rope");
  m.dv = attr(op, "v");
  m.rank = attr(op, "rank");
  if (m.heads < 1 || m.nope < 0 || m.rope < 0 || m.dv < 1 || m.rank < 1 || m.qk() < 1) return std::nullopt;
  // kv_b of the activation dtype: every GEMM input is an activation (or P) already rounded to it.
  const int32_t type = m.kv_b.type;
  const bool same = (type == kWBF16 && act == kABF16) || (type == kWF16 && act == kAF16) || (type == kWF32 && act == kAF32);
  if (!same || !dense(m.kv_b) || !dense(m.norm)) return std::nullopt;
  if (m.kv_b.rows != m.heads * m.per_head() || m.kv_b.cols != m.rank || m.norm.rows * m.norm.cols != m.rank) return std::nullopt;
  const PlanOp& q = plan.op(op.inputs[0]);
  const PlanOp& kv_a = plan.op(op.inputs[1]);
  if (q.width != m.heads * m.qk() || kv_a.width != m.latent() || op.width != m.heads * m.dv) return std::nullopt;
  if (q.dtype != OutDType::kAct || kv_a.dtype != OutDType::kAct) return std::nullopt;
  const ActivationView qv = activation_view(plan, op.inputs[0]), kv = activation_view(plan, op.inputs[1]);
  m.q_offset = qv.offset;
  m.q_stride = qv.row_stride;
  m.kv_a_offset = kv.offset;
  m.kv_a_stride = kv.row_stride;
  m.out_offset = op.offset;
  m.width = op.width;
  m.eps = static_cast<float>(op.attrs.has("eps") ? op.attrs.get("eps") : 0.0);
  m.scale = 1.0f / std::sqrt(static_cast<float>(m.qk()));  // (d_n + d_r)^(−1/2), no mscale, as the CPU
  m.state = op.state;
  m.act = act;
  m.type = type;
  m.round_out = op.dtype == OutDType::kAct;
  fuse_output_gate(plan, index, m);
  return m;
}

void MlaGemmCapacity::add(const MlaGemmOp& op, int64_t max_rows) {
  rows = std::max(rows, max_rows);
  heads = std::max(heads, op.heads);
  rank = std::max(rank, padded(op.rank));
  qk = std::max(qk, padded(op.qk()));
  dv = std::max(dv, padded(op.dv));
  head_rows = std::max(head_rows, op.heads * max_rows);
  elem_bytes = std::max(elem_bytes, type_bytes(op.type));
  blocks = blocks || !op.flash();
}

void MlaGemmCapacity::merge(const MlaGemmCapacity& o) {
  rows = std::max(rows, o.rows);
  heads = std::max(heads, o.heads);
  rank = std::max(rank, o.rank);
  qk = std::max(qk, o.qk);
  dv = std::max(dv, o.dv);
  head_rows = std::max(head_rows, o.head_rows);
  elem_bytes = std::max(elem_bytes, o.elem_bytes);
  blocks = blocks || o.blocks;
}

MlaBlocking mla_blocking(int64_t tokens, int64_t visible, int64_t heads, int64_t scores_floats) {
  const int64_t pairs = scores_floats / padded(visible);  // (head, query row) pairs one block may hold
  if (pairs < 1 || tokens < 1 || heads < 1) fail("cuda: MLA scores of {} positions outgrow a budget of {} floats (a sizing bug)", visible, scores_floats);
  const int64_t want = std::min(tokens, kMaxQueryRows);
  if (pairs >= heads * want) return {want, heads};
  if (pairs / heads >= std::min(want, kMinQueryRows)) return {pairs / heads, heads};
  const int64_t rows = std::min({want, kMinQueryRows, pairs});
  return {rows, std::min(heads, pairs / rows)};
}

MlaGemmRunner::MlaGemmRunner(const MlaGemmCapacity& c, int64_t max_context, int64_t scores_bytes, cudaStream_t stream)
    : stream_(stream), capacity_(c), max_context_(max_context), timer_(stream), attend_timer_(stream) {
  const auto bytes = [](int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 16)); };
  workspace_ = DeviceBuffer(kWorkspaceBytes, "cuBLAS workspace");
  latents_ = DeviceBuffer(bytes(max_context * c.rank * c.elem_bytes), "MLA GEMM latents");
  keys_ = DeviceBuffer(bytes(c.heads * max_context * c.qk * c.elem_bytes), "MLA GEMM keys");
  values_ = DeviceBuffer(bytes(c.heads * padded(max_context) * c.dv * c.elem_bytes), "MLA GEMM values");  // rows [visible, dv] or Vᵀ [dv, padded(visible)]
  if (c.blocks) {
    // The scores of one block: within the budget, never more than the largest step can use, never less
    // than one query row of one head at max_context. (The fused kernel needs none of these.)
    const int64_t ld_max = padded(max_context);
    scores_floats_ = std::max(std::min(scores_bytes / static_cast<int64_t>(sizeof(float)), c.head_rows * ld_max), ld_max);
    queries_ = DeviceBuffer(bytes(c.rows * c.heads * c.qk * c.elem_bytes), "MLA GEMM queries");
    scores_ = DeviceBuffer(bytes(scores_floats_ * static_cast<int64_t>(sizeof(float))), "MLA GEMM scores");
    probs_ = DeviceBuffer(bytes(scores_floats_ * c.elem_bytes), "MLA GEMM probabilities");
    outputs_ = DeviceBuffer(bytes(c.head_rows * c.dv * static_cast<int64_t>(sizeof(float))), "MLA GEMM outputs");
  }
  check_cublas(cublasCreate(&handle_), "handle");
  check_cublas(cublasSetStream(handle_, stream_), "stream");
  check_cublas(cublasSetWorkspace(handle_, workspace_.ptr, workspace_.bytes), "workspace");  // after SetStream, which resets it
}

MlaGemmRunner::~MlaGemmRunner() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

namespace {

// C = alpha·op(A)·op(B) over `batch` heads, fp32 accumulate; column-major as cuBLAS sees it.
void gemm(cublasHandle_t handle, cublasOperation_t ta, int64_t m, int64_t n, int64_t k, float alpha, const Operand& a, const Operand& b, void* c,
          cudaDataType c_type, int64_t ldc, int64_t stride_c, int64_t batch, int32_t type, const char* what) {
  const float beta = 0.0f;
  check_cublas(cublasGemmStridedBatchedEx(handle, ta, CUBLAS_OP_N, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a.ptr, a.type,
                                          static_cast<int>(a.ld), a.stride, b.ptr, b.type, static_cast<int>(b.ld), b.stride, &beta, c, c_type,
                                          static_cast<int>(ldc), stride_c, static_cast<int>(batch), compute_type(type), CUBLAS_GEMM_DEFAULT),
               what);
}

}  // namespace

// kv_h = act(c·kv_b,hᵀ) for every head, into keys[h][τ] = [k_nope | k_r] and values[h][τ] (rows
// padded): row-major kv_h [visible, n] is column-major [n, visible] = A_hᵀ·B, A_h = kv_b's n rows of head
// h read as column-major [rank, n] (lda rank, head stride per_head·rank), B = the latents (ldb ld_c,
// stride 0: one for all heads). Each head's output is its own contiguous block. Half outputs are
// rounded by cuBLAS (nearest even) where the CPU rounds the dot; fp32 ones need no rounding.
void MlaGemmRunner::expand(const MlaGemmOp& op, const uint8_t* slot, int32_t cache_elem, int64_t visible) {
  const int64_t ld_c = padded(op.rank), ld_k = padded(op.qk()), ld_v = padded(op.dv), e = type_bytes(op.type);
  launch_mla_inputs(slot, cache_elem, visible, op.rank, op.rope, op.heads, op.nope, latents_.ptr, ld_c, keys_.ptr, ld_k, op.type, stream_);
  const cudaDataType t = data_type(op.type);
  const Operand latents{latents_.ptr, t, ld_c, 0};
  const int64_t head_rows = op.per_head() * op.rank;
  if (op.nope > 0) {
    gemm(handle_, CUBLAS_OP_T, op.nope, visible, op.rank, 1.0f, Operand{op.kv_b.data, t, op.rank, head_rows}, latents, keys_.ptr, t, ld_k, visible * ld_k,
         op.heads, op.type, "key expansion");
  }
  const Operand kv_b_v{op.kv_b.data + op.nope * op.rank * e, t, op.rank, head_rows};
  if (!wgmma(op)) {
    gemm(handle_, CUBLAS_OP_T, op.dv, visible, op.rank, 1.0f, kv_b_v, latents, values_.ptr, t, ld_v, visible * ld_v, op.heads, op.type, "value expansion");
    return;
  }
  // The wgmma kernel's Vᵀ_h [dv, ld_vt] (its P·V operand is K-major): column-major [visible, dv] =
  // latentsᵀ·A_h, the same dots as above. Columns [visible, ld_vt) are zeroed: a kernel copy that
  // starts before its bound reads them, and P = 0 there must not meet a NaN.
  const int64_t ld_vt = padded(visible);
  gemm(handle_, CUBLAS_OP_T, visible, op.dv, op.rank, 1.0f, Operand{latents_.ptr, t, ld_c, 0}, kv_b_v, values_.ptr, t, ld_vt, op.dv * ld_vt, op.heads, op.type,
       "value expansion (transposed)");
  if (ld_vt > visible) {
    check(cudaMemset2DAsync(values_.as<uint8_t>() + visible * e, static_cast<size_t>(ld_vt * e), 0, static_cast<size_t>((ld_vt - visible) * e),
                            static_cast<size_t>(op.heads * op.dv), stream_),
          "MLA value padding");
  }
}

// bf16 and f16 (op.flash()): one launch of the fused kernel (mla_flash.cuh) over every head and row,
// reading q from the arena and writing the output rows. Else the sequence's queries in blocks
// (mla_blocking): per block of rows [t0, t0 + rows) × heads
// [h0, h0 + group), over the first `length` = context + t0 + rows positions (the block's causal bound):
//  S_h = q_h·K_hᵀ·scale, column-major S_hᵀ [length, rows] = K_h·q_hᵀ (K_h row-major [visible, ld_k]:
//    op(A) = Aᵀ; q_h column-major [qk, rows] at ldb heads·ld_q), fp32;
//  P_h = the causal softmax, act-rounded, of type `type` in the same layout;
//  O_h = P_h·V_h, column-major O_hᵀ [dv, rows] = V_hᵀ·P_hᵀ (V_h row-major [visible, ld_v] is
//    column-major [ld_v, visible]: op(A) = A), fp32; then scattered (and rounded) into the output rows.
void MlaGemmRunner::attend(const MlaGemmOp& op, float* arena, const MlaSequence& seq) {
  const int64_t ld_q = padded(op.qk()), ld_k = ld_q, ld_v = padded(op.dv), e = type_bytes(op.type), visible = seq.context + seq.tokens;
  if (op.flash()) {
    MlaFlashArgs args;
    args.q = arena + op.q_offset + seq.first_row * op.q_stride;
    args.keys = keys_.as<uint16_t>();
    args.values = values_.as<uint16_t>();
    args.out = arena + op.out_offset + seq.first_row * op.width;
    args.q_stride = op.q_stride;
    args.width = op.width;
    args.ld_k = static_cast<int32_t>(ld_k);
    args.ld_v = static_cast<int32_t>(ld_v);
    args.tokens = static_cast<int32_t>(seq.tokens);
    args.context = static_cast<int32_t>(seq.context);
    args.heads = static_cast<int32_t>(op.heads);
    args.qk = static_cast<int32_t>(op.qk());
    args.dv = static_cast<int32_t>(op.dv);
    args.scale_log2 = op.scale * 1.44269504088896341f;  // log2(e)
    args.act = op.act;
    args.round_out = op.round_out;
    if (op.gate_op >= 0) {
      args.gate = arena + op.gate_offset + seq.first_row * op.gate_stride;
      args.gate_stride = op.gate_stride;
    }
    if (wgmma(op)) {
      args.ld_vt = static_cast<int32_t>(padded(visible));
      launch_mla_wgmma(args, op.type, stream_);
      wgmma_flash_ += 1;
    } else {
      launch_mla_flash(args, op.type, stream_);
    }
    flash_ += 1;
    return;
  }
  if (!capacity_.blocks) fail("cuda: an MLA op attends in score blocks, its runner has no buffers for them (a sizing bug)");
  launch_mla_queries(arena + op.q_offset + seq.first_row * op.q_stride, op.q_stride, seq.tokens, op.heads, op.qk(), queries_.ptr, ld_q, op.type, stream_);
  const cudaDataType t = data_type(op.type);
  const MlaBlocking blocking = mla_blocking(seq.tokens, visible, op.heads, scores_floats_);
  for (int64_t t0 = 0; t0 < seq.tokens; t0 += blocking.query_rows) {
    const int64_t rows = std::min(blocking.query_rows, seq.tokens - t0), length = seq.context + t0 + rows, ld_s = padded(length);
    for (int64_t h0 = 0; h0 < op.heads; h0 += blocking.head_group) {
      const int64_t group = std::min(blocking.head_group, op.heads - h0);
      blocks_ += 1;
      const Operand keys{keys_.as<uint8_t>() + h0 * visible * ld_k * e, t, ld_k, visible * ld_k};
      const Operand queries{queries_.as<uint8_t>() + (t0 * op.heads + h0) * ld_q * e, t, op.heads * ld_q, ld_q};
      gemm(handle_, CUBLAS_OP_T, length, rows, op.qk(), op.scale, keys, queries, scores_.ptr, CUDA_R_32F, ld_s, ld_s * rows, group, op.type, "scores");
      launch_mla_softmax(scores_.as<float>(), ld_s, group * rows, rows, seq.context + t0 + 1, length, probs_.ptr, op.type, op.act, stream_);
      const Operand values{values_.as<uint8_t>() + h0 * visible * ld_v * e, t, ld_v, visible * ld_v};
      gemm(handle_, CUBLAS_OP_N, op.dv, rows, length, 1.0f, values, Operand{probs_.ptr, t, ld_s, ld_s * rows}, outputs_.ptr, CUDA_R_32F, ld_v, ld_v * rows,
           group, op.type, "P·V");
      const float* gate = op.gate_op >= 0 ? arena + op.gate_offset + (seq.first_row + t0) * op.gate_stride + h0 * op.dv : nullptr;
      launch_mla_scatter(outputs_.as<float>(), ld_v, group, rows, op.dv, arena + op.out_offset + (seq.first_row + t0) * op.width + h0 * op.dv, op.width,
                         op.act, op.round_out, gate, op.gate_stride, stream_);
    }
  }
}

void MlaGemmRunner::run(const MlaGemmOp& op, float* arena, const DeviceState& cache, const std::vector<MlaSequence>& seqs) {
  if (cache.width != op.latent()) fail("cuda: MLA latent cache rows of {} elements, the op's rank + rope is {}", cache.width, op.latent());
  if (op.heads > capacity_.heads || padded(op.qk()) > capacity_.qk || padded(op.dv) > capacity_.dv || padded(op.rank) > capacity_.rank ||
      type_bytes(op.type) > capacity_.elem_bytes) {
    fail("cuda: an MLA op of {} heads outgrows the MLA GEMM buffers (a sizing bug)", op.heads);
  }
  calls_ += 1;
  if (op.gate_op >= 0) gated_ += 1;
  const bool timed = timing_;
  if (timed) timer_.start();
  for (const MlaSequence& seq : seqs) {
    const int64_t visible = seq.context + seq.tokens;
    if (visible > max_context_ || visible > cache.depth || seq.tokens > capacity_.rows) {
      fail("cuda: MLA over {} positions ({} new) in slot {} outgrows the MLA GEMM buffers of {} positions, {} rows", visible, seq.tokens, seq.slot,
           std::min(max_context_, cache.depth), capacity_.rows);
    }
    const int64_t elem_bytes = state_elem_bytes(cache.elem);
    uint8_t* slot = static_cast<uint8_t*>(cache.base) + seq.slot * cache.slot_elems * elem_bytes;
    launch_mla_append(arena + op.kv_a_offset + seq.first_row * op.kv_a_stride, op.kv_a_stride, seq.tokens, op.norm, op.eps, op.rank, op.rope, op.act,
                      slot + seq.context * op.latent() * elem_bytes, cache.elem, stream_);
    expand(op, slot, cache.elem, visible);
    if (timed) attend_timer_.start();
    attend(op, arena, seq);
    if (timed) attend_timer_.stop();
  }
  if (timed) timer_.stop();
}

}  // namespace plow::cuda
