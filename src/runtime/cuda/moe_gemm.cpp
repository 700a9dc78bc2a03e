// Routed experts as grouped GEMMs (moe_gemm.h): which MoE ops take them, the routing sort (on the
// device, or read back and sorted on the host), and the GEMM calls (the wgmma kernel over every expert's
// jobs, or one cuBLAS grouped call, or one cublasGemmEx per expert with tokens).
#include "runtime/cuda/moe_gemm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace plow::cuda {

namespace {

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("cuda: cuBLAS {}: {}", what, cublasGetStatusString(status));
}

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// Row strides of the sorted buffers: whole 16-byte rows (8 elements), so that every row a group starts
// at is aligned as cuBLAS's half-precision kernels require of the pointers they read.
int64_t padded(int64_t cols) { return (cols + 7) / 8 * 8; }

int64_t type_bytes(int32_t type) { return type == kWF32 ? 4 : 2; }

cudaDataType data_type(int32_t type) { return type == kWBF16 ? CUDA_R_16BF : type == kWF16 ? CUDA_R_16F : CUDA_R_32F; }

bool dense_expert_stack(const DeviceWeight& w, int64_t experts) {
  return w.parts == experts && w.parts > 1 && (w.type == kWF32 || w.type == kWBF16 || w.type == kWF16);
}

}  // namespace

const char* expert_gemm_path_name(ExpertGemmPath path) {
  switch (path) {
    case ExpertGemmPath::kNone:
      return "none";
    case ExpertGemmPath::kWgmma:
      return "wgmma grouped";
    case ExpertGemmPath::kCublasGrouped:
      return "cublas grouped";
    case ExpertGemmPath::kCublasPerExpert:
      return "cublas per expert";
    case ExpertGemmPath::kGemv:
      return "expert gemv";
  }
  return "?";
}

std::optional<MoeGemmOp> moe_gemm_form(const Plan& plan, const PlanOp& op, const std::vector<DeviceWeight>& weights, int32_t act) {
  const bool gate_up = op.op() == Op::kMoeGateUp, add = op.op() == Op::kMoeDownAdd;
  if (!gate_up && op.op() != Op::kMoeDown && !add) return std::nullopt;
  if (weights.size() != (gate_up ? 2u : 1u) || op.inputs.size() != (add ? 3u : 2u) || !op.attrs.has("top_k")) return std::nullopt;
  MoeGemmOp m;
  m.op = op.op();
  m.top_k = static_cast<int64_t>(op.attrs.get("top_k"));
  m.experts = weights[0].parts;
  for (size_t j = 0; j < weights.size(); ++j) {
    if (!dense_expert_stack(weights[j], m.experts) || weights[j].type != weights[0].type || weights[j].rows != weights[0].rows ||
        weights[j].cols != weights[0].cols) {
      return std::nullopt;
    }
    m.w[j] = weights[j];
  }
  m.gemm_out = weights[0].rows;
  m.gemm_in = weights[0].cols;
  const PlanOp& input = plan.op(op.inputs[0]);
  const PlanOp& routes = plan.op(op.inputs[1]);
  // The input as the op body reads it: x [T, io] (gate_up) or the k activations [T, k·I] (down).
  const int64_t input_width = gate_up ? m.gemm_in : m.top_k * m.gemm_in;
  if (m.top_k < 1 || m.top_k > m.experts || input.width != input_width || routes.width != 2 * m.top_k) return std::nullopt;
  if (op.width != (gate_up ? m.top_k * m.gemm_out : m.gemm_out)) return std::nullopt;
  const bool exact_input = input.dtype == OutDType::kAct && ((m.in_type() == kWBF16 && act == kABF16) || (m.in_type() == kWF16 && act == kAF16));
  if (m.in_type() != kWF32 && !exact_input) return std::nullopt;
  const ActivationView x = activation_view(plan, op.inputs[0]), r = activation_view(plan, op.inputs[1]);
  m.x_offset = x.offset;
  m.x_stride = x.row_stride;
  m.routes_offset = r.offset;
  m.routes_stride = r.row_stride;
  if (add) {
    const ActivationView s = activation_view(plan, op.inputs[2]);
    if (plan.op(op.inputs[2]).width != op.width) return std::nullopt;
    m.shared_offset = s.offset;
    m.shared_stride = s.row_stride;
  }
  m.out_offset = op.offset;
  m.width = op.width;
  m.act = act;
  m.round_out = op.dtype == OutDType::kAct;
  // As pack_attrs packs them for op_moe_gate_up (attr1..3).
  m.situ = op.attrs.has("situ") && op.attrs.get("situ") != 0.0;
  m.beta = static_cast<float>(op.attrs.has("beta") ? op.attrs.get("beta") : 0.0);
  m.linear_beta = static_cast<float>(op.attrs.has("linear_beta") ? op.attrs.get("linear_beta") : 0.0);
  return m;
}

void MoeGemmCapacity::add(const MoeGemmOp& op, int64_t max_rows) {
  const int64_t p = max_rows * op.top_k;
  pairs = std::max(pairs, p);
  routes_floats = std::max(routes_floats, max_rows * 2 * op.top_k);
  experts = std::max(experts, op.experts);
  in_bytes = std::max(in_bytes, p * padded(op.gemm_in) * type_bytes(op.in_type()));
  out_bytes = std::max(out_bytes, op.sets() * p * padded(op.gemm_out) * type_bytes(op.out_type()));
}

void MoeGemmCapacity::merge(const MoeGemmCapacity& o) {
  pairs = std::max(pairs, o.pairs);
  routes_floats = std::max(routes_floats, o.routes_floats);
  experts = std::max(experts, o.experts);
  in_bytes = std::max(in_bytes, o.in_bytes);
  out_bytes = std::max(out_bytes, o.out_bytes);
}

MoeGemmRunner::MoeGemmRunner(const MoeGemmCapacity& capacity, cudaStream_t stream, int32_t* error)
    : stream_(stream),
      capacity_(capacity),
      error_(error),
      workspace_(kWorkspaceBytes, "cuBLAS workspace"),
      lists_(static_cast<size_t>(2 * capacity.pairs + 2 * capacity.experts + moe_job_list_ints(capacity.experts, capacity.pairs)) * sizeof(int32_t),
             "MoE routing lists"),
      pointers_(static_cast<size_t>(3 * 2 * capacity.experts) * sizeof(void*), "MoE GEMM pointers"),
      in_(static_cast<size_t>(std::max<int64_t>(capacity.in_bytes, 16)), "MoE GEMM inputs"),
      out_(static_cast<size_t>(std::max<int64_t>(capacity.out_bytes, 16)), "MoE GEMM outputs"),
      device_counts_(static_cast<size_t>(capacity.experts + 1) * sizeof(int32_t), "MoE routing counts"),
      device_stats_(2 * sizeof(unsigned long long), "MoE routing stats"),
      timer_(stream),
      sort_timer_(stream),
      gemm_timer_(stream) {
  check(cudaMemsetAsync(device_stats_.ptr, 0, device_stats_.bytes, stream_), "MoE routing stats");
  if (capacity.pairs > 0 && capacity.experts <= kMoeDeviceMaxExperts) {  // launch_moe_sort's scratch: three int arrays, then the radix sort's storage
    const size_t ints = static_cast<size_t>(capacity.pairs) * sizeof(int32_t), array = (ints + 255) / 256 * 256;
    sort_buffers_.temp_bytes = moe_sort_temp_bytes(capacity.pairs);
    sort_scratch_ = DeviceBuffer(3 * array + sort_buffers_.temp_bytes, "MoE routing sort");
    uint8_t* base = sort_scratch_.as<uint8_t>();
    sort_buffers_.keys = reinterpret_cast<int32_t*>(base);
    sort_buffers_.sorted_keys = reinterpret_cast<int32_t*>(base + array);
    sort_buffers_.values = reinterpret_cast<int32_t*>(base + 2 * array);
    sort_buffers_.temp = base + 3 * array;
  }
  check_cublas(cublasCreate(&handle_), "handle");
  check_cublas(cublasSetStream(handle_, stream_), "stream");
  check_cublas(cublasSetWorkspace(handle_, workspace_.ptr, workspace_.bytes), "workspace");  // after SetStream, which resets it
}

MoeGemmRunner::~MoeGemmRunner() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

// The step's top-k rows to the host: the stream waits for the segment that computed them.
void MoeGemmRunner::read_routing(const MoeGemmOp& op, const float* arena, int64_t rows) {
  const int64_t k = op.top_k;
  if (rows * k > capacity_.pairs || op.experts > capacity_.experts) fail("cuda: a MoE step of {} pairs over {} experts outgrows its buffers", rows * k, op.experts);
  routes_host_.resize(static_cast<size_t>(rows * 2 * k));
  check(cudaMemcpy2DAsync(routes_host_.data(), static_cast<size_t>(2 * k) * sizeof(float), arena + op.routes_offset,
                          static_cast<size_t>(op.routes_stride) * sizeof(float), static_cast<size_t>(2 * k) * sizeof(float), static_cast<size_t>(rows),
                          cudaMemcpyDeviceToHost, stream_),
        "MoE routing read");
  check(cudaStreamSynchronize(stream_), "MoE routing read");
  timer_.harvest();
  sort_timer_.harvest();
  gemm_timer_.harvest();
}

// A counting sort of the pairs by expert (ascending token order within an expert), and the lists
// uploaded: perm[p] = the pair at sorted position p, inv[q] = the sorted position of pair q, then the
// experts with pairs and their first positions.
void MoeGemmRunner::sort_routing(const MoeGemmOp& op, int64_t rows) {
  const int64_t k = op.top_k, pairs = rows * k;
  Routing& r = routing_;
  r.counts.assign(static_cast<size_t>(op.experts), 0);
  std::vector<int32_t> expert_of(static_cast<size_t>(pairs));
  for (int64_t q = 0; q < pairs; ++q) {
    const float id = routes_host_[static_cast<size_t>((q / k) * 2 * k + k + q % k)];
    if (!(id >= 0.0f && id < static_cast<float>(op.experts)) || id != std::floor(id)) {
      fail("cuda: MoE row {} slot {} routes to expert {}, expected an integer in 0..{}", q / k, q % k, id, op.experts - 1);
    }
    expert_of[static_cast<size_t>(q)] = static_cast<int32_t>(id);
    r.counts[static_cast<size_t>(id)] += 1;
  }
  r.active.clear();
  r.offsets.clear();
  std::vector<int32_t> next(static_cast<size_t>(op.experts));
  int32_t total = 0;
  for (int64_t e = 0; e < op.experts; ++e) {
    next[static_cast<size_t>(e)] = total;
    if (r.counts[static_cast<size_t>(e)] == 0) continue;
    r.active.push_back(static_cast<int32_t>(e));
    r.offsets.push_back(total);
    total += r.counts[static_cast<size_t>(e)];
  }
  // The wgmma kernel's jobs: each expert's rows in pieces of kMoeWgmmaJobRows, those of ≤ 64 rows first.
  r.short_grid = r.long_grid = 0;
  for (int32_t n : r.counts) {
    for (int32_t left = n; left > 0; left -= kMoeWgmmaJobRows) (left <= 64 ? r.short_grid : r.long_grid) += 1;
  }
  r.job_list_at = 2 * pairs + 2 * static_cast<int64_t>(r.active.size());
  lists_host_.resize(static_cast<size_t>(r.job_list_at) + 2 + 3 * static_cast<size_t>(r.short_grid + r.long_grid));
  int32_t* perm = lists_host_.data();
  int32_t* inv = perm + pairs;
  for (int64_t q = 0; q < pairs; ++q) {
    const int32_t p = next[static_cast<size_t>(expert_of[static_cast<size_t>(q)])]++;
    perm[p] = static_cast<int32_t>(q);
    inv[q] = p;
  }
  std::copy(r.active.begin(), r.active.end(), inv + pairs);
  std::copy(r.offsets.begin(), r.offsets.end(), inv + pairs + r.active.size());
  int32_t* job_list = perm + r.job_list_at;  // moe_lists.h: the counts, then the jobs (expert, first sorted row, rows)
  job_list[0] = r.short_grid;
  job_list[1] = r.long_grid;
  int32_t* short_job = job_list + 2;
  int32_t* long_job = short_job + 3 * r.short_grid;
  for (size_t i = 0; i < r.active.size(); ++i) {
    const int32_t e = r.active[i], count = r.counts[static_cast<size_t>(e)];
    for (int32_t f = 0; f < count; f += kMoeWgmmaJobRows) {
      const int32_t n = std::min(kMoeWgmmaJobRows, count - f);
      int32_t*& job = n <= 64 ? short_job : long_job;
      job[0] = e;
      job[1] = r.offsets[i] + f;
      job[2] = n;
      job += 3;
    }
  }
  // Pageable memory: the copy has taken the bytes when the call returns (and the stream is idle here).
  check(cudaMemcpyAsync(lists_.ptr, lists_host_.data(), lists_host_.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_), "MoE routing lists");
  r.mark(op, rows, false, false);
  host_stats_.reads += 1;
  host_stats_.experts += static_cast<int64_t>(r.active.size());
}

void MoeGemmRunner::Routing::mark(const MoeGemmOp& op, int64_t step_rows, bool on_device, bool by_sort) {
  valid = true;
  device = on_device;
  sorted = by_sort;
  routes_offset = op.routes_offset;
  rows = step_rows;
  top_k = op.top_k;
  if (on_device) {  // the counts stay on the device until last_expert_tokens() reads them
    counts.assign(static_cast<size_t>(op.experts), 0);
    active.clear();
    offsets.clear();
  }
}

// The routing sorted on the device into the same lists (launch_moe_route): nothing waits.
void MoeGemmRunner::route_on_device(const MoeGemmOp& op, const float* arena, int64_t rows) {
  const int64_t pairs = rows * op.top_k;
  if (pairs > capacity_.pairs || op.experts > capacity_.experts) fail("cuda: a MoE step of {} pairs over {} experts outgrows its buffers", pairs, op.experts);
  int32_t* perm = lists_.as<int32_t>();
  const int64_t max_n = std::min(pairs, op.experts);
  launch_moe_route(arena + op.routes_offset, op.routes_stride, rows, op.top_k, static_cast<int>(op.experts), perm, perm + pairs, perm + 2 * pairs,
                   perm + 2 * pairs + max_n, device_counts_.as<int32_t>(), device_stats_.as<unsigned long long>(), error_, stream_);
  routing_.mark(op, rows, true, false);
}

// A large step's routing sorted on the device (launch_moe_sort) into the host sort's lists and the
// wgmma kernel's job list: no routing read, nothing waits. Its GEMMs must take the wgmma kernel.
void MoeGemmRunner::sort_on_device(const MoeGemmOp& op, const float* arena, int64_t rows) {
  const int64_t pairs = rows * op.top_k;
  if (pairs > capacity_.pairs || op.experts > capacity_.experts || sort_buffers_.keys == nullptr) {
    fail("cuda: a MoE step of {} pairs over {} experts outgrows its buffers", pairs, op.experts);
  }
  int32_t* perm = lists_.as<int32_t>();
  const int64_t max_n = std::min(pairs, op.experts);
  Routing& r = routing_;
  r.job_list_at = 2 * pairs + 2 * max_n;
  launch_moe_sort(arena + op.routes_offset, op.routes_stride, rows, op.top_k, static_cast<int>(op.experts), sort_buffers_, perm, perm + pairs, perm + 2 * pairs,
                  perm + 2 * pairs + max_n, perm + r.job_list_at, device_counts_.as<int32_t>(), device_stats_.as<unsigned long long>(), error_, stream_);
  r.mark(op, rows, true, true);
  // The job counts live on the device: the grids hold every job a routing can have, per class.
  const int64_t bound = std::min<int64_t>(op.experts + pairs / kMoeWgmmaJobRows + 1, 65535);
  r.short_grid = r.long_grid = static_cast<int>(bound);
}

// Whether the op's expert GEMMs take the wgmma kernel (launch_moe_wgmma) rather than cuBLAS.
bool MoeGemmRunner::wgmma_takes(const MoeGemmOp& op) const {
  return !prefer_cublas_ && op.in_type() != kWF32 &&
         moe_wgmma_supports(op.w, op.sets(), op.gemm_in, op.gemm_out, in_.ptr, padded(op.gemm_in), op.in_type(), op.out_type());
}

void MoeGemmRunner::run(const MoeGemmOp& op, float* arena, int64_t rows) {
  calls_ += 1;
  const int64_t pairs = rows * op.top_k;
  const bool on_device = pairs <= kMoeDevicePairsPerExpert * op.experts && pairs <= kMoeDeviceMaxPairs && op.experts <= kMoeDeviceMaxExperts &&
                         padded(op.gemm_in) * static_cast<int64_t>(sizeof(float)) <= kMoeGemvMaxStagedBytes;
  // Larger steps whose GEMMs take the wgmma kernel sort on the device too (the job list stays there).
  const bool sorted = !on_device && op.experts <= kMoeDeviceMaxExperts && sort_buffers_.keys != nullptr && wgmma_takes(op);
  // A down op reads the routing its gate_up read (the same top-k buffer in the same step).
  const bool reuse = !op.gate_up() && routing_.valid && routing_.device == (on_device || sorted) && routing_.sorted == sorted &&
                     routing_.routes_offset == op.routes_offset && routing_.rows == rows && routing_.top_k == op.top_k &&
                     static_cast<int64_t>(routing_.counts.size()) == op.experts;
  if (on_device) {
    if (timing_) timer_.start();
    if (!reuse) route_on_device(op, arena, rows);
  } else if (sorted) {
    if (timing_) timer_.start();
    if (timing_) sort_timer_.start();
    if (!reuse) sort_on_device(op, arena, rows);
    if (timing_) sort_timer_.stop();
  } else {
    if (!reuse) read_routing(op, arena, rows);
    if (timing_) timer_.start();  // the stream is idle after a routing read: the sort counts
    if (timing_) sort_timer_.start();
    if (!reuse) sort_routing(op, rows);
    if (timing_) sort_timer_.stop();
  }
  const int32_t* perm = lists_.as<int32_t>();
  const int64_t ld_in = padded(op.gemm_in);
  // The wgmma kernel reads gate_up's token rows by the sort's perm: x's rows converted once, not a
  // copy per (token, slot) pair. down's rows are in in_ already when its gate_up's epilogue wrote them.
  // A device sort's job list has no host copy: only the wgmma kernel reads it.
  const bool wgmma = !on_device && (routing_.sorted || (!routing_.active.empty() && wgmma_takes(op)));
  const bool by_perm = wgmma && op.gate_up();
  if (by_perm) {
    launch_moe_gather(arena + op.x_offset, op.x_stride, 0, 1, nullptr, rows, op.gemm_in, in_.ptr, ld_in, op.in_type(), stream_);
  } else if (!(reuse && down_input_ready(op, rows))) {
    // gate_up: every slot of a token reads its x row; down: slot s reads columns [s·I, (s+1)·I) of h.
    launch_moe_gather(arena + op.x_offset, op.x_stride, op.gate_up() ? 0 : op.gemm_in, op.top_k, perm, pairs, op.gemm_in, in_.ptr, ld_in, op.in_type(),
                      stream_);
  }
  down_input_.valid = false;  // in_ holds this op's input now
  if (on_device) {
    const int64_t max_n = std::min(pairs, op.experts), ld_out = padded(op.gemm_out);
    uint8_t* c0 = out_.as<uint8_t>();
    uint8_t* c1 = c0 + pairs * ld_out * type_bytes(op.out_type());
    last_path_ = ExpertGemmPath::kGemv;
    if (!launch_moe_gemv(perm + 2 * pairs, perm + 2 * pairs + max_n, device_counts_.as<int32_t>() + op.experts, static_cast<int>(max_n), pairs, op.w,
                         op.sets(), op.gemm_in, op.gemm_out, in_.ptr, ld_in, op.in_type(), c0, c1, ld_out, op.out_type(), stream_)) {
      fail("cuda: the expert GEMV refused a step of {} pairs over {} experts ({}-wide rows, weight type {}, output type {}) that the device route took",
           pairs, op.experts, op.gemm_in, op.in_type(), op.out_type());
    }
  } else {
    if (timing_) gemm_timer_.start();
    gemms(op, pairs, wgmma, by_perm ? perm : nullptr, static_cast<int32_t>(op.top_k));
    if (timing_) gemm_timer_.stop();
  }
  epilogue(op, arena, rows);
  if (timing_) timer_.stop();
}

// gate_up: the activation into the op's rows, and into in_ as the down op's sorted input rows (its
// GEMMs have read in_); down: the weighted sum in slot order (+ shared).
void MoeGemmRunner::epilogue(const MoeGemmOp& op, float* arena, int64_t rows) {
  const int64_t pairs = rows * op.top_k, ld_out = padded(op.gemm_out);
  const int32_t* perm = lists_.as<int32_t>();
  const int32_t* inv = perm + pairs;
  if (op.gate_up()) {
    const uint8_t* up = out_.as<uint8_t>() + pairs * ld_out * type_bytes(op.out_type());
    launch_moe_activation(out_.ptr, up, ld_out, op.out_type(), perm, pairs, op.gemm_out, arena + op.out_offset, op.act, op.round_out, op.situ, op.beta,
                          op.linear_beta, in_.ptr, padded(op.gemm_out), op.in_type(), stream_);
    down_input_ = {true, op.out_offset, op.top_k * op.gemm_out, op.gemm_out, rows, padded(op.gemm_out), op.in_type()};
  } else {
    const float* shared = op.op == Op::kMoeDownAdd ? arena + op.shared_offset : nullptr;
    launch_moe_combine(out_.ptr, ld_out, op.out_type(), inv, rows, op.top_k, op.gemm_out, arena + op.routes_offset, op.routes_stride, shared,
                       op.shared_stride, arena + op.out_offset, op.act, op.round_out, stream_);
  }
}

bool MoeGemmRunner::down_input_ready(const MoeGemmOp& op, int64_t rows) const {
  const DownInput& d = down_input_;
  return !op.gate_up() && d.valid && d.x_offset == op.x_offset && d.x_stride == op.x_stride && d.cols == op.gemm_in && d.rows == rows &&
         d.ld == padded(op.gemm_in) && d.type == op.in_type();
}

// Row-major y[n, out] = x[n, in]·W_eᵀ per expert is column-major yᵀ = W_e·xᵀ (as GemmRunner::run):
// op(A) = Aᵀ over W_e's rows (lda = in), B = the expert's sorted rows (ldb = ld_in), C its output rows.
void MoeGemmRunner::gemms(const MoeGemmOp& op, int64_t pairs, bool wgmma, const int32_t* b_rows, int32_t b_div) {
  const Routing& r = routing_;
  const int n = static_cast<int>(r.active.size()), sets = op.sets();
  last_path_ = ExpertGemmPath::kNone;
  const int64_t ld_in = padded(op.gemm_in), ld_out = padded(op.gemm_out);
  const int64_t in_row = ld_in * type_bytes(op.in_type()), out_row = ld_out * type_bytes(op.out_type());
  uint8_t* c[2] = {out_.as<uint8_t>(), out_.as<uint8_t>() + pairs * out_row};
  if (wgmma) {
    if (!launch_moe_wgmma(lists_.as<int32_t>() + r.job_list_at, r.short_grid, r.long_grid, op.w, sets, op.gemm_in, op.gemm_out, in_.ptr, ld_in, op.in_type(),
                          b_rows, b_div, c[0], c[1], ld_out, op.out_type(), stream_)) {
      fail("cuda: the wgmma expert GEMM refused a step of {} pairs over {} experts ({}-wide rows, weight type {}) it was chosen for", pairs, op.experts,
           op.gemm_in, op.in_type());
    }
    last_path_ = ExpertGemmPath::kWgmma;
    return;
  }
  if (n == 0) return;  // no rows
  const cudaDataType a_type = data_type(op.in_type()), c_type = data_type(op.out_type());
  const float one = 1.0f, zero = 0.0f;
  // cuBLAS's grouped GEMM takes one type for A, B and C: half weights with half outputs. Its pointers
  // must be 16-byte aligned: the sorted rows are (padded), the weight rows must be too.
  bool aligned = true;
  for (int j = 0; j < sets; ++j) aligned = aligned && reinterpret_cast<uintptr_t>(op.w[j].data) % 16 == 0 && op.w[j].part_bytes % 16 == 0;
  aligned = aligned && (op.gemm_in * type_bytes(op.in_type())) % 16 == 0;
  if (grouped_ok_ && aligned && op.in_type() != kWF32 && op.out_type() == op.in_type()) {
    last_path_ = ExpertGemmPath::kCublasGrouped;
    launch_moe_pointers(lists_.as<int32_t>() + 2 * pairs, n, sets, op.w[0].data, op.w[sets - 1].data, op.w[0].part_bytes, in_.as<uint8_t>(), in_row, c[0],
                        c[1], out_row, pointers_.as<void*>(), stream_);
    HostArrays& h = arrays_[op.gate_up() ? 0 : 1];
    const auto groups = static_cast<size_t>(sets * n);
    h.transa.assign(groups, CUBLAS_OP_T);
    h.transb.assign(groups, CUBLAS_OP_N);
    h.m.assign(groups, static_cast<int>(op.gemm_out));
    h.k.assign(groups, static_cast<int>(op.gemm_in));
    h.lda.assign(groups, static_cast<int>(op.gemm_in));
    h.ldb.assign(groups, static_cast<int>(ld_in));
    h.ldc.assign(groups, static_cast<int>(ld_out));
    h.group_size.assign(groups, 1);
    h.alpha.assign(groups, 1.0f);
    h.beta.assign(groups, 0.0f);
    h.n.resize(groups);
    for (size_t g = 0; g < groups; ++g) h.n[g] = r.counts[static_cast<size_t>(r.active[g % static_cast<size_t>(n)])];
    void** ptrs = pointers_.as<void*>();
    const cublasStatus_t status = cublasGemmGroupedBatchedEx(handle_, h.transa.data(), h.transb.data(), h.m.data(), h.n.data(), h.k.data(), h.alpha.data(),
                                                             ptrs, a_type, h.lda.data(), ptrs + groups, a_type, h.ldb.data(), h.beta.data(),
                                                             ptrs + 2 * groups, c_type, h.ldc.data(), static_cast<int>(groups), h.group_size.data(),
                                                             CUBLAS_COMPUTE_32F);
    if (status == CUBLAS_STATUS_SUCCESS) return;
    if (status != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(status, "grouped expert GEMM");
    grouped_ok_ = false;  // this cuBLAS lacks the grouped form for these types: per-expert calls from now on
  }
  last_path_ = ExpertGemmPath::kCublasPerExpert;
  // fp32: pedantic, never TF32, whatever NVIDIA_TF32_OVERRIDE says (as GemmRunner).
  const cublasComputeType_t compute = op.in_type() == kWF32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  for (int i = 0; i < n; ++i) {
    const int64_t e = r.active[static_cast<size_t>(i)], first = r.offsets[static_cast<size_t>(i)];
    for (int j = 0; j < sets; ++j) {
      check_cublas(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(op.gemm_out), r.counts[static_cast<size_t>(e)], static_cast<int>(op.gemm_in),
                                &one, op.w[j].data + e * op.w[j].part_bytes, a_type, static_cast<int>(op.gemm_in), in_.as<uint8_t>() + first * in_row, a_type,
                                static_cast<int>(ld_in), &zero, c[j] + first * out_row, c_type, static_cast<int>(ld_out), compute, CUBLAS_GEMM_DEFAULT),
                   "expert GEMM");
    }
  }
}

const std::vector<int32_t>& MoeGemmRunner::last_expert_tokens() {
  if (routing_.valid && routing_.device) {
    check(cudaMemcpyAsync(routing_.counts.data(), device_counts_.ptr, routing_.counts.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_),
          "MoE routing counts");
    check(cudaStreamSynchronize(stream_), "MoE routing counts");
  }
  return routing_.counts;
}

MoeGemmRunner::RoutingStats MoeGemmRunner::routing_stats() {
  unsigned long long device[2] = {0, 0};
  check(cudaMemcpyAsync(device, device_stats_.ptr, sizeof(device), cudaMemcpyDeviceToHost, stream_), "MoE routing stats");
  check(cudaStreamSynchronize(stream_), "MoE routing stats");
  return {host_stats_.reads + static_cast<int64_t>(device[0]), host_stats_.experts + static_cast<int64_t>(device[1])};
}

void MoeGemmRunner::reset_routing_stats() {
  host_stats_ = {};
  check(cudaMemsetAsync(device_stats_.ptr, 0, device_stats_.bytes, stream_), "MoE routing stats");
}

double MoeGemmRunner::timed_ms() { return timer_.total_ms(); }

MoeGemmRunner::TimedParts MoeGemmRunner::timed_parts() { return {sort_timer_.total_ms(), gemm_timer_.total_ms()}; }

void MoeGemmRunner::reset_timed_ms() {
  timer_.reset();
  sort_timer_.reset();
  gemm_timer_.reset();
}

}  // namespace plow::cuda
