#include "graph/random_weights.h"

#include <cmath>
#include <cstring>
#include <set>

#include "core/error.h"

namespace plow {

namespace {

// Counter-based generator: the value of element i of tensor t depends on (seed, t, i) only.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [0, 1).
float unit(uint64_t seed, uint64_t tensor, uint64_t i) {
  return static_cast<float>(mix64(seed ^ mix64(tensor * 0x100000001B3ull + i)) >> 40) * 0x1.0p-24f;
}

// Zero-mean with standard deviation `std` (uniform: cheap and bounded, which is all benchmarks need).
float centered(uint64_t seed, uint64_t tensor, uint64_t i, float std) { return (2.0f * unit(seed, tensor, i) - 1.0f) * 1.7320508f * std; }

void store(DType dtype, std::vector<uint8_t>& bytes, size_t i, float value) {
  switch (dtype) {
    case DType::F32: std::memcpy(bytes.data() + 4 * i, &value, 4); break;
    case DType::BF16: { const uint16_t b = f32_to_bf16(value); std::memcpy(bytes.data() + 2 * i, &b, 2); break; }
    case DType::F16: { const uint16_t b = f32_to_f16(value); std::memcpy(bytes.data() + 2 * i, &b, 2); break; }
    default: PLOW_CHECK(false, "random weights in {}", dtype_name(dtype));
  }
}

int64_t count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void add_mxfp4(Checkpoint& checkpoint, const std::string& name, const std::vector<int64_t>& shape, uint64_t seed, uint64_t tensor) {
  const int64_t out = shape[0], in = shape[1];
  std::vector<uint8_t> packed(static_cast<size_t>(out * in / 2)), scales(static_cast<size_t>(out * in / 32));
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<uint8_t>(mix64(seed ^ mix64(tensor * 7919 + i)));
  // E2M1 codes have RMS ≈ 3; pick the scale so that the weights have RMS ≈ 0.5/√in, ±1 binade.
  const int base = 127 + static_cast<int>(std::lround(std::log2(0.5 / std::sqrt(static_cast<double>(in)) / 3.0)));
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<uint8_t>(base - 1 + static_cast<int>(unit(seed, tensor + 1, i) * 3.0f));
  checkpoint.add_tensor(name + "_packed", DType::U8, {out, in / 2}, std::move(packed));
  checkpoint.add_tensor(name + "_scale", DType::U8, {out, in / 32}, std::move(scales));
}

}  // namespace

Checkpoint random_checkpoint(const Graph& graph, uint64_t seed, DType dtype, const std::string& label) {
  Checkpoint checkpoint = Checkpoint::in_memory(label);
  std::set<std::string> made;
  uint64_t tensor = 0;
  for (const WeightDecl& decl : graph.weights()) {
    for (const std::string& name : decl.parts) {
      ++tensor;
      if (!made.insert(name).second) continue;  // tied embeddings are declared twice
      if (decl.mxfp4) {
        add_mxfp4(checkpoint, name, decl.shape, seed, tensor * 2);
        continue;
      }
      const auto n = static_cast<size_t>(count(decl.shape));
      const float fan_in = static_cast<float>(decl.shape.back());
      DType stored = dtype;
      std::vector<float> values(n);
      for (size_t i = 0; i < n; ++i) {
        if (name.ends_with("A_log")) {
          values[i] = std::log(1.0f + 15.0f * unit(seed, tensor, i));  // ln U(1, 16)
        } else if (name.ends_with("dt_bias")) {
          values[i] = centered(seed, tensor, i, 0.5f);
        } else if (name.ends_with("e_score_correction_bias")) {
          values[i] = centered(seed, tensor, i, 0.1f);
        } else if (name.ends_with("norm.weight")) {
          values[i] = 1.0f + centered(seed, tensor, i, 0.1f);
        } else if (name.ends_with("embed_tokens.weight")) {
          values[i] = centered(seed, tensor, i, 1.0f);
        } else if (name.ends_with("res_proj.weight")) {
          values[i] = centered(seed, tensor, i, 4.0f / std::sqrt(fan_in));  // AttnRes pseudo-queries: non-uniform mixing
        } else if (name.ends_with("gate.weight") && name.find("block_sparse_moe.gate") != std::string::npos) {
          values[i] = centered(seed, tensor, i, 4.0f / std::sqrt(fan_in));  // decisive router
        } else {
          values[i] = centered(seed, tensor, i, 0.5f / std::sqrt(fan_in));
        }
      }
      if (name.ends_with("A_log") || name.ends_with("dt_bias") || name.ends_with("e_score_correction_bias")) stored = DType::F32;
      std::vector<uint8_t> bytes(n * dtype_size(stored));
      for (size_t i = 0; i < n; ++i) store(stored, bytes, i, values[i]);
      checkpoint.add_tensor(name, stored, decl.shape, std::move(bytes));
    }
  }
  return checkpoint;
}

}  // namespace plow
