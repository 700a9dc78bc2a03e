#include "certify.h"

#include <cmath>
#include <limits>
#include <random>

#include "compiler/compile.h"
#include "graph/random_weights.h"
#include "graph/weights.h"
#include "runtime/cpu/reference.h"

namespace plow {

namespace {

std::map<std::string, std::vector<float>> random_inputs(const Graph& graph, int64_t rows, uint64_t seed, DType act) {
  std::mt19937 rng(static_cast<uint32_t>(seed * 7919));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::map<std::string, std::vector<float>> inputs;
  for (const Node& node : graph.nodes()) {
    if (node.op != Op::kInput) continue;
    std::vector<float> values(static_cast<size_t>(rows * node.width));
    for (float& v : values) v = round_to(act, normal(rng));
    inputs[node.label] = std::move(values);
  }
  return inputs;
}

}  // namespace

Certificate certify(const Rule& rule) {
  Certificate certificate;
  certificate.rule = rule.name;
  certificate.definition_hash = definition_hash(rule);
  certificate.bound = 0.0;  // fused ops compute the exact composition, roundings included
  constexpr int64_t kRows = 3;
  for (int64_t size : {5, 7, 13, 16}) {
    for (uint64_t seed : {1u, 2u, 3u}) {
      for (DType act : {DType::F32, DType::BF16}) {
        const Graph lhs = rule.instance(size);
        CompileReport report;
        const Graph rhs = fuse_uncertified(lhs, {&rule}, CompileOptions{}, report);
        certificate.cases += 1;
        bool rewritten = report.saturation.applied.count(rule.name) && rhs.nodes().size() != lhs.nodes().size();
        for (size_t i = 0; !rewritten && i < rhs.nodes().size(); ++i) rewritten = rhs.nodes()[i].op != lhs.nodes()[i].op;
        if (!rewritten) {
          certificate.max_error = std::numeric_limits<double>::infinity();
          continue;
        }
        const Checkpoint weights = random_checkpoint(lhs, seed, act, "certificate of " + rule.name);
        const BoundWeights lhs_weights(lhs, weights), rhs_weights(rhs, weights);
        std::vector<float> a, b;
        if (lhs.states().empty()) {
          const auto inputs = random_inputs(lhs, kRows, seed, act);
          a = evaluate_graph(lhs, lhs_weights, act, kRows, inputs);
          b = evaluate_graph(rhs, rhs_weights, act, kRows, inputs);
        } else {
          // Stateful ops: a prefill of kRows tokens in slot 0, then a decode step of three slots (slot 0
          // reading the states the first step left); both steps' outputs and every state at the end compared.
          std::vector<SlotState> lhs_slots = fresh_slot_states(lhs, int{kRows}), rhs_slots = fresh_slot_states(rhs, int{kRows});
          StepInputs prefill, decode;
          prefill.sequences = {{0, kRows}};
          decode.sequences = {{0, 1}, {1, 1}, {2, 1}};
          for (const StepInputs* step : {&prefill, &decode}) {
            const auto inputs = random_inputs(lhs, kRows, seed + (step == &decode ? 100 : 0), act);
            const auto x = evaluate_graph(lhs, lhs_weights, act, *step, lhs_slots, inputs);
            const auto y = evaluate_graph(rhs, rhs_weights, act, *step, rhs_slots, inputs);
            a.insert(a.end(), x.begin(), x.end());
            b.insert(b.end(), y.begin(), y.end());
          }
          for (size_t slot = 0; slot < lhs_slots.size(); ++slot) {
            for (size_t i = 0; i < lhs_slots[slot].buffers.size(); ++i) {
              a.insert(a.end(), lhs_slots[slot].buffers[i].begin(), lhs_slots[slot].buffers[i].end());
              b.insert(b.end(), rhs_slots[slot].buffers[i].begin(), rhs_slots[slot].buffers[i].end());
            }
          }
        }
        if (a.size() != b.size()) {
          certificate.max_error = std::numeric_limits<double>::infinity();
          continue;
        }
        for (size_t i = 0; i < a.size(); ++i) {
          const double error = std::isnan(a[i]) || std::isnan(b[i]) ? std::numeric_limits<double>::infinity() : std::fabs(a[i] - b[i]);
          certificate.max_error = std::max(certificate.max_error, error);
        }
      }
    }
  }
  return certificate;
}

}  // namespace plow
