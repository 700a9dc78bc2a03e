// CUDA op bodies vs the CPU reference (label gpu; runs on the GPU machine only), in the style of
// llama.cpp's test-backend-ops: a table of cases with odd shapes, each a small graph
// tokens → embedding(s) → the op under test, lowered to a decode and a prefill plan (3 or 7 workers, so
// slices are exercised; 132 for the "_rows600" cases, whose tasks share rows) and run step by step — prefill, mixed and decode steps over three slots, so
// state carries — through ReferenceBackend and CudaBackend (eager and megakernel), f32 and bf16.
// The op's inputs come straight from embedding tables (exact on both backends), so a difference is the
// op's own. "_view" cases take every input through a slice of a wider embedding at an odd column offset:
// a plan reads it in place (row stride > width, unaligned base), the reference copies it. Error unit per case: |gpu − ref| / (ε_out · max(|ref|, floor · scale)), ε_out = 2⁻²³ for
// fp32 outputs and 2⁻⁷ (one bf16 ulp at the bottom of a binade) for bf16; scale = max |ref| of the step.
// Columns a case marks exact (moe_topk's expert ids) must be bit-identical and stay out of the scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "graph/graph.h"
#include "graph/weights.h"
#include "model/safetensors.h"
#include "plan/lower.h"
#include "runtime/cpu/reference.h"
#include "runtime/cuda/backend.h"

namespace plow {
namespace {

constexpr int64_t kVocab = 61;
constexpr int kSlots = 3;
constexpr int64_t kDecodeTokens = 4;    // decode plan bucket (steps of 1-token sequences)
constexpr int64_t kPrefillTokens = 72;  // prefill plan bucket (holds the 70-token step: CPU chunks 64 + 6)
constexpr int64_t kMaxContext = 128;

// A weight declared by a case and how to draw it: mean + std·N(0,1), then an optional edit (ties).
struct WeightSpec {
  WeightSpec(std::string name_, std::vector<int64_t> shape_, float mean_, float std_, bool f32_ = false)
      : name(std::move(name_)), shape(std::move(shape_)), mean(mean_), std(std_), f32(f32_) {}
  std::string name;
  std::vector<int64_t> shape;
  float mean, std;
  bool f32;  // stored fp32 whatever the case's dtype (A_log, dt_bias, router bias)
  std::function<void(std::vector<float>&)> edit;
};

// The graph of one case under construction: tokens, embeddings, weights and states.
class CaseGraph {
 public:
  CaseGraph() { tokens = graph.add(Op::kTokens, {}, {}, {}, "tokens"); }

  int weight(WeightSpec spec) {
    const int id = graph.add_weight({spec.name, {spec.name}, spec.shape, false, false});
    specs.push_back(std::move(spec));
    return id;
  }
  // An embedding of the tokens through a fresh random table [kVocab, width] (values ~ N(0, std²)); with
  // `views`, columns [7, 7 + width) of one [kVocab, width + 20] (a plan's view: stride width + 20).
  int embed(int64_t width, float std = 1.0f) {
    const std::string name = "embed" + std::to_string(embeddings++);
    const int64_t wide = views ? width + 20 : width;
    const int table = graph.add(Op::kEmbedding, {tokens}, {weight({name + ".weight", {kVocab, wide}, 0.0f, std})}, {}, name);
    if (!views) return table;
    return graph.add(Op::kSlice, {table}, {}, {{"offset", 7.0}, {"width", double(width)}}, name + ".view");
  }
  int op(Op op, std::vector<int> inputs, std::vector<int> weights, Attrs attrs, int state = -1) {
    const int id = graph.add(op, std::move(inputs), std::move(weights), std::move(attrs), "under_test", state);
    graph.set_output(id);
    return id;
  }

  Checkpoint checkpoint(DType storage, uint64_t seed) const {
    Checkpoint checkpoint = Checkpoint::in_memory("cuda op test");
    std::mt19937_64 rng(seed);
    for (const WeightSpec& spec : specs) {
      int64_t count = 1;
      for (int64_t d : spec.shape) count *= d;
      std::normal_distribution<float> normal(spec.mean, spec.std);
      std::vector<float> values(static_cast<size_t>(count));
      for (float& v : values) v = normal(rng);
      if (spec.edit) spec.edit(values);
      const DType dtype = spec.f32 ? DType::F32 : storage;
      std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
      for (size_t i = 0; i < values.size(); ++i) {
        if (dtype == DType::F32) {
          std::memcpy(bytes.data() + 4 * i, &values[i], 4);
        } else {
          const uint16_t b = f32_to_bf16(values[i]);
          std::memcpy(bytes.data() + 2 * i, &b, 2);
        }
      }
      checkpoint.add_tensor(spec.name, dtype, spec.shape, std::move(bytes));
    }
    return checkpoint;
  }

  Graph graph;
  int tokens = -1;
  int embeddings = 0;
  bool views = false;
  std::vector<WeightSpec> specs;
};

// Error bound of a case, in the unit of the file comment (0 = bit-exact). Elements below floor·scale are
// measured against floor·scale: 0.01 keeps small elements honest, 1 measures against the scale where
// cancellation (a sum of larger terms) or an inherent deviation (MLA in bf16) makes element-relative
// errors meaningless.
struct Bound {
  double f32 = 0, bf16 = 0;
  double floor_f32 = 0.01, floor_bf16 = 0.01;
};

struct OpCase {
  std::string name;
  Op op;
  std::function<void(CaseGraph&)> build;
  Bound bound;
  bool f32_out = false;  // the op's output is fp32 whatever the activation dtype
  int64_t exact_from = -1;  // columns from here on must be bit-identical and stay out of the scale (expert ids)
  std::vector<std::vector<SequenceStep>> steps = {};  // the steps run; empty: script()
  int workers = 0;  // the plans' workers; 0: 3 or 7 (by the case's index)
};

// ---- case builders ---------------------------------------------------------------------------------

OpCase elementwise(std::string name, Op op, int64_t width, int arity, Attrs attrs, Bound bound, bool f32_out = false) {
  return {std::move(name), op, [=](CaseGraph& g) {
            std::vector<int> inputs;
            for (int i = 0; i < arity; ++i) inputs.push_back(g.embed(width, 2.0f));
            g.op(op, inputs, {}, attrs);
          }, bound, f32_out};
}

WeightSpec norm_weight(std::string name, int64_t width) { return {std::move(name), {width}, 1.0f, 0.1f}; }

OpCase rms_norm(int64_t width) {
  return {"rms_norm_" + std::to_string(width), Op::kRmsNorm, [=](CaseGraph& g) {
            g.op(Op::kRmsNorm, {g.embed(width)}, {g.weight(norm_weight("w", width))}, {{"eps", 1e-5}});
          }, {32, 2}};
}

OpCase add_norm(int64_t width) {
  return {"add_norm_" + std::to_string(width), Op::kAddNorm, [=](CaseGraph& g) {
            g.op(Op::kAddNorm, {g.embed(width), g.embed(width)}, {g.weight(norm_weight("w", width))}, {{"eps", 1e-6}});
          }, {32, 2}};
}

OpCase gated_rms_norm(int64_t heads, int64_t d) {
  return {"gated_rms_norm_h" + std::to_string(heads) + "_d" + std::to_string(d), Op::kGatedRmsNorm, [=](CaseGraph& g) {
            g.op(Op::kGatedRmsNorm, {g.embed(heads * d), g.embed(heads * d)}, {g.weight(norm_weight("w", d))},
                 {{"heads", double(heads)}, {"head_dim", double(d)}, {"eps", 1e-5}});
          }, {32, 2}};
}

OpCase short_conv(int64_t channels, int64_t kernel) {
  return {"short_conv_silu_c" + std::to_string(channels) + "_k" + std::to_string(kernel), Op::kShortConvSilu, [=](CaseGraph& g) {
            const int window = g.graph.add_state({StateKind::kConvWindow, channels, kernel - 1, "window"});
            g.op(Op::kShortConvSilu, {g.embed(channels)}, {g.weight({"conv", {channels, 1, kernel}, 0.0f, 0.5f})},
                 {{"kernel", double(kernel)}}, window);
          },
          // fp32: a K-term sum (fused multiply-adds on the GPU, separate roundings on the CPU) + expf of SiLU:
          // 16.4 units observed on the H200 at K ≤ 4, 72 at K = 33, so 8 units a term, at least 32.
          {kernel > 4 ? 8 * static_cast<double>(kernel) : 32.0, 1}};
}

Attrs gate_attrs(int64_t heads, int64_t d, bool bounded) {
  Attrs attrs = {{"heads", double(heads)}, {"head_dim", double(d)}};
  if (bounded) attrs.set("lower_bound", -5.0);
  return attrs;
}

int kda_gate_node(CaseGraph& g, int64_t heads, int64_t d, bool bounded, float f_std, bool output) {
  const int f = g.embed(heads * d, f_std);
  const std::vector<int> weights = {g.weight({"A_log", {heads}, 1.0f, 0.8f, true}), g.weight({"dt_bias", {heads * d}, 0.0f, 0.5f, true})};
  if (output) return g.op(Op::kKdaGate, {f}, weights, gate_attrs(heads, d, bounded));
  return g.graph.add(Op::kKdaGate, {f}, weights, gate_attrs(heads, d, bounded), "gate");
}

OpCase kda_gate(int64_t heads, int64_t d, bool bounded, float f_std) {
  // f_std 12 puts f + dt_bias past softplus's threshold of 20 for some channels.
  return {"kda_gate_h" + std::to_string(heads) + "_d" + std::to_string(d) + (bounded ? "_bounded" : "") + (f_std > 4 ? "_wide" : ""),
          // log(1 + exp(z)) for z ≪ 0 loses the ulps of 1 + e^z: measured against the scale.
          Op::kKdaGate, [=](CaseGraph& g) { kda_gate_node(g, heads, d, bounded, f_std, true); }, {64, 64, 1.0, 1.0}, true};
}

OpCase kda_delta_rule(int64_t heads, int64_t d, bool bounded, float gate_std = 1.0f) {
  return {"kda_delta_rule_h" + std::to_string(heads) + "_d" + std::to_string(d) + (bounded ? "_bounded" : "") + (gate_std > 4 ? "_strong" : ""),
          Op::kKdaDeltaRule,
          [=](CaseGraph& g) {
            const int q = g.embed(heads * d), k = g.embed(heads * d), v = g.embed(heads * d);
            const int gate = kda_gate_node(g, heads, d, bounded, gate_std, false);
            const int beta = g.graph.add(Op::kSigmoid, {g.embed(heads)}, {}, {}, "beta");
            const int state = g.graph.add_state({StateKind::kKdaRecurrent, heads * d, heads, "state"});
            g.op(Op::kKdaDeltaRule, {q, k, v, gate, beta}, {}, {{"heads", double(heads)}, {"head_dim", double(d)}}, state);
          },
          // fp32: the GPU's recurrent (short sequences) or chunked form vs the CPU's chunked form agree to
          // ~1e-6 of the scale (host emulation of the bodies: recurrent ≤ 11 units, chunked ≤ 11); bf16: one
          // rounding of that (emulation: ≤ 0.9).
          {128, 2, 1.0, 0.01}};
}

// The KDA mixer's core in one op (kda_fused_core, the compiler's kda-core-fuse in decode plans): three
// convs over their own windows, the gate's f_b projection (f of f_width columns: one-token pairs take
// the bf16 body's eight-column loads at a multiple of 8, longer ones its four-column loads at a multiple
// of 4; others the scalar paths), β and the delta rule. Every step of the script, so one-token pairs
// (fused_core_token) and prefill-sized sequences (33, 70: two of its 64-token tiles) token by token.
// With g_width > 0, the output norm too (kda-core-gated-norm): g [T, g_width] through W_gb, the gated
// RMSNorm over each head of the core's output.
OpCase kda_fused_core(int64_t heads, int64_t d, bool bounded, int64_t f_width, int64_t kernel, int64_t g_width = 0) {
  return {"kda_fused_core_h" + std::to_string(heads) + "_d" + std::to_string(d) + "_f" + std::to_string(f_width) + "_k" + std::to_string(kernel) +
              (bounded ? "_bounded" : "") + (g_width > 0 ? "_norm_g" + std::to_string(g_width) : ""),
          Op::kKdaFusedCore,
          [=](CaseGraph& g) {
            const int64_t width = heads * d;
            std::vector<int> inputs, weights;
            Attrs attrs = gate_attrs(heads, d, bounded);
            attrs.set("kernel", double(kernel));
            for (const char* name : {"q", "k", "v"}) {
              inputs.push_back(g.embed(width));
              weights.push_back(g.weight({std::string(name) + "_conv", {width, 1, kernel}, 0.0f, 0.5f}));
              attrs.set(std::string("conv_") + name, g.graph.add_state({StateKind::kConvWindow, width, kernel - 1, std::string(name) + "_window"}));
            }
            inputs.push_back(g.embed(f_width));
            inputs.push_back(g.embed(heads));
            weights.push_back(g.weight({"f_b", {width, f_width}, 0.0f, 1.0f / std::sqrt(float(f_width))}));
            weights.push_back(g.weight({"A_log", {heads}, 1.0f, 0.8f, true}));
            weights.push_back(g.weight({"dt_bias", {width}, 0.0f, 0.5f, true}));
            if (g_width > 0) {
              inputs.push_back(g.embed(g_width));
              weights.push_back(g.weight({"g_b", {width, g_width}, 0.0f, 1.0f / std::sqrt(float(g_width))}));
              weights.push_back(g.weight(norm_weight("o_norm", d)));
              attrs.set("eps", 1e-5);
            }
            const int state = g.graph.add_state({StateKind::kKdaRecurrent, width, heads, "state"});
            g.op(Op::kKdaFusedCore, inputs, weights, attrs, state);
          },
          // fp32: the delta rule's bound (the GPU's token-by-token form against the CPU's chunked one, 128)
          // with the convs' sums (FMAs on the GPU) and the gate's f_b dots (another order) in front of it:
          // ≤ 38 units on the host emulator where kda_delta_rule alone shows ≤ 5, so 256. bf16: one rounding
          // of that, as the delta rule's (emulator ≤ 0.84); with the norm, one more rounding after a
          // flipped one of the core's outputs (emulator ≤ 1.19), so 3.
          {256, g_width > 0 ? 3.0 : 2.0, 1.0, 0.01}};
}

// Prefill-sized sequences (the GPU's chunked form, C = 64) beside short and decode ones in the same
// steps: 65 = a chunk and one, 130 = two and two, 300 = four and 44, 16 and 15 either side of the
// chunked threshold (kKdaChunkedMinTokens), 3 and 1 token by token; decode steps read the chunked states.
OpCase kda_prefill(int64_t heads, int64_t d, bool bounded, float gate_std = 1.0f) {
  OpCase c = kda_delta_rule(heads, d, bounded, gate_std);
  c.name = "kda_prefill" + c.name.substr(std::string("kda_delta_rule").size());
  c.steps = {{{0, 65}}, {{0, 3}, {1, 130}, {2, 17}}, {{0, 1}, {1, 1}, {2, 1}}, {{2, 300}, {1, 16}}, {{0, 1}, {1, 15}, {2, 1}}, {{0, 1}, {1, 1}, {2, 1}}};
  return c;
}

OpCase mla(int64_t heads, int64_t nope, int64_t rope, int64_t dv, int64_t rank) {
  return {"mla_h" + std::to_string(heads) + "_n" + std::to_string(nope) + "_r" + std::to_string(rope) + "_v" + std::to_string(dv) +
              "_rank" + std::to_string(rank),
          Op::kMlaAttention,
          [=](CaseGraph& g) {
            const int q = g.embed(heads * (nope + rope)), kv_a = g.embed(rank + rope);
            const int cache = g.graph.add_state({StateKind::kMlaLatent, rank + rope, 0, "latent"});
            g.op(Op::kMlaAttention, {q, kv_a},
                 {g.weight(norm_weight("kv_a_norm", rank)), g.weight({"kv_b", {heads * (nope + dv), rank}, 0.0f, 1.0f / std::sqrt(float(rank))})},
                 {{"heads", double(heads)}, {"nope", double(nope)}, {"rope", double(rope)}, {"v", double(dv)}, {"rank", double(rank)}, {"eps", 1e-6}},
                 cache);
          },
          // fp32: absorbed vs expanded form, reassociation only. bf16: the CPU also rounds the expanded k
          // and v to bf16 (a relative 2⁻⁹ each), which moves scores and outputs by a fraction of a
          // percent of the scale: bound 4 ulps of the scale (3%). Host emulation: ≤ 6.5 (f32), ≤ 1 (bf16).
          {64, 4, 1.0, 1.0}};
}

struct RouterShape {
  int64_t experts, top_k, groups = 1, keep_groups = 1;
  bool softmax = false, renormalize = true;
  double scale = 2.446;
  int64_t tie_a = -1, tie_b = -1;  // experts given identical logits and a high bias: a tie in the top
};

// Logits straight from an embedding table [V, E] (exact on both backends; in bf16 runs they are
// bf16 values, which makes equal logits common), then moe_topk with an fp32 bias.
OpCase moe_topk(const RouterShape& s, std::string tag) {
  return {"moe_topk_" + std::move(tag), Op::kMoeTopK,
          [=](CaseGraph& g) {
            WeightSpec table{"logits_table", {kVocab, s.experts}, 0.0f, 2.0f};
            WeightSpec bias{"bias", {s.experts}, 0.0f, 0.1f, true};
            if (s.tie_a >= 0) {
              table.edit = [=](std::vector<float>& v) {
                for (int64_t row = 0; row < kVocab; ++row) v[size_t(row * s.experts + s.tie_b)] = v[size_t(row * s.experts + s.tie_a)];
              };
              bias.edit = [=](std::vector<float>& v) { v[size_t(s.tie_a)] = v[size_t(s.tie_b)] = 2.0f; };
            }
            const int logits = g.graph.add(Op::kEmbedding, {g.tokens}, {g.weight(table)}, {}, "logits");
            g.op(Op::kMoeTopK, {logits}, {g.weight(bias)},
                 {{"experts", double(s.experts)}, {"top_k", double(s.top_k)}, {"groups", double(s.groups)},
                  {"topk_groups", double(s.keep_groups)}, {"renormalize", s.renormalize ? 1.0 : 0.0}, {"scale", s.scale},
                  {"softmax", s.softmax ? 1.0 : 0.0}});
          },
          // Weights, element-relative: CUDA's expf and, for softmax, the sum over E in another order
          // (host emulation of the body: ≤ 2). Ids bit-identical.
          {16, 16}, true, s.top_k};
}

OpCase attn_res(int values, int64_t width, bool fused_norm) {
  return {std::string(fused_norm ? "attn_res_norm" : "attn_res_mix") + "_j" + std::to_string(values) + "_w" + std::to_string(width),
          fused_norm ? Op::kAttnResNorm : Op::kAttnResMix,
          [=](CaseGraph& g) {
            std::vector<int> inputs;
            for (int j = 0; j < values; ++j) inputs.push_back(g.embed(width, 1.0f + 0.5f * float(j)));
            std::vector<int> weights = {g.weight(norm_weight("res_norm", width)), g.weight({"res_proj", {1, width}, 0.0f, 2.0f / std::sqrt(float(width))})};
            if (!fused_norm) {
              g.op(Op::kAttnResMix, inputs, weights, {{"eps", 1e-5}});
              return;
            }
            weights.push_back(g.weight(norm_weight("norm", width)));
            g.op(Op::kAttnResNorm, inputs, weights, {{"eps", 1e-5}, {"norm_eps", 1e-6}});
          },
          // fp32 against the scale (the mix cancels), 64 units to 256 columns, then × √(width/256): the
          // scores sum the width in another order (numpy, two orders at 7,168 × 9: up to 67 units).
          // bf16: the fused norm rounds three times (mix, x·rsqrt, w·x), the mix once.
          {64.0 * std::max(1.0, std::sqrt(double(width) / 256.0)), fused_norm ? 3.0 : 2.0, 1.0, 0.01}};
}

// The same case with every embedded input read through a view (CaseGraph::views).
OpCase viewed(OpCase c) {
  c.name += "_view";
  c.build = [build = c.build](CaseGraph& g) {
    g.views = true;
    build(g);
  };
  return c;
}

// The same case over many rows on 132 workers (the H200's plans): a 600-row step (moe_topk: 38 tasks
// of ~16 rows; row-reduction norms: each of the 132 tasks owns whole rows, common.cuh row_share;
// elementwise ops and the embedding: each task a contiguous range of whole rows, element_share, four
// columns at a time where the width is a multiple of 4 (for_each_share_element4: the 96-wide cases);
// gated_rms_norm: 75 tasks, most past its heads, of 8 rows each; short_conv_silu: its row form, the
// 200-row step's first share boundary moved to keep the window's readers in one task),
// a 200-row step (rms_norm, add_norm and the elementwise ops of ≥ 100 columns column-sliced: fewer than
// 2 rows a task; gated_rms_norm still by rows) and a mixed step of 7 rows.
OpCase many_rows(OpCase c) {
  c.name += "_rows600";
  c.steps = {{{0, 600}}, {{1, 200}}, {{0, 1}, {1, 1}, {2, 5}}};
  c.workers = 132;
  return c;
}

// Long sequences on few workers, for short_conv_silu's row form (kda.cuh): a 600-token sequence over
// several tasks' row shares, a 200-token and a 20-token one in one step (the 20-token one shorter
// than a wide kernel's window: the new window keeps old entries), decode steps that read the windows
// they left, and a 40-token chunk beside two decoding sequences (serve's mixed step: rows and columns).
OpCase long_rows(OpCase c) {
  c.name += "_long";
  c.steps = {{{0, 600}}, {{1, 200}, {2, 20}}, {{0, 1}, {1, 1}, {2, 5}}, {{0, 1}, {1, 40}, {2, 2}}, {{0, 1}, {1, 1}, {2, 1}}};
  return c;
}

OpCase embedding(int64_t width) {
  return {"embedding_" + std::to_string(width), Op::kEmbedding, [=](CaseGraph& g) {
            g.op(Op::kEmbedding, {g.tokens}, {g.weight({"table", {kVocab, width}, 0.0f, 1.0f})}, {});
          }, {0, 0}};
}

std::vector<OpCase> cases() {
  // One rounding after CUDA's expf/tanhf (a few fp32 ulps): at most one bf16 ulp. SiLU·mul rounds twice
  // (SiLU, then the product): a flip in the first can reach two ulps of the product.
  const Bound exact{0, 0}, transcendental{16, 1}, two_roundings{16, 2};
  std::vector<OpCase> all;
  for (int64_t width : {96, 130, 257}) {
    const std::string w = std::to_string(width);
    all.push_back(elementwise("add_" + w, Op::kAdd, width, 2, {}, exact));
    all.push_back(elementwise("silu_mul_" + w, Op::kSiluMul, width, 2, {}, two_roundings));
    all.push_back(elementwise("sigmoid_mul_" + w, Op::kSigmoidMul, width, 2, {}, transcendental));
    all.push_back(elementwise("sigmoid_" + w, Op::kSigmoid, width, 1, {}, transcendental, true));
    all.push_back(rms_norm(width));
    all.push_back(add_norm(width));
  }
  all.push_back(elementwise("situ_mul_130", Op::kSituMul, 130, 2, {{"beta", 4.0}, {"linear_beta", 25.0}}, transcendental));
  all.push_back(elementwise("situ_mul_nolin_96", Op::kSituMul, 96, 2, {{"beta", 4.0}, {"linear_beta", 0.0}}, transcendental));
  for (auto [heads, d] : {std::pair{1, 16}, {3, 32}, {2, 64}, {4, 128}}) all.push_back(gated_rms_norm(heads, d));
  all.push_back(short_conv(96, 4));
  all.push_back(short_conv(130, 4));
  all.push_back(short_conv(257, 3));
  all.push_back(long_rows(short_conv(1030, 4)));
  all.push_back(long_rows(short_conv(1030, 33)));
  all.push_back(long_rows(short_conv(1032, 4)));  // a width of a multiple of 4: four columns a thread (short_conv_column4)
  all.push_back(embedding(257));
  all.push_back(kda_gate(2, 16, false, 1.0f));
  all.push_back(kda_gate(3, 32, true, 1.0f));
  all.push_back(kda_gate(2, 16, false, 12.0f));
  for (auto [heads, d] : {std::pair{1, 16}, {2, 32}, {3, 64}, {2, 128}, {4, 128}}) all.push_back(kda_delta_rule(heads, d, false));
  all.push_back(kda_delta_rule(2, 64, true));
  all.push_back(kda_delta_rule(1, 24, false));  // a head dim that is no power of two (padded to 32)
  all.push_back(kda_fused_core(2, 32, false, 32, 4));
  all.push_back(kda_fused_core(3, 64, true, 48, 4));
  all.push_back(kda_fused_core(1, 24, true, 21, 3));  // head dim padded to 32; f off the four-column loads
  all.push_back(kda_fused_core(2, 128, false, 128, 4));  // the 48B's head shape
  all.push_back(kda_fused_core(3, 64, true, 48, 4, 64));
  all.push_back(kda_fused_core(1, 24, false, 21, 3, 13));  // g off the four-column loads
  all.push_back(kda_fused_core(2, 128, false, 128, 4, 128));  // the 48B layer's fused op
  all.push_back(kda_fused_core(2, 22, true, 40, 4, 24));  // state rows of no whole 16-byte units: a decode pair's plain loads
  // A one-token pair's value columns over several tasks (fused_core_token_part; multi-token pairs beside
  // them take their part 0), with the output norm (the 48B layer's op) and without: 4 heads at 132
  // workers have 4 tasks a pair in the decode plan (64 tasks), so every step's pairs split in 4; at 24
  // workers (24 tasks) a step of one sequence in 4, of two or three in 2. Three heads of 64 at 24
  // workers: one sequence in 4, three in 2.
  for (int64_t g_width : {128, 0}) {
    for (int workers : {132, 24}) {
      OpCase c = kda_fused_core(4, 128, true, 128, 4, g_width);
      c.name += "_split";
      c.workers = workers;
      all.push_back(std::move(c));
    }
  }
  {
    OpCase c = kda_fused_core(3, 64, false, 64, 4, 64);
    c.name += "_split";
    c.workers = 24;
    all.push_back(std::move(c));
  }
  for (auto [heads, d, bounded] : {std::tuple{2, 32, false}, {1, 32, true}, {3, 64, false}, {2, 64, true}, {1, 128, false}, {2, 128, true}, {1, 24, true}}) {
    all.push_back(kda_prefill(heads, d, bounded));
  }
  all.push_back(kda_prefill(2, 64, false, 12.0f));  // strong decays: γ in the thousands within a chunk
  {  // the 48B layer's slicing: one task per 32 value columns (16 tasks of 132 workers), prefill and decode
    OpCase c = kda_prefill(4, 128, true);
    c.workers = 132;
    all.push_back(std::move(c));
  }
  all.push_back(mla(1, 16, 8, 16, 16));
  all.push_back(mla(2, 16, 8, 16, 32));
  all.push_back(mla(3, 32, 8, 24, 64));
  all.push_back(mla(4, 24, 16, 32, 100));
  all.push_back(mla(2, 128, 64, 128, 512));  // the real head shape: latent 576 fills every register slot
  all.push_back(moe_topk({8, 2}, "e8_k2"));
  all.push_back(moe_topk({61, 5}, "e61_k5"));  // odd E: lanes with no candidate in the last round
  all.push_back(moe_topk({64, 6, 8, 3}, "e64_k6_g8"));
  all.push_back(moe_topk({63, 4, 9, 4, true}, "e63_k4_g9_softmax"));
  all.push_back(moe_topk({96, 4, 1, 1, true, false, 1.0}, "e96_k4_softmax"));
  all.push_back(moe_topk({256, 8}, "e256_k8"));  // the Kimi-Linear-48B shape
  all.push_back(moe_topk({896, 16}, "e896_k16"));  // K3
  all.push_back(moe_topk({8, 1, 1, 1, false, true, 2.446, 2, 5}, "tie_k1"));
  all.push_back(moe_topk({8, 3, 1, 1, false, true, 2.446, 2, 5}, "tie_k3"));
  all.push_back(moe_topk({32, 4, 4, 2, false, true, 1.0, 9, 20}, "tie_groups"));
  for (int values : {1, 3, 5}) {
    all.push_back(attn_res(values, values == 3 ? 257 : 96, false));
    all.push_back(attn_res(values, 130, true));
  }
  for (bool fused_norm : {true, false}) {  // K3's width and depth on 132 workers: decode items of 56 columns
    all.push_back(attn_res(9, 7168, fused_norm));
    all.back().workers = 132;
  }
  for (OpCase c : {moe_topk({256, 8}, "e256_k8"), moe_topk({64, 6, 8, 3}, "e64_k6_g8"), moe_topk({896, 16}, "e896_k16"), rms_norm(1030),
                   add_norm(1030), gated_rms_norm(4, 128), gated_rms_norm(3, 48), gated_rms_norm(2, 160), elementwise("add_257", Op::kAdd, 257, 2, {}, exact),
                   elementwise("silu_mul_130", Op::kSiluMul, 130, 2, {}, two_roundings), elementwise("sigmoid_96", Op::kSigmoid, 96, 1, {}, transcendental, true),
                   elementwise("add_96", Op::kAdd, 96, 2, {}, exact), elementwise("silu_mul_96", Op::kSiluMul, 96, 2, {}, two_roundings),
                   elementwise("sigmoid_mul_257", Op::kSigmoidMul, 257, 2, {}, transcendental),
                   elementwise("situ_mul_130", Op::kSituMul, 130, 2, {{"beta", 4.0}, {"linear_beta", 25.0}}, transcendental), short_conv(257, 4),
                   kda_gate(3, 32, true, 1.0f), kda_gate(2, 64, false, 12.0f), embedding(1030), attn_res(3, 1030, true),
                   attn_res(5, 257, false)}) {
    all.push_back(many_rows(std::move(c)));
  }
  // Inputs through views (plan slices read in place): one case per body that reads activations.
  for (OpCase c : {elementwise("add_130", Op::kAdd, 130, 2, {}, exact), elementwise("silu_mul_257", Op::kSiluMul, 257, 2, {}, two_roundings),
                   elementwise("sigmoid_96", Op::kSigmoid, 96, 1, {}, transcendental, true), rms_norm(257), add_norm(96), gated_rms_norm(3, 32),
                   short_conv(130, 4), kda_gate(3, 32, true, 1.0f), kda_delta_rule(2, 64, false), kda_fused_core(2, 64, false, 64, 4, 64),
                   mla(2, 16, 8, 16, 32), attn_res(3, 257, false),
                   attn_res(3, 130, true)}) {
    all.push_back(viewed(std::move(c)));
  }
  return all;
}

// ---- running a case --------------------------------------------------------------------------------

// Steps over three slots: prefill, mixed, decode (batch 3), a 70-token continuation (two CPU chunks),
// a short prefill beside decodes, decode.
std::vector<std::vector<SequenceStep>> script() {
  return {{{0, 33}}, {{0, 1}, {1, 3}}, {{0, 1}, {1, 1}, {2, 1}}, {{1, 70}}, {{0, 1}, {1, 1}, {2, 5}}, {{0, 1}, {1, 1}, {2, 1}}, {{2, 1}}};
}

// The steps a case runs, the prefill bucket that holds its largest step and the context its slots reach.
std::vector<std::vector<SequenceStep>> steps_of(const OpCase& c) { return c.steps.empty() ? script() : c.steps; }
int64_t prefill_bucket(const OpCase& c) {
  int64_t most = kPrefillTokens;
  for (const auto& step : steps_of(c)) {
    int64_t rows = 0;
    for (const SequenceStep& seq : step) rows += seq.query_tokens;
    most = std::max(most, rows);
  }
  return most;
}
int64_t max_context(const OpCase& c) {
  std::vector<int64_t> context(kSlots, 0);
  for (const auto& step : steps_of(c)) {
    for (const SequenceStep& seq : step) context[size_t(seq.slot)] += seq.query_tokens;
  }
  return std::max(kMaxContext, *std::max_element(context.begin(), context.end()));
}

StepInputs make_step(const std::vector<SequenceStep>& sequences, std::mt19937& rng) {
  StepInputs inputs;
  inputs.sequences = sequences;
  inputs.all_logits = true;
  std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
  for (const SequenceStep& seq : sequences) {
    for (int64_t t = 0; t < seq.query_tokens; ++t) inputs.token_ids.push_back(token(rng));
  }
  return inputs;
}


struct Prepared {
  CaseGraph g;
  Checkpoint checkpoint = Checkpoint::in_memory("unused");
  std::unique_ptr<BoundWeights> bound;
  std::vector<Plan> plans;
};

std::unique_ptr<Prepared> prepare(const OpCase& c, DType act, int workers) {
  auto p = std::make_unique<Prepared>();
  c.build(p->g);
  p->g.graph.verify();
  p->checkpoint = p->g.checkpoint(act == DType::F32 ? DType::F32 : DType::BF16, 1234);
  p->bound = std::make_unique<BoundWeights>(p->g.graph, p->checkpoint);
  for (auto [phase, tokens] : {std::pair{PlanPhase::kDecode, kDecodeTokens}, {PlanPhase::kPrefill, prefill_bucket(c)}}) {
    LowerOptions options;
    options.phase = phase;
    options.max_tokens = tokens;
    options.workers = workers;
    // Cases on 7 workers keep one slice a worker for light ops too (their column slices over many
    // tasks); those on 3 get the plans' default (lower.h light_task_elements: one task at these widths).
    if (workers == 7) options.light_task_elements = 1;
    p->plans.push_back(lower_to_plan(p->g.graph, options));
  }
  return p;
}

// Compares one step; returns the error in the case's unit (infinity on NaN, a shape mismatch or a
// difference in a column from exact_from on).
double step_error(const StepOutput& gpu, const StepOutput& ref, double eps, double floor, int64_t exact_from, std::string& worst) {
  if (gpu.rows != ref.rows || gpu.vocab != ref.vocab || gpu.logits.size() != ref.logits.size()) {
    worst = "shape differs";
    return INFINITY;
  }
  const auto exact = [&](size_t i) { return exact_from >= 0 && int64_t(i % size_t(ref.vocab)) >= exact_from; };
  double scale = 0;
  for (size_t i = 0; i < ref.logits.size(); ++i) {
    if (!exact(i)) scale = std::max(scale, double(std::fabs(ref.logits[i])));
  }
  if (!(scale > 0)) {
    worst = "reference output is all zero: the case cannot fail";
    return INFINITY;
  }
  double error = 0;
  for (size_t i = 0; i < ref.logits.size(); ++i) {
    const double a = gpu.logits[i], b = ref.logits[i];
    double e = 0;
    if (exact(i)) e = a == b ? 0 : INFINITY;  // NaN included
    else e = std::isnan(a) || std::isnan(b) ? INFINITY : std::fabs(a - b) / (eps * std::max(std::fabs(b), floor * scale));
    if (e > error || std::isnan(a)) {
      error = e;
      worst = "row " + std::to_string(i / size_t(ref.vocab)) + " col " + std::to_string(i % size_t(ref.vocab)) + ": gpu " + std::to_string(a) +
              " ref " + std::to_string(b);
    }
  }
  return error;
}

struct Param {
  size_t index;
  DType act;
  int workers;
};

std::string param_name(const testing::TestParamInfo<Param>& info) {
  return cases()[info.param.index].name + (info.param.act == DType::F32 ? "_f32" : "_bf16") + "_w" + std::to_string(info.param.workers);
}

std::vector<Param> params() {
  std::vector<Param> all;
  const std::vector<OpCase> table = cases();
  const size_t n = table.size();
  for (size_t i = 0; i < n; ++i) {
    const int workers = table[i].workers > 0 ? table[i].workers : i % 2 == 0 ? 3 : 7;
    for (DType act : {DType::F32, DType::BF16}) all.push_back({i, act, workers});
  }
  return all;
}

class CudaOpTest : public testing::TestWithParam<Param> {};

TEST_P(CudaOpTest, MatchesReference) {
  const OpCase c = cases()[GetParam().index];
  const DType act = GetParam().act;
  ASSERT_TRUE(cuda::CudaBackend::has_op(static_cast<uint8_t>(c.op))) << "no device body for " << op_name(c.op);
  const auto p = prepare(c, act, GetParam().workers);
  const auto device_weights = cuda::upload_weights(p->g.graph, *p->bound);
  const bool f32_unit = c.f32_out || act == DType::F32;
  const double bound = f32_unit ? c.bound.f32 : c.bound.bf16;
  const double floor = f32_unit ? c.bound.floor_f32 : c.bound.floor_bf16;
  const double eps = f32_unit ? 0x1p-23 : 0x1p-7;
  // (eager, MLA GEMMs): MLA's steps of ≥ 32 rows run as MLA GEMMs (runtime/cuda/mla_gemm.h) by
  // default; MLA cases also run with them off, so the op body keeps its prefill steps.
  std::vector<std::pair<bool, bool>> runs = {{true, true}, {false, true}};
  if (c.op == Op::kMlaAttention) runs.insert(runs.end(), {{true, false}, {false, false}});
  for (const auto& [eager, mla_gemm] : runs) {
    SCOPED_TRACE(std::string(eager ? "eager" : "megakernel") + (mla_gemm ? "" : ", MLA on its op body"));
    cuda::CudaOptions options;
    options.act_dtype = act;
    options.num_slots = kSlots;
    options.max_context_tokens = max_context(c);
    options.eager = eager;
    options.poison_arena = true;  // a column no task writes reads back as NaN
    options.prefill_mla_gemm = mla_gemm;
    cuda::CudaBackend gpu(p->g.graph, device_weights, p->plans, options);
    ReferenceBackend ref(p->g.graph, *p->bound, act, kSlots);
    std::mt19937 rng(99);
    int index = 0;
    double worst_error = 0;
    for (const auto& sequences : steps_of(c)) {
      const StepInputs inputs = make_step(sequences, rng);
      const StepOutput expected = ref.step(inputs);
      const StepOutput got = gpu.step(inputs);
      std::string worst;
      const double error = step_error(got, expected, eps, floor, c.exact_from, worst);
      EXPECT_LE(error, bound) << c.name << " step " << index << " (" << inputs.token_ids.size() << " tokens): " << worst;
      worst_error = std::max(worst_error, error);
      ++index;
    }
    // The observed error next to its bound, for tuning bounds from real runs.
    std::printf("  %s %s%s: max error %.3g (bound %.3g)\n", c.name.c_str(), eager ? "eager" : "megakernel", mla_gemm ? "" : " (MLA op body)", worst_error, bound);
    for (int slot = 0; slot < kSlots; ++slot) EXPECT_EQ(gpu.context_tokens(slot), ref.context_tokens(slot));
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaOpTest, testing::ValuesIn(params()), param_name);

// ---- MLA at long context (split-KV) ----------------------------------------------------------------
// The latent caches are restored from random rows (both backends take the same snapshot), so a case
// reaches tens of thousands of positions without prefilling them; then decode and mixed steps. The
// device splits the positions over its tasks (many splits at 132 workers) and merges the partials: a
// split dropped, counted twice, masked wrongly or rescaled wrongly moves the output far past the bound.

struct MlaLongCase {
  int64_t heads, nope, rope, dv, rank;
  int64_t context;  // cached positions of slot 0; slots 1, 2 (batch 3) hold context − 37 and context / 3
  int batch;
  int workers;
};

std::string mla_long_name(const testing::TestParamInfo<std::pair<MlaLongCase, DType>>& info) {
  const MlaLongCase& c = info.param.first;
  return "h" + std::to_string(c.heads) + "_rank" + std::to_string(c.rank) + "_ctx" + std::to_string(c.context) + "_b" + std::to_string(c.batch) + "_w" +
         std::to_string(c.workers) + (info.param.second == DType::F32 ? "_f32" : "_bf16");
}

std::vector<std::pair<MlaLongCase, DType>> mla_long_params() {
  const std::vector<MlaLongCase> shapes = {
      {3, 32, 8, 24, 64, 1, 1, 7},        {3, 32, 8, 24, 64, 63, 3, 3},       {3, 32, 8, 24, 64, 700, 3, 132},
      {3, 32, 8, 24, 64, 4097, 1, 132},   {3, 32, 8, 24, 64, 20000, 1, 132},  {3, 32, 8, 24, 64, 20000, 3, 7},
      {3, 32, 7, 24, 64, 701, 3, 132},    // latent 71: rows·heads·latent floats of q_abs, not a multiple of 4, before the partials
      {5, 16, 8, 16, 32, 700, 3, 7},      {5, 16, 8, 16, 32, 4097, 3, 132},   // 5 heads: query groups of 16 straddle tokens
      {2, 128, 64, 128, 512, 700, 3, 3},  {2, 128, 64, 128, 512, 4097, 1, 132},  // the real head shape
      {2, 128, 64, 128, 512, 4097, 3, 132},
      // rank 128: the smallest the tensor-core B item takes (bf16); 5 heads straddle its query groups
      {5, 32, 16, 32, 128, 4097, 3, 132}, {5, 32, 16, 32, 128, 20000, 3, 7}, {5, 32, 16, 32, 128, 33, 3, 132},
  };
  std::vector<std::pair<MlaLongCase, DType>> all;
  for (const MlaLongCase& c : shapes) {
    for (DType act : {DType::F32, DType::BF16}) all.push_back({c, act});
  }
  return all;
}

// `tokens` latent rows of width rank + rope, as the cache holds them: the rank part rounded to the
// activation dtype (the CPU rounds the normed latent), the rope part too (an activation).
SlotSnapshot random_latents(int64_t tokens, int64_t latent, DType act, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  SlotSnapshot snap;
  snap.tokens = tokens;
  snap.row_floats = {latent};
  snap.fixed = {{}};
  snap.rows = {std::vector<float>(static_cast<size_t>(tokens * latent))};
  for (float& v : snap.rows[0]) v = round_to(act, normal(rng));
  return snap;
}

class CudaMlaLongTest : public testing::TestWithParam<std::pair<MlaLongCase, DType>> {};

TEST_P(CudaMlaLongTest, MatchesReference) {
  const MlaLongCase& lc = GetParam().first;
  const DType act = GetParam().second;
  if (cuda::CudaBackend::sm_count() < lc.workers) GTEST_SKIP() << lc.workers << " workers need as many SMs";
  const OpCase c = mla(lc.heads, lc.nope, lc.rope, lc.dv, lc.rank);
  const auto p = prepare(c, act, lc.workers);
  const auto device_weights = cuda::upload_weights(p->g.graph, *p->bound);
  const double bound = act == DType::F32 ? c.bound.f32 : c.bound.bf16;
  const double floor = act == DType::F32 ? c.bound.floor_f32 : c.bound.floor_bf16;
  const double eps = act == DType::F32 ? 0x1p-23 : 0x1p-7;
  const int64_t contexts[kSlots] = {lc.context, std::max<int64_t>(0, lc.context - 37), lc.context / 3};
  // Decode of every slot; slot 0 brings 5 tokens beside the others' decode (causal masks inside a split);
  // decode again.
  std::vector<std::vector<SequenceStep>> steps(3);
  for (int s = 0; s < lc.batch; ++s) {
    steps[0].push_back({s, 1});
    steps[1].push_back({s, s == 0 ? 5 : 1});
    steps[2].push_back({s, 1});
  }
  for (bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "megakernel");
    cuda::CudaOptions options;
    options.act_dtype = act;
    options.num_slots = kSlots;
    options.max_context_tokens = lc.context + 16;
    options.eager = eager;
    options.poison_arena = true;
    cuda::CudaBackend gpu(p->g.graph, device_weights, p->plans, options);
    ReferenceBackend ref(p->g.graph, *p->bound, act, kSlots);
    for (int s = 0; s < lc.batch; ++s) {
      const SlotSnapshot snap = random_latents(contexts[s], lc.rank + lc.rope, act, 4242 + static_cast<uint64_t>(s));
      gpu.restore_slot(s, snap);
      ref.restore_slot(s, snap);
    }
    std::mt19937 rng(17);
    double worst_error = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      const StepInputs inputs = make_step(steps[i], rng);
      const StepOutput expected = ref.step(inputs);
      const StepOutput got = gpu.step(inputs);
      std::string worst;
      const double error = step_error(got, expected, eps, floor, -1, worst);
      EXPECT_LE(error, bound) << "step " << i << " (" << inputs.token_ids.size() << " tokens): " << worst;
      worst_error = std::max(worst_error, error);
    }
    std::printf("  mla ctx %lld batch %d workers %d %s: max error %.3g (bound %.3g)\n", static_cast<long long>(lc.context), lc.batch, lc.workers,
                eager ? "eager" : "megakernel", worst_error, bound);
    for (int s = 0; s < lc.batch; ++s) {
      EXPECT_EQ(gpu.context_tokens(s), ref.context_tokens(s));
      // The cache holds the activation dtype (16 bits for bf16/f16): the restored rows read back bit for
      // bit, the rows the steps appended (the device's norm sums in another order) within a few ulps.
      const SlotSnapshot got = gpu.save_slot(s, 0), expected = ref.save_slot(s, 0);
      ASSERT_EQ(got.rows.size(), 1u);
      ASSERT_EQ(got.rows[0].size(), expected.rows[0].size());
      const size_t restored = static_cast<size_t>(contexts[s] * (lc.rank + lc.rope));
      int differing = 0;
      for (size_t k = 0; k < got.rows[0].size(); ++k) {
        const float a = got.rows[0][k], b = expected.rows[0][k];
        const bool ok = k < restored ? a == b : std::abs(a - b) <= 8 * eps * std::max(std::abs(b), 1.0f);
        if (!ok && differing++ < 3) ADD_FAILURE() << "slot " << s << " latent element " << k << ": " << a << ", reference " << b;
      }
      EXPECT_EQ(differing, 0) << "slot " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(MlaLong, CudaMlaLongTest, testing::ValuesIn(mla_long_params()), mla_long_name);

// The device reports an out-of-vocabulary token as plow::Error from step(), in both modes.
TEST(CudaOpErrors, OutOfVocabularyToken) {
  const OpCase c = elementwise("add", Op::kAdd, 96, 2, {}, {});
  const auto p = prepare(c, DType::F32, 3);
  const auto device_weights = cuda::upload_weights(p->g.graph, *p->bound);
  for (bool eager : {true, false}) {
    cuda::CudaOptions options;
    options.num_slots = kSlots;
    options.max_context_tokens = kMaxContext;
    options.eager = eager;
    cuda::CudaBackend gpu(p->g.graph, device_weights, p->plans, options);
    StepInputs inputs;
    inputs.token_ids = {3, static_cast<int32_t>(kVocab), 5};
    inputs.sequences = {{0, 3}};
    inputs.all_logits = true;
    EXPECT_THROW(gpu.step(inputs), Error) << (eager ? "eager" : "megakernel");
  }
}

// A sequence that grows past the slot's cache is refused (host check or the device's kErrContext).
TEST(CudaOpErrors, ContextPastTheCache) {
  const OpCase c = mla(1, 16, 8, 16, 16);
  const auto p = prepare(c, DType::F32, 3);
  const auto device_weights = cuda::upload_weights(p->g.graph, *p->bound);
  cuda::CudaOptions options;
  options.num_slots = kSlots;
  options.max_context_tokens = 40;
  cuda::CudaBackend gpu(p->g.graph, device_weights, p->plans, options);
  std::mt19937 rng(7);
  EXPECT_NO_THROW(gpu.step(make_step({{0, 33}}, rng)));
  EXPECT_THROW(gpu.step(make_step({{0, 10}}, rng)), Error);
}

}  // namespace
}  // namespace plow
