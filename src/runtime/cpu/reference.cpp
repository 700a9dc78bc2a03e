#include "runtime/cpu/reference.h"

#include "core/error.h"

namespace plow {

namespace {

size_t initial_state_size(const StateDecl& decl) {
  switch (decl.kind) {
    case StateKind::kConvWindow: return static_cast<size_t>(decl.width * decl.depth);
    case StateKind::kKdaRecurrent: return static_cast<size_t>(decl.width * (decl.width / decl.depth));  // heads·d·d
    case StateKind::kMlaLatent: return 0;
  }
  return 0;
}

}  // namespace

ReferenceBackend::ReferenceBackend(const Graph& graph, const BoundWeights& weights, DType act_dtype, int num_slots, Collective* collective)
    : graph_(graph), weights_(weights), act_dtype_(act_dtype), collective_(collective), slots_(static_cast<size_t>(num_slots)) {
  if (act_dtype != DType::F32 && act_dtype != DType::BF16 && act_dtype != DType::F16) {
    fail("cpu reference: activation dtype {} is not supported (expected F32, BF16 or F16)", dtype_name(act_dtype));
  }
  for (const Node& node : graph.nodes()) {
    CpuOpFn fn = cpu_kernel(node.op);
    if (!fn && node.op != Op::kTokens) fail("cpu reference backend has no kernel for op '{}' (node {})", op_name(node.op), node.label);
    kernels_[static_cast<size_t>(node.op)] = fn;
  }
  for (int slot = 0; slot < num_slots; ++slot) reset_slot(slot);
}

void ReferenceBackend::reset_slot(int slot) {
  SlotState& state = slots_.at(static_cast<size_t>(slot));
  state.context_tokens = 0;
  state.buffers.resize(graph_.states().size());
  for (size_t i = 0; i < graph_.states().size(); ++i) state.buffers[i].assign(initial_state_size(graph_.states()[i]), 0.0f);
}

int64_t ReferenceBackend::context_tokens(int slot) const { return slots_.at(static_cast<size_t>(slot)).context_tokens; }

SlotSnapshot ReferenceBackend::save_slot(int slot, int64_t rows_begin) const {
  return save_slot_state(slots_.at(static_cast<size_t>(slot)), graph_.states(), rows_begin);
}

void ReferenceBackend::restore_slot(int slot, const SlotSnapshot& snapshot) {
  restore_slot_state(slots_.at(static_cast<size_t>(slot)), graph_.states(), snapshot, 0);
}

StepOutput ReferenceBackend::step(const StepInputs& inputs) {
  const auto rows = static_cast<int64_t>(inputs.token_ids.size());
  int64_t total = 0;
  for (const SequenceStep& seq : inputs.sequences) {
    PLOW_CHECK(seq.slot >= 0 && seq.slot < num_slots(), "slot {} out of range", seq.slot);
    PLOW_CHECK(seq.query_tokens > 0, "sequence in slot {} has no tokens", seq.slot);
    total += seq.query_tokens;
  }
  PLOW_CHECK(total == rows, "sequences cover {} tokens, step has {}", total, rows);

  const std::vector<Node>& nodes = graph_.nodes();
  std::vector<std::vector<float>> values(nodes.size());
  for (size_t id = 0; id < nodes.size(); ++id) {
    const Node& node = nodes[id];
    std::vector<float>& out = values[id];
    out.assign(static_cast<size_t>(rows * node.width), 0.0f);
    if (node.op == Op::kTokens) {
      for (int64_t t = 0; t < rows; ++t) out[static_cast<size_t>(t)] = static_cast<float>(inputs.token_ids[static_cast<size_t>(t)]);
      continue;
    }
    std::vector<Activation> args;
    for (int input : node.inputs) args.push_back({values[static_cast<size_t>(input)].data(), nodes[static_cast<size_t>(input)].width});
    std::vector<const BoundWeight*> bound;
    for (int w : node.weights) bound.push_back(&weights_[w]);
    OpContext ctx{node, args, bound, out.data(), rows, act_dtype_, inputs, slots_, 0, -1, collective_};
    kernels_[static_cast<size_t>(node.op)](ctx);
  }
  for (const SequenceStep& seq : inputs.sequences) slots_[static_cast<size_t>(seq.slot)].context_tokens += seq.query_tokens;

  const Node& head = nodes[static_cast<size_t>(graph_.output())];
  const std::vector<float>& logits = values[static_cast<size_t>(graph_.output())];
  StepOutput result;
  result.vocab = head.width;
  if (inputs.all_logits) {
    result.rows = rows;
    result.logits = logits;
    return result;
  }
  int64_t end = 0;
  for (const SequenceStep& seq : inputs.sequences) {
    end += seq.query_tokens;
    const float* row = logits.data() + (end - 1) * head.width;
    result.logits.insert(result.logits.end(), row, row + head.width);
    result.rows += 1;
  }
  return result;
}

std::vector<SlotState> fresh_slot_states(const Graph& graph, int num_slots) {
  std::vector<SlotState> slots(static_cast<size_t>(num_slots));
  for (SlotState& slot : slots) {
    for (const StateDecl& decl : graph.states()) slot.buffers.emplace_back(initial_state_size(decl), 0.0f);
  }
  return slots;
}

std::vector<float> evaluate_graph(const Graph& graph, const BoundWeights& weights, DType act_dtype, const StepInputs& step,
                                  std::span<SlotState> slots, const std::map<std::string, std::vector<float>>& inputs) {
  int64_t rows = 0;
  for (const SequenceStep& seq : step.sequences) {
    PLOW_CHECK(seq.query_tokens > 0 && (slots.empty() || (seq.slot >= 0 && static_cast<size_t>(seq.slot) < slots.size())),
               "evaluate_graph: sequence in slot {}", seq.slot);
    rows += seq.query_tokens;
  }
  const std::vector<Node>& nodes = graph.nodes();
  std::vector<std::vector<float>> values(nodes.size());
  for (size_t id = 0; id < nodes.size(); ++id) {
    const Node& node = nodes[id];
    PLOW_CHECK(node.op != Op::kTokens, "evaluate_graph: {} needs token ids", node.label);
    PLOW_CHECK(!op_info(node.op).stateful || !slots.empty(), "evaluate_graph: {} needs sequence state", node.label);
    if (node.op == Op::kInput) {
      auto it = inputs.find(node.label);
      PLOW_CHECK(it != inputs.end() && it->second.size() == static_cast<size_t>(rows * node.width),
                 "evaluate_graph: input '{}' missing or mis-sized", node.label);
      values[id] = it->second;
      continue;
    }
    values[id].assign(static_cast<size_t>(rows * node.width), 0.0f);
    std::vector<Activation> args;
    for (int input : node.inputs) args.push_back({values[static_cast<size_t>(input)].data(), nodes[static_cast<size_t>(input)].width});
    std::vector<const BoundWeight*> bound;
    for (int w : node.weights) bound.push_back(&weights[w]);
    const CpuOpFn kernel = cpu_kernel(node.op);
    PLOW_CHECK(kernel != nullptr, "no CPU kernel for {}", op_name(node.op));
    OpContext ctx{node, args, bound, values[id].data(), rows, act_dtype, step, slots};
    kernel(ctx);
  }
  for (const SequenceStep& seq : step.sequences) {
    if (!slots.empty()) slots[static_cast<size_t>(seq.slot)].context_tokens += seq.query_tokens;
  }
  return values[static_cast<size_t>(graph.output())];
}

std::vector<float> evaluate_graph(const Graph& graph, const BoundWeights& weights, DType act_dtype, int64_t rows,
                                  const std::map<std::string, std::vector<float>>& inputs) {
  StepInputs step;
  step.token_ids.assign(static_cast<size_t>(rows), 0);
  step.sequences = {{0, rows}};
  return evaluate_graph(graph, weights, act_dtype, step, {}, inputs);
}

}  // namespace plow
