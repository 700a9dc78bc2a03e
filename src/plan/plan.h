// Plan: a graph lowered for one bucket (a decode batch size or a prefill chunk) into buffers in one
// activation arena, tasks (op × column slice), dependency counters and per-worker queues. Plain data:
// lower.cpp makes it, wire.cpp writes/reads it, validate.cpp checks it, backends run it.
// The counter protocol, the limits and the file format are described in docs/plan.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "graph/graph.h"

namespace plow {

// 2: the routed experts became moe_gate_up + moe_down (moe_experts and moe_experts_add are gone).
// 3: the router became router_logits (column-sliced) + moe_topk (moe_router is gone).
// 4: slices are views: a slice op has no tasks and no buffer; its offset is its source's plus its first
//    column, its rows keep the source's stride, and its readers wait on the source (ActivationView).
inline constexpr uint32_t kPlanFormatVersion = 4;
inline constexpr int64_t kBufferAlignFloats = 16;

enum class PlanPhase : uint8_t { kDecode, kPrefill };
std::string_view phase_name(PlanPhase phase);  // "decode" | "prefill"

// Upper bounds on every count in a plan (checked by read_plan before allocating and by validate_plan).
// Each is far above what a real model needs (K3 at 8 ranks: ~2.5k ops; 132 workers: ~300k tasks).
struct PlanLimits {
  static constexpr int64_t kMaxBodyBytes = int64_t{64} << 20;    // JSON body of a .plow file
  static constexpr int64_t kMaxOps = int64_t{1} << 18;
  static constexpr int64_t kMaxTasks = int64_t{1} << 22;
  static constexpr int64_t kMaxCounters = int64_t{1} << 22;
  static constexpr int64_t kMaxWorkers = 1024;
  static constexpr int64_t kMaxTokens = int64_t{1} << 16;         // max_tokens of a bucket
  static constexpr int64_t kMaxWidth = int64_t{1} << 24;          // columns of one activation
  static constexpr int64_t kMaxArenaFloats = int64_t{1} << 36;    // 256 GiB: a sanity bound, see validate
  static constexpr int64_t kMaxWeights = int64_t{1} << 20;
  static constexpr int64_t kMaxWeightParts = int64_t{1} << 16;    // stacked experts per weight
  static constexpr int64_t kMaxShapeRank = 8;
  static constexpr int64_t kMaxDim = int64_t{1} << 40;
  static constexpr int64_t kMaxStates = int64_t{1} << 16;
  static constexpr int64_t kMaxOpInputs = 4096;
  static constexpr int64_t kMaxOpWeights = 4096;
  static constexpr int64_t kMaxAttrs = 64;
  static constexpr int64_t kMaxSignals = 4096;                    // counters one task bumps
  static constexpr int64_t kMaxNameBytes = 4096;                  // labels, weight and attribute names
  static constexpr int64_t kMaxRules = 65536;                     // compile.rules_fired entries
  static constexpr int64_t kMaxJsonDepth = 16;
};

// One op of the lowered graph: the graph node plus where its output lives.
struct PlanOp {
  uint8_t opcode = 0;            // an Op value; checked against the op table and the backend at load
  Attrs attrs;                   // named numbers, as in the graph node
  std::string label;
  std::vector<int32_t> inputs;   // indices of earlier ops
  std::vector<int32_t> weights;  // indices into Plan::weights
  int32_t state = -1;            // index into Plan::states, −1 for stateless ops
  int64_t width = 0;             // output columns
  OutDType dtype = OutDType::kAct;
  int64_t offset = 0;            // output buffer: arena floats [offset, offset + Plan::buffer_floats), row stride = width;
                                 // a view (slice): where its row 0 starts inside its source's buffer (ActivationView)

  Op op() const { return static_cast<Op>(opcode); }
  // A slice is a view of its input's columns: no buffer, no tasks; readers read the source in place.
  bool is_view() const { return op() == Op::kSlice; }
};

// One slice of one op. Runs when counter[wait_counter] ≥ wait_threshold × step number (epochs: the
// counters are never cleared), then bumps each counter of `signals` by one.
struct PlanTask {
  int32_t op = 0;
  int64_t col_begin = 0;         // output columns [col_begin, col_end), aligned to the op's slice granularity
  int64_t col_end = 0;
  int32_t wait_counter = 0;
  int64_t wait_threshold = 0;    // per step: the number of tasks that signal wait_counter
  std::vector<int32_t> signals;  // distinct counter ids
};

// Filled by the caller of lower_to_plan (the compiler): what fusion did to the graph.
struct PlanCompileInfo {
  int64_t ops_before_fusion = 0;
  std::vector<std::string> rules_fired;
};

struct Plan {
  uint32_t format_version = kPlanFormatVersion;
  uint64_t model_fingerprint = 0;  // model_fingerprint(config text, model graph): a plan runs only on its model
  PlanPhase phase = PlanPhase::kDecode;
  int64_t max_tokens = 0;          // the bucket: decode batch size or prefill chunk tokens (rows of every buffer)
  int32_t workers = 0;
  std::vector<PlanOp> ops;         // topological order (inputs precede users)
  std::vector<WeightDecl> weights; // the weights the ops read, bound by name at load
  std::vector<StateDecl> states;   // per-sequence state, one buffer per slot each
  std::vector<PlanTask> tasks;     // grouped by op, in op order
  int32_t counters = 0;            // number of dependency counters (lower_to_plan: one per op)
  std::vector<std::vector<int32_t>> queues;  // per worker: task indices in run order (op order)
  int64_t arena_floats = 0;        // activation arena size
  int32_t output_op = -1;          // the logits [T, vocab]
  PlanCompileInfo compile;
  std::string source = "<in memory>";  // where it came from (file path), for messages; not serialized

  const PlanOp& op(int32_t index) const { return ops.at(static_cast<size_t>(index)); }
  const PlanTask& task(int32_t index) const { return tasks.at(static_cast<size_t>(index)); }
  // Arena floats an op's buffer occupies: max_tokens × width rounded up to 64 bytes (no two buffers
  // share a cache line). Lowering and validation both reason about reuse over these extents.
  int64_t buffer_floats(const PlanOp& o) const { return (max_tokens * o.width + kBufferAlignFloats - 1) / kBufferAlignFloats * kBufferAlignFloats; }
  int64_t arena_bytes() const { return arena_floats * static_cast<int64_t>(sizeof(float)); }
};

// Where an op's output lives as its readers see it: row r at arena + offset + r × row_stride, `width`
// columns. For an op with a buffer: itself, its offset, stride = its width. For a view (slice; slices of
// slices compose): the op owning the buffer it looks into (the one readers wait on and keep alive),
// that buffer's offset plus the view's first column, and the owner's width as the stride.
struct ActivationView {
  int32_t owner = 0;
  int64_t offset = 0;
  int64_t row_stride = 0;
  int64_t width = 0;
};
// Requires every view's input to be an earlier op (validate_plan checks it before calling this).
ActivationView activation_view(const Plan& plan, int32_t op_index);

// What a backend reads per step besides the tokens (DESIGN.md §2 Step): lengths are runtime data, so
// one plan serves every batch composition up to its bucket.
struct StepSequenceDesc {
  int32_t slot = 0;
  int64_t first_row = 0;       // the sequence's rows in the step: [first_row, first_row + query_tokens)
  int64_t query_tokens = 0;
  int64_t context_tokens = 0;  // tokens the slot consumed before this step
  // MLA latent cache pages of the slot (GPU backends, paged cache). Unused on CPU: there the latent
  // cache of a slot is one contiguous buffer reserved to the maximum context at slot reset.
  std::vector<int32_t> page_table;
};

struct StepDescriptor {
  int64_t tokens = 0;  // T ≤ the plan's max_tokens
  std::vector<StepSequenceDesc> sequences;
};

// FNV-1a-64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3), continuing from `hash`.
uint64_t fnv1a64(std::string_view bytes, uint64_t hash = 0xcbf29ce484222325ULL);
// Hash of the config source text and the graph's ordered weight declarations (names, parts, shapes,
// MXFP4 flags): fixes the model a plan belongs to (not the weight values).
uint64_t model_fingerprint(std::string_view config_text, const Graph& model_graph);

}  // namespace plow
