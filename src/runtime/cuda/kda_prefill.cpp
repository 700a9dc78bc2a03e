// KDA prefill as planned launches (kda_prefill.h): which kda_delta_rule ops take them, the step's
// chunk tables, and the batches whose records fit the workspace.
#include "runtime/cuda/kda_prefill.h"

#include <algorithm>

#include "core/error.h"
#include "runtime/cuda/kda_prefill_kernels.h"

namespace plow::cuda {

namespace {

// Records a batch may hold beyond the plan's rows in whole chunks: a step of many short prompts has a
// partial chunk per sequence; more sequences than this go to further batches.
constexpr int64_t kSpareChunks = 16;

int64_t chunks_of(int64_t tokens) { return (tokens + kKdaChunk - 1) / kKdaChunk; }

}  // namespace

std::optional<KdaPrefillOp> kda_prefill_form(const Plan& plan, const PlanOp& op, int32_t act) {
  if (op.op() != Op::kKdaDeltaRule || op.inputs.size() != 5 || op.state < 0 || !op.attrs.has("head_dim")) return std::nullopt;
  KdaPrefillOp k;
  k.d = static_cast<int64_t>(op.attrs.get("head_dim"));
  if (k.d < 1 || k.d > kKdaMaxHeadDim || op.width % k.d != 0) return std::nullopt;
  k.heads = op.width / k.d;
  const ActivationView q = activation_view(plan, op.inputs[0]), kv = activation_view(plan, op.inputs[1]), v = activation_view(plan, op.inputs[2]);
  const ActivationView g = activation_view(plan, op.inputs[3]), beta = activation_view(plan, op.inputs[4]);
  if (plan.op(op.inputs[0]).width != op.width || plan.op(op.inputs[1]).width != op.width || plan.op(op.inputs[2]).width != op.width ||
      plan.op(op.inputs[3]).width != op.width || plan.op(op.inputs[4]).width != k.heads) {
    return std::nullopt;
  }
  k.q_offset = q.offset;
  k.q_stride = q.row_stride;
  k.k_offset = kv.offset;
  k.k_stride = kv.row_stride;
  k.v_offset = v.offset;
  k.v_stride = v.row_stride;
  k.g_offset = g.offset;
  k.g_stride = g.row_stride;
  k.beta_offset = beta.offset;
  k.beta_stride = beta.row_stride;
  k.out_offset = op.offset;
  k.width = op.width;
  k.state = op.state;
  k.out_act = op.dtype == OutDType::kAct ? act : kAF32;
  return k;
}

void KdaPrefillCapacity::add(const KdaPrefillOp& op, int64_t max_rows) {
  rows = std::max(rows, max_rows);
  heads = std::max(heads, op.heads);
}

void KdaPrefillCapacity::merge(const KdaPrefillCapacity& o) {
  rows = std::max(rows, o.rows);
  heads = std::max(heads, o.heads);
}

KdaPrefillRunner::KdaPrefillRunner(const KdaPrefillCapacity& c, cudaStream_t stream)
    : stream_(stream), capacity_(c), max_chunks_(chunks_of(c.rows) + kSpareChunks), timer_(stream), prep_timer_(stream) {
  records_ = DeviceBuffer(static_cast<size_t>(max_chunks_ * c.heads * kKdaRecFloats) * sizeof(float), "KDA prefill records");
  // Per chunk two ints, per sequence three: at most rows / kKdaChunkedMinTokens sequences, each of at
  // most one partial chunk beyond rows / C whole ones.
  const int64_t seqs = c.rows / kKdaChunkedMinTokens + 1;
  tables_ = DeviceBuffer(static_cast<size_t>(2 * (chunks_of(c.rows) + seqs) + 3 * seqs) * sizeof(int32_t), "KDA prefill tables");
}

bool KdaPrefillRunner::takes(const std::vector<MlaSequence>& seqs) {
  return !seqs.empty() && std::all_of(seqs.begin(), seqs.end(), [](const MlaSequence& s) { return s.tokens >= kKdaChunkedMinTokens; });
}

void KdaPrefillRunner::new_step(const std::vector<MlaSequence>& seqs) {
  timer_.harvest();
  prep_timer_.harvest();
  total_seqs_ = static_cast<int64_t>(seqs.size());
  total_chunks_ = 0;
  for (const MlaSequence& s : seqs) total_chunks_ += chunks_of(s.tokens);
  // Layout: chunk_row0 [chunks], chunk_len [chunks], seq_chunk0 [seqs] (within its batch), seq_chunks
  // [seqs], seq_slot [seqs].
  host_tables_.assign(static_cast<size_t>(2 * total_chunks_ + 3 * total_seqs_), 0);
  if (host_tables_.size() * sizeof(int32_t) > tables_.bytes) {
    fail("cuda: a KDA prefill step of {} sequences, {} chunks outgrows its tables (a sizing bug)", total_seqs_, total_chunks_);
  }
  int32_t* chunk_row0 = host_tables_.data();
  int32_t* chunk_len = chunk_row0 + total_chunks_;
  int32_t* seq_chunk0 = chunk_len + total_chunks_;
  int32_t* seq_chunks = seq_chunk0 + total_seqs_;
  int32_t* seq_slot = seq_chunks + total_seqs_;
  batches_.clear();
  int32_t chunk = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const MlaSequence& s = seqs[i];
    const auto own = static_cast<int32_t>(chunks_of(s.tokens));
    if (own > max_chunks_) fail("cuda: a KDA prefill sequence of {} tokens outgrows the records of {} chunks (a sizing bug)", s.tokens, max_chunks_);
    if (batches_.empty() || batches_.back().chunks + own > max_chunks_) batches_.push_back({chunk, 0, static_cast<int32_t>(i), 0});
    Batch& b = batches_.back();
    seq_chunk0[i] = b.chunks;
    seq_chunks[i] = own;
    seq_slot[i] = s.slot;
    for (int32_t k = 0; k < own; ++k) {
      chunk_row0[chunk + k] = static_cast<int32_t>(s.first_row + int64_t{k} * kKdaChunk);
      chunk_len[chunk + k] = static_cast<int32_t>(std::min<int64_t>(kKdaChunk, s.tokens - int64_t{k} * kKdaChunk));
    }
    chunk += own;
    b.chunks += own;
    b.seqs += 1;
  }
  if (!host_tables_.empty()) {
    check(cudaMemcpyAsync(tables_.ptr, host_tables_.data(), host_tables_.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "KDA prefill tables");
  }
}

void KdaPrefillRunner::run(const KdaPrefillOp& op, float* arena, const DeviceState& state) {
  if (op.heads > capacity_.heads) fail("cuda: a KDA op of {} heads outgrows the KDA prefill records of {} (a sizing bug)", op.heads, capacity_.heads);
  if (state.elem != kAF32 || state.width != op.width || state.slot_elems != op.width * op.d) {
    fail("cuda: KDA state slots of {} elements, the op's heads × d × d is {} floats", state.slot_elems, op.width * op.d);
  }
  calls_ += 1;
  const bool timed = timing_;
  if (timed) timer_.start();
  const int32_t* tables = tables_.as<int32_t>();
  for (const Batch& b : batches_) {
    KdaPrefillArgs a;
    a.q = arena + op.q_offset;
    a.k = arena + op.k_offset;
    a.v = arena + op.v_offset;
    a.g = arena + op.g_offset;
    a.beta = arena + op.beta_offset;
    a.q_stride = op.q_stride;
    a.k_stride = op.k_stride;
    a.v_stride = op.v_stride;
    a.g_stride = op.g_stride;
    a.beta_stride = op.beta_stride;
    a.out = arena + op.out_offset;
    a.out_stride = op.width;
    a.records = records_.as<float>();
    a.chunk_row0 = tables + b.first_chunk;
    a.chunk_len = tables + total_chunks_ + b.first_chunk;
    a.seq_chunk0 = tables + 2 * total_chunks_ + b.first_seq;
    a.seq_chunks = tables + 2 * total_chunks_ + total_seqs_ + b.first_seq;
    a.seq_slot = tables + 2 * total_chunks_ + 2 * total_seqs_ + b.first_seq;
    a.state = static_cast<float*>(state.base);
    a.state_slot_floats = state.slot_elems;
    a.chunks = b.chunks;
    a.seqs = b.seqs;
    a.heads = static_cast<int32_t>(op.heads);
    a.d = static_cast<int32_t>(op.d);
    a.out_act = op.out_act;
    if (timed) prep_timer_.start();
    launch_kda_prep(a, stream_);
    if (timed) prep_timer_.stop();
    launch_kda_scan(a, stream_);
    batches_run_ += 1;
  }
  if (timed) timer_.stop();
}

}  // namespace plow::cuda
