// The device-side view of a plan (DESIGN.md §2), as plain structs shared by host and device code
// (device.cuh adds the device helpers): what every CUDA op body sees. A plan op becomes one
// OpDesc in device memory (pointers resolved, attributes packed, decoded once on the host); a task is
// one op over a column slice, run by one block of kThreads threads. The same op bodies serve the
// persistent megakernel (a block walks its queue, waiting on epoch counters) and cuda-eager (one
// launch per op, one block per task). Op bodies synchronize only within their block.
#pragma once

#include <cstdint>

namespace plow::cuda {

inline constexpr int kThreads = 512;                 // threads of every worker block
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kSharedBytes = 144 * 1024;      // dynamic shared memory every op body may use (chunked KDA needs ~144 KB)
inline constexpr int64_t kScratchFloats = 1 << 18;   // per-block global scratch (1 MiB) for op bodies
inline constexpr int kMaxAttrs = 16;

enum WeightType : int32_t { kWF32 = 0, kWBF16 = 1, kWF16 = 2, kWMXFP4 = 3 };
enum ActType : int32_t { kAF32 = 0, kABF16 = 1, kAF16 = 2 };

// A weight in device memory: one 2-D matrix, or a stack of `parts` equally shaped ones (experts).
// Dense: element (r, c) of part p at data + p·part_bytes + (r·cols + c)·elem_size.
// MXFP4 (§7.7): packed codes [rows, cols/2] (low nibble = even column) at data + p·part_bytes, E8M0
// scales [rows, cols/32] at scales + p·scale_part_bytes; e = 0xFF decodes to NaN.
struct DeviceWeight {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;  // 1-D weights: rows = 1
  int64_t part_bytes = 0, scale_part_bytes = 0;
  int32_t type = kWF32;
  int32_t parts = 1;
};

// Per-sequence state of one StateDecl for every slot: slot s at base + s·slot_elems elements of `elem`
// (an ActType: kAF32, or the 16-bit activation dtype). Conv window [width, depth] (oldest column first,
// as on the CPU) and KDA recurrent [heads, d, d] are fp32; the MLA latent cache [max_context, width],
// rows in position order, holds the activation dtype: its rows are rounded to it (the normed latent,
// and k_r from kv_a's rounded output), so 16 bits store them exactly at half the bytes.
struct DeviceState {
  void* base = nullptr;
  int64_t slot_elems = 0;
  int64_t width = 0, depth = 0;
  int32_t elem = kAF32;
};

// Bytes of one state element.
inline constexpr int64_t state_elem_bytes(int32_t elem) { return elem == kAF32 ? 4 : 2; }

// One op of the plan. Activations live in one fp32 arena (values already rounded to their dtype, as on
// the CPU); an input i is rows of in_width[i] floats, row r at arena + in_offset[i] + r·in_stride[i]
// (in_stride > in_width when the input is a view of a wider buffer's columns: a plan's slice).
struct OpDesc {
  int32_t opcode = 0;
  int32_t act = kAF32;            // the model's activation dtype (rounding points)
  int32_t round_out = 1;          // 1: the output is rounded to `act` (OutDType::kAct); 0: fp32
  int32_t num_inputs = 0;
  int32_t num_weights = 0;
  int32_t state = -1;             // index into StepView::states, −1 when stateless
  int64_t width = 0;              // output columns
  int64_t out_offset = 0;         // output rows of `width` floats at arena + out_offset
  const int64_t* in_offset = nullptr;  // [num_inputs]
  const int64_t* in_width = nullptr;   // [num_inputs]
  const int64_t* in_stride = nullptr;  // [num_inputs] floats between rows
  const DeviceWeight* weights = nullptr;  // [num_weights]
  float attr[kMaxAttrs] = {};     // packed by pack_attrs (attrs.cpp): op-specific order
  // The op's task count (every op: moe_topk and the row-reduction norms share rows by it). Tasks that
  // cooperate across blocks within one op (MLA split-KV, ops/mla.cuh) also get a global workspace they
  // share during one step (null / 0 for other ops). Every op gets kOpCounters counters (`sync`) that
  // are 0 whenever the op is not running: kOpSyncCounters for the cooperating ops' phases (the last
  // task to leave resets them), then kKdaPairCounters for kda_fused_core's split pairs (a counter a
  // pair, reset by the pair's last part; ops/kda_fused.cuh).
  int32_t tasks = 1;
  // Bit i: input i may hold values not yet rounded to `act` (a prefill GEMM's fp32 output whose own
  // rounding pass is skipped, prefill_gemm.h round_in_mask), and the body rounds them as it loads them
  // (TaskCtx::in_act). Only the bodies of rounds_inputs_on_load's opcodes read it; rounding a value
  // that is already rounded leaves it as it is, so steps whose producers did round are unchanged.
  int32_t round_in = 0;
  float* workspace = nullptr;
  int64_t workspace_floats = 0;
  unsigned* sync = nullptr;
};
inline constexpr int kOpSyncCounters = 4;
inline constexpr int kKdaPairCounters = 128;
inline constexpr int kOpCounters = kOpSyncCounters + kKdaPairCounters;

// Tensor parallelism inside the kernel (peer_reduce.h): every rank's receive area as this rank maps it.
// An area holds flags [2][ops][size] (uint32: the collective epoch that filled the slot), then slots
// [2][ops][size][slot_floats] (fp32 partial sums), indexed [epoch parity][all_reduce ordinal][source rank].
inline constexpr int kMaxPeerRanks = 8;
struct PeerTable {
  unsigned* flags[kMaxPeerRanks] = {};
  float* slots[kMaxPeerRanks] = {};
  int32_t rank = 0, size = 1, ops = 0;
  int64_t slot_floats = 0;
};

// The step, as the device sees it (rebuilt by the host before every step). Rows of a sequence are
// contiguous; row r belongs to sequence row_seq[r] at absolute position row_pos[r].
struct StepView {
  int32_t tokens = 0;             // T ≤ the plan's max_tokens
  int32_t num_seqs = 0;
  const int32_t* token_ids = nullptr;   // [T]
  const int32_t* row_seq = nullptr;     // [T]
  const int32_t* row_pos = nullptr;     // [T]
  const int32_t* seq_slot = nullptr;    // [num_seqs]
  const int32_t* seq_first_row = nullptr;
  const int32_t* seq_tokens = nullptr;  // query tokens of the sequence in this step
  const int32_t* seq_context = nullptr; // tokens the slot held before this step
  const DeviceState* states = nullptr;  // [plan states]
  int32_t* error = nullptr;             // first device-side error code (0 = none), see kErr*
  // Tensor parallelism: the peers' areas when this step's all_reduces run in the kernel, else null
  // (the host summed them through NCCL); the step's collective epoch (the same on every rank).
  const PeerTable* peers = nullptr;
  uint32_t coll_epoch = 0;
};

inline constexpr int32_t kErrBadToken = 1;     // a token id outside the vocabulary
inline constexpr int32_t kErrContext = 2;      // a sequence grew past the slot's cache
inline constexpr int32_t kErrOpcode = 3;       // an opcode without a device body
inline constexpr int32_t kErrPeerTimeout = 4;  // an in-kernel all_reduce waited 20 s for a peer
inline constexpr int32_t kErrPeerSlot = 5;     // an in-kernel all_reduce larger than its slot
inline constexpr int32_t kErrWorkspace = 6;    // a step's work outgrew an op's workspace or a GEMV body's scratch (a sizing bug)
inline constexpr int32_t kErrRouting = 7;      // a top-k row named no expert of the stack (moe_gemm.h's device routing)

}  // namespace plow::cuda
