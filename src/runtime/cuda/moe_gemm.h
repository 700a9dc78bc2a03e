// Routed experts of a prefill step as grouped GEMMs over routing-sorted tokens (issue H): a plan's
// moe_gate_up and moe_down(_add) ops on the GEMM path (prefill_gemm.h) run on the host between
// megakernel segments. Once per MoE layer the step's (token, slot) pairs are sorted by expert (on the
// device, or on the host after reading the top-k ids back), and the device gathers the pairs' rows in
// that order, runs one GEMM per expert with tokens (16-bit weights: one launch of the wgmma kernel,
// moe_wgmma.cu; cuBLAS where it declines), then applies the op body's activation (gate_up) or weighted
// sum in top-k order (down) with the op body's rounding points (ops/gemv.cuh), writing the op's output
// rows.
// Internal to src/runtime/cuda (backend.cpp, prefill_gemm.cpp).
#pragma once

#include <cublas_v2.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "plan/plan.h"
#include "runtime/cuda/device_memory.h"
#include "runtime/cuda/moe_lists.h"
#include "runtime/cuda/ops/limits.h"
#include "runtime/cuda/stream_timer.h"

namespace plow::cuda {

// One routed-expert op as GEMMs. Pair q = t·top_k + s is slot s of token t; its expert is id s of the
// top-k row t (k weights, then k ids as floats; ops/moe_topk.cuh). Per expert e, y = x·W_eᵀ with
// W_e [gemm_out, gemm_in] row-major (gate_up: w1/w3 [I, io]; down: w2 [out, I]).
struct MoeGemmOp {
  Op op = Op::kMoeGateUp;                       // kMoeGateUp, kMoeDown or kMoeDownAdd
  DeviceWeight w[2];                            // gate_up: gate (w1), up (w3); down: w2 (w[1] unused)
  int64_t x_offset = 0, x_stride = 0;           // input 0: x [T, io] (gate_up) or h [T, k·I] (down)
  int64_t routes_offset = 0, routes_stride = 0;  // input 1: [T, 2k] fp32
  int64_t shared_offset = 0, shared_stride = 0;  // input 2 of kMoeDownAdd: [T, out]
  int64_t out_offset = 0, width = 0;            // output rows, row stride width (gate_up k·I, down out)
  int64_t top_k = 0, experts = 0, gemm_in = 0, gemm_out = 0;
  int32_t act = 0;        // the activation dtype (ActType)
  bool round_out = true;  // the op's output is in the activation dtype (false: a tensor-parallel partial sum)
  bool situ = false;      // gate_up: SiTU (else SiLU·mul); β and β_lin as the op's attributes
  float beta = 0, linear_beta = 0;

  bool gate_up() const { return op == Op::kMoeGateUp; }
  int sets() const { return gate_up() ? 2 : 1; }  // GEMMs per expert: gate and up, or down
  // GEMM inputs and outputs: bf16/f16 weights read a bf16/f16 copy of the (exact) activations; their
  // outputs are rounded to that type by cuBLAS where the op body rounds the dot (gate and up always,
  // down's per-expert dot when round_out), else fp32. fp32 weights: fp32 throughout.
  int32_t in_type() const { return w[0].type; }
  int32_t out_type() const { return w[0].type != kWF32 && (gate_up() || round_out) ? w[0].type : kWF32; }
};

// The GEMM form of `op` (a kMoeGateUp, kMoeDown or kMoeDownAdd) with its weights on the device, when
// it has one: dense expert stacks whose type takes the input exactly (as gemm_form: fp32, or bf16/f16
// with activations of that dtype); MXFP4 experts keep the GEMV bodies. Else nullopt.
std::optional<MoeGemmOp> moe_gemm_form(const Plan& plan, const PlanOp& op, const std::vector<DeviceWeight>& weights, int32_t act);

// Device memory the MoE GEMMs of some plans need at their largest step (max_tokens rows).
struct MoeGemmCapacity {
  int64_t pairs = 0, routes_floats = 0, experts = 0, in_bytes = 0, out_bytes = 0;
  void add(const MoeGemmOp& op, int64_t max_rows);
  void merge(const MoeGemmCapacity& other);
};

// Steps of at most this many (token, slot) pairs per expert of the stack (a batch of ≤ 32 decode rows
// at the 48B shape: 256 experts, top-8) route on the device and take the expert GEMV
// (launch_moe_route, launch_moe_gemv): no host synchronization in the step. Larger steps take the GEMMs
// (the wgmma kernel after a device sort, launch_moe_sort; else cuBLAS after the host's). Measured at 2
// pairs an expert, when those were all on the host and cuBLAS (H200, 48B shape,
// context 4096, ms a step, host / device): batch 48 46.2 / 45.8, batch 64 53.4 / 54.8.
// Also at most kMoeDeviceMaxPairs pairs over kMoeDeviceMaxExperts experts, input rows that stage in
// kMoeGemvMaxStagedBytes (ops/limits.h).
inline constexpr int64_t kMoeDevicePairsPerExpert = 1;

// How a MoE op's expert GEMMs ran.
enum class ExpertGemmPath {
  kNone,             // no op yet
  kWgmma,            // launch_moe_wgmma: one launch over every expert's jobs
  kCublasGrouped,    // one cublasGemmGroupedBatchedEx call
  kCublasPerExpert,  // one cublasGemmEx per expert with tokens (fp32, or rows the others refuse)
  kGemv,             // launch_moe_gemv after a device routing
};
const char* expert_gemm_path_name(ExpertGemmPath path);

// Runs MoE ops on one stream. Per step: new_step(), then run() for each MoE host op in plan order.
// A gate_up op sorts the routing: on the device for decode-sized steps (kMoeDevicePairsPerExpert,
// launch_moe_route) and for larger ones whose GEMMs take the wgmma kernel (launch_moe_sort), else on the
// host (device → host, one stream synchronization, the sorted pairs uploaded); the down op that follows
// reuses the lists (the same top-k buffer, still live: it is its input) when it takes the same path.
class MoeGemmRunner {
 public:
  // `error`: the backend's device error flag (kErrRouting from the device routing sort).
  MoeGemmRunner(const MoeGemmCapacity& capacity, cudaStream_t stream, int32_t* error);
  ~MoeGemmRunner();
  MoeGemmRunner(const MoeGemmRunner&) = delete;
  MoeGemmRunner& operator=(const MoeGemmRunner&) = delete;

  void new_step() {
    routing_.valid = false;
    down_input_.valid = false;
  }
  // The op over the step's `rows` rows: its output rows written, final and rounded (the op's tasks do
  // nothing: kOpHostDone, prefill_gemm.cpp).
  void run(const MoeGemmOp& op, float* arena, int64_t rows);

  int64_t calls() const { return calls_; }  // ops run
  // Tokens per expert of the last routing (tests: which experts got none, which got all); after a
  // device routing, read from the device (waits for the stream).
  const std::vector<int32_t>& last_expert_tokens();
  // How the last op's GEMMs ran (ExpertGemmPath), and whether as the expert GEMV after a device
  // routing (kMoeDevicePairsPerExpert).
  ExpertGemmPath last_path() const { return last_path_; }
  bool last_gemv() const { return last_path_ == ExpertGemmPath::kGemv; }
  // Benchmarks and tests: cuBLAS's grouped call instead of the wgmma kernel where both apply (the peer
  // the kernel is measured against in the same run).
  void set_prefer_cublas(bool on) { prefer_cublas_ = on; }
  // Routing reads since the last reset, and the experts with pairs summed over them (benchmarks: how
  // many distinct experts a step's MoE ops actually stream, against uniform routing's expectation).
  struct RoutingStats {
    int64_t reads = 0, experts = 0;
  };
  RoutingStats routing_stats();  // host and device routings since the reset (waits for the stream)
  void reset_routing_stats();
  // Timing (benchmarks): with it on, each op's stream time from after its routing read to its last
  // kernel (the host's sorting included) is added up; timed_ms() synchronizes the stream.
  void set_timing(bool on) { timing_ = on; }
  double timed_ms();
  // Of that time: the routing sort (on the host with the lists' upload, the stream idle; or on the
  // device), and the GEMM launches of large steps (the rest is the gathers and the epilogues).
  struct TimedParts {
    double sort_ms = 0, gemm_ms = 0;
  };
  TimedParts timed_parts();
  void reset_timed_ms();

 private:
  struct Routing {
    bool valid = false;
    bool device = false;  // sorted on the device: the counts and the active count live in device_counts_
    bool sorted = false;  // by launch_moe_sort (a large step whose GEMMs take the wgmma kernel), not launch_moe_route
    int64_t routes_offset = -1, rows = 0, top_k = 0;
    std::vector<int32_t> counts;                  // [experts] pairs per expert
    std::vector<int32_t> active, offsets;         // experts with pairs, ascending, and their first sorted pair
    int64_t job_list_at = 0;                      // ints into lists_: the wgmma kernel's job list (moe_lists.h)
    int short_grid = 0, long_grid = 0;            // its launches' grids: the host's job counts, or the device sort's bound
    // Valid for `op`'s top-k buffer over a step of step_rows rows, sorted on the device or the host, by
    // launch_moe_sort or not; a device routing's host counts and lists are cleared.
    void mark(const MoeGemmOp& op, int64_t step_rows, bool on_device, bool by_sort);
  };
  void read_routing(const MoeGemmOp& op, const float* arena, int64_t rows);
  void route_on_device(const MoeGemmOp& op, const float* arena, int64_t rows);
  void sort_on_device(const MoeGemmOp& op, const float* arena, int64_t rows);
  bool wgmma_takes(const MoeGemmOp& op) const;
  void sort_routing(const MoeGemmOp& op, int64_t rows);
  // wgmma: on launch_moe_wgmma (run() decides), else on cuBLAS; b_rows: null, or the wgmma kernel reads
  // sorted row p from row b_rows[p] / b_div of the input (gate_up).
  void gemms(const MoeGemmOp& op, int64_t pairs, bool wgmma, const int32_t* b_rows, int32_t b_div);
  void epilogue(const MoeGemmOp& op, float* arena, int64_t rows);
  // Whether the down op's sorted input rows are in in_ already: its gate_up's epilogue wrote them there
  // (as its gather would copy them from that op's output) and nothing has used in_ since.
  bool down_input_ready(const MoeGemmOp& op, int64_t rows) const;

  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  MoeGemmCapacity capacity_;
  int32_t* error_ = nullptr;
  DeviceBuffer workspace_, lists_, pointers_, in_, out_;
  DeviceBuffer device_counts_, device_stats_;  // device routing: pairs per expert [experts], then the active count; reads and experts (2 × u64)
  DeviceBuffer sort_scratch_;                   // launch_moe_sort's keys, sorted keys, values and radix-sort storage
  MoeSortBuffers sort_buffers_;
  std::vector<float> routes_host_;
  std::vector<int32_t> lists_host_;  // perm [pairs], inv [pairs], active experts, their offsets, the jobs
  Routing routing_;
  // The down input a gate_up epilogue left in in_: its output (arena offset, row stride), width, rows,
  // row stride in in_ and element type.
  struct DownInput {
    bool valid = false;
    int64_t x_offset = -1, x_stride = 0, cols = 0, rows = 0, ld = 0;
    int32_t type = -1;
  } down_input_;
  RoutingStats host_stats_;
  // The grouped call's host arrays, one set per op kind (gate_up, down): each is rewritten only after
  // a stream synchronization that follows its last use (a gate_up's routing read).
  struct HostArrays {
    std::vector<cublasOperation_t> transa, transb;
    std::vector<int> m, n, k, lda, ldb, ldc, group_size;
    std::vector<float> alpha, beta;
  } arrays_[2];
  bool grouped_ok_ = true;  // cleared when cuBLAS reports the grouped call unsupported
  bool prefer_cublas_ = false;
  ExpertGemmPath last_path_ = ExpertGemmPath::kNone;
  int64_t calls_ = 0;
  bool timing_ = false;
  StreamTimer timer_, sort_timer_, gemm_timer_;
};

// ---- device side (moe_gemm.cu) ------------------------------------------------------------------------

// dst[p, c] (row stride ld, element type `type`: kWBF16, kWF16 or kWF32) = the fp32 row of pair
// perm[p] for c < cols: base + (q / top_k)·stride + (q % top_k)·slot_width (slot_width 0: every slot
// reads its token's row). perm null: q = p·top_k (rows converted in order: p = token).
void launch_moe_gather(const float* base, int64_t stride, int64_t slot_width, int64_t top_k, const int32_t* perm, int64_t pairs, int64_t cols,
                       void* dst, int64_t ld, int32_t type, cudaStream_t stream);
// The grouped call's pointer arrays for `n` experts (groups: their ids, then their first sorted pair)
// and `sets` weight stacks: A[j·n + i] = w_j + e_i·part_bytes, B[…] = b + offset_i·b_row_bytes,
// C[…] = c_j + offset_i·c_row_bytes; ptrs = A, B, C back to back (3·sets·n).
void launch_moe_pointers(const int32_t* groups, int n, int sets, const uint8_t* w0, const uint8_t* w1, int64_t part_bytes, const uint8_t* b,
                         int64_t b_row_bytes, uint8_t* c0, uint8_t* c1, int64_t c_row_bytes, void** ptrs, cudaStream_t stream);
// The device routing of a step of `rows` top-k rows (stride `stride` floats: k weights, then k ids as
// floats) over `experts` experts (≤ kMoeDeviceMaxExperts, rows·k ≤ kMoeDeviceMaxPairs), in one block:
// perm [pairs] (sorted position → pair, ascending token order within an expert) and inv [pairs] as the
// host's counting sort writes them, the experts with pairs in ascending order at active [0, n) and
// their first sorted pairs at offsets [0, n); counts [experts] the pairs per expert, then n; stats
// [2] += {1, n}. An id that is not an integer in 0..experts-1 sets *error to kErrRouting (and counts
// as expert 0).
void launch_moe_route(const float* routes, int64_t stride, int64_t rows, int64_t top_k, int experts, int32_t* perm, int32_t* inv, int32_t* active,
                      int32_t* offsets, int32_t* counts, unsigned long long* stats, int32_t* error, cudaStream_t stream);
// The expert GEMMs of a device-routed step as weight streaming: block (column slice, expert i < n,
// n = counts[experts] on the device; grid rows max_n ≥ n): its sorted rows b (row stride ld_in, type
// in_type) staged, then one warp per pair of weight rows streams them against the staged rows (fp32
// accumulate, each weight read once an expert) and writes c_j[p, o] (row stride ld_out, type
// out_type: rounded to it) for `sets` stacks w[0..sets). False, launching nothing: a type pairing it
// has no kernel for, or rows too wide to stage.
bool launch_moe_gemv(const int32_t* active, const int32_t* offsets, const int32_t* n, int max_n, int64_t pairs, const DeviceWeight* w, int sets,
                     int64_t gemm_in, int64_t gemm_out, const void* b, int64_t ld_in, int32_t in_type, void* c0, void* c1, int64_t ld_out,
                     int32_t out_type, cudaStream_t stream);
// The expert GEMMs of a step on Hopper's warpgroup MMA (moe_wgmma.cu): for each job of `job_list`
// (moe_lists.h: expert e, first sorted row f, rows n) and stack j < sets, c_j[f + i, o] =
// Σ_k b[f + i, k]·w_j[e][o, k] for i < n, o < gemm_out (fp32 accumulation, rounded once to out_type:
// in_type or kWF32). b: sorted rows, row stride ld_in, of in_type (kWBF16 or kWF16, the weights' type);
// c_j row stride ld_out. With `b_rows` (not null), sorted row p of b is row b_rows[p] / b_div of it
// instead (gate_up reads its tokens' rows converted once, not a gathered copy per pair). The grids
// hold short_grid and long_grid jobs: the list's counts, or more (a device routing: the blocks past
// the list's counts return). False, launching nothing, where
// moe_wgmma_supports is: types, alignment (16-byte rows: gemm_in and ld_in multiples of 8) or sizes it
// has no kernel for.
bool moe_wgmma_supports(const DeviceWeight* w, int sets, int64_t gemm_in, int64_t gemm_out, const void* b, int64_t ld_in, int32_t in_type, int32_t out_type);
bool launch_moe_wgmma(const int32_t* job_list, int short_grid, int long_grid, const DeviceWeight* w, int sets, int64_t gemm_in, int64_t gemm_out,
                      const void* b, int64_t ld_in, int32_t in_type, const int32_t* b_rows, int32_t b_div, void* c0, void* c1, int64_t ld_out,
                      int32_t out_type, cudaStream_t stream);
// The routing of a step too large for launch_moe_route, sorted on the device into the lists the host's
// sort writes (perm, inv, the active experts and their first sorted pairs, at most min(pairs, experts)
// of each, the active count at counts[experts]) and the wgmma kernel's job list: the pairs' expert ids
// as keys of a stable radix sort (ascending token order within an expert), counts by histogram, the
// lists and jobs by block scans over the experts (≤ kMoeDeviceMaxExperts). An id that is not an integer
// expert index sets *error to kErrRouting (and counts as expert 0). stats [2] += {1, active experts}.
size_t moe_sort_temp_bytes(int64_t pairs);
void launch_moe_sort(const float* routes, int64_t stride, int64_t rows, int64_t top_k, int experts, const MoeSortBuffers& buffers, int32_t* perm, int32_t* inv,
                     int32_t* active, int32_t* offsets, int32_t* job_list, int32_t* counts, unsigned long long* stats, int32_t* error, cudaStream_t stream);
// gate_up: out[q·inter + i] for sorted pair p (q = perm[p]) from gate/up rows p (row stride ld, type
// `type`), with op_moe_gate_up's rounding; with `sorted` (not null) also sorted[p·sorted_ld + i] in
// sorted_type: the down op's sorted input rows, as launch_moe_gather would copy them from `out`.
void launch_moe_activation(const void* gate, const void* up, int64_t ld, int32_t type, const int32_t* perm, int64_t pairs, int64_t inter, float* out,
                           int32_t act, bool round_out, bool situ, float beta, float linear_beta, void* sorted, int64_t sorted_ld, int32_t sorted_type,
                           cudaStream_t stream);
// down: out[t·width + o] = Σ_s route[t][s]·y[inv[t·k + s], o] in slot order, with op_moe_down_impl's
// rounding; shared (kMoeDownAdd) added after, or null.
void launch_moe_combine(const void* y, int64_t ld, int32_t type, const int32_t* inv, int64_t rows, int64_t top_k, int64_t width, const float* routes,
                        int64_t routes_stride, const float* shared, int64_t shared_stride, float* out, int32_t act, bool round_out, cudaStream_t stream);

}  // namespace plow::cuda
