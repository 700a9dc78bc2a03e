// Weights in device memory: a checkpoint's tensors uploaded as stored (MXFP4 stays packed), or random
// weights drawn on the device for benchmarks; and the read-bandwidth probe, the roofline's denominator.
#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "runtime/cuda/backend.h"
#include "runtime/cuda/device_memory.h"

namespace plow::cuda {

void cuda_failure(const char* what, cudaError_t error) { fail("cuda: {}: {}", what, cudaGetErrorString(error)); }

int64_t device_weight_bytes(const DeviceWeightSet& weights) { return weights.bytes; }

std::shared_ptr<DeviceWeightSet> upload_weights(const Graph& graph, const BoundWeights& weights) {
  auto set = std::make_shared<DeviceWeightSet>();
  std::map<const TensorView*, DeviceWeight> done;  // tied weights share one copy
  for (size_t id = 0; id < graph.weights().size(); ++id) {
    const WeightDecl& decl = graph.weights()[id];
    const BoundWeight& bound = weights[static_cast<int>(id)];
    set->by_name.emplace(decl.name, static_cast<int>(id));
    if (auto it = done.find(bound.parts.front()); it != done.end()) {
      set->by_id.push_back(it->second);
      continue;
    }
    DeviceWeight w = weight_layout(decl, bound);
    DeviceBuffer data(static_cast<size_t>(w.part_bytes * w.parts), decl.name.c_str());
    DeviceBuffer scales(static_cast<size_t>(w.scale_part_bytes * w.parts), decl.name.c_str());
    for (int p = 0; p < w.parts; ++p) {
      const TensorView& part = *bound.parts[static_cast<size_t>(p)];
      check(cudaMemcpy(data.as<uint8_t>() + p * w.part_bytes, part.data, static_cast<size_t>(w.part_bytes), cudaMemcpyHostToDevice), "weight upload");
      if (w.type == kWMXFP4) {
        check(cudaMemcpy(scales.as<uint8_t>() + p * w.scale_part_bytes, part.mx_scales, static_cast<size_t>(w.scale_part_bytes), cudaMemcpyHostToDevice),
              "weight upload");
      }
    }
    w.data = data.as<uint8_t>();
    w.scales = scales.as<uint8_t>();
    set->bytes += static_cast<int64_t>(data.bytes + scales.bytes);
    set->buffers.push_back(std::move(data));
    set->buffers.push_back(std::move(scales));
    done.emplace(bound.parts.front(), w);
    set->by_id.push_back(w);
  }
  return set;
}

std::shared_ptr<DeviceWeightSet> random_device_weights(const Graph& graph, uint64_t seed, DType dtype) {
  auto set = std::make_shared<DeviceWeightSet>();
  std::map<std::string, DeviceWeight> made;  // tied embeddings are declared twice
  uint64_t tensor = 0;
  const int32_t type = weight_type(dtype, "random weights");
  for (size_t id = 0; id < graph.weights().size(); ++id) {
    const WeightDecl& decl = graph.weights()[id];
    set->by_name.emplace(decl.name, static_cast<int>(id));
    const uint64_t first_tensor = tensor + 1;
    tensor += decl.parts.size();
    if (auto it = made.find(decl.parts.front()); it != made.end()) {
      set->by_id.push_back(it->second);
      continue;
    }
    const auto [rows, cols] = matrix_shape(decl.shape);
    const std::string& name = decl.parts.front();
    DeviceWeight w;
    w.rows = rows;
    w.cols = cols;
    w.parts = static_cast<int32_t>(decl.parts.size());
    const bool f32 = name.ends_with("A_log") || name.ends_with("dt_bias") || name.ends_with("e_score_correction_bias");
    if (decl.mxfp4) {
      w.type = kWMXFP4;
      w.part_bytes = rows * cols / 2;
      w.scale_part_bytes = rows * cols / 32;
    } else {
      w.type = f32 ? kWF32 : type;
      w.part_bytes = rows * cols * static_cast<int64_t>(type_size(w.type));
    }
    DeviceBuffer data(static_cast<size_t>(w.part_bytes * w.parts), name.c_str());
    DeviceBuffer scales(static_cast<size_t>(w.scale_part_bytes * w.parts), name.c_str());
    // The routing bias stays zero: a trained model's balances the experts' load, where a random one
    // outweighed the gaps between saturated sigmoid scores and sent most tokens to the same few experts
    // (an 8K-token prefill on the H200: routed experts 164 ms with it, 251 ms without).
    FillKind kind = FillKind::kLinear;
    if (name.ends_with("A_log")) kind = FillKind::kALog;
    else if (name.ends_with("e_score_correction_bias")) kind = FillKind::kZero;
    else if (name.ends_with("norm.weight")) kind = FillKind::kNorm;
    else if (name.ends_with("embed_tokens.weight")) kind = FillKind::kEmbedding;
    else if (name.ends_with("res_proj.weight")) kind = FillKind::kResProj;
    else if (name.ends_with("gate.weight") && name.find("block_sparse_moe.gate") != std::string::npos) kind = FillKind::kRouter;
    const int scale_base = 127 + static_cast<int>(std::lround(std::log2(0.5 / std::sqrt(static_cast<double>(cols)) / 3.0)));
    for (int p = 0; p < w.parts; ++p) {
      const uint64_t t = first_tensor + static_cast<uint64_t>(p);
      if (decl.mxfp4) {
        launch_fill(data.as<uint8_t>() + p * w.part_bytes, w.part_bytes, 0, FillKind::kMxfp4Codes, seed, t * 2, 0, 0, nullptr);
        launch_fill(scales.as<uint8_t>() + p * w.scale_part_bytes, w.scale_part_bytes, 0, FillKind::kMxfp4Scales, seed, t * 2, 0, scale_base, nullptr);
      } else {
        launch_fill(data.as<uint8_t>() + p * w.part_bytes, rows * cols, w.type, kind, seed, t, static_cast<float>(decl.shape.back()), 0, nullptr);
      }
    }
    w.data = data.as<uint8_t>();
    w.scales = scales.as<uint8_t>();
    set->bytes += static_cast<int64_t>(data.bytes + scales.bytes);
    set->buffers.push_back(std::move(data));
    set->buffers.push_back(std::move(scales));
    made.emplace(name, w);
    set->by_id.push_back(w);
  }
  check(cudaDeviceSynchronize(), "random weights");
  return set;
}

double measure_read_bandwidth_gbps(int64_t bytes, int device) {
  check(cudaSetDevice(device), "selecting the device");
  DeviceBuffer buffer(static_cast<size_t>(bytes), "the bandwidth probe");
  check(cudaMemset(buffer.ptr, 0x5a, buffer.bytes), "bandwidth probe");
  DeviceBuffer sink(sizeof(uint32_t) * 1024, "the bandwidth probe");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::vector<float> times;
  for (int i = 0; i < 12; ++i) {
    check(cudaEventRecord(start, nullptr), "event");
    launch_read_probe(buffer.as<uint8_t>(), bytes, sink.as<uint32_t>(), sm_count_of(device), nullptr);
    check(cudaEventRecord(stop, nullptr), "event");
    check(cudaEventSynchronize(stop), "bandwidth probe");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "event");
    if (i >= 2) times.push_back(ms);  // two warm-up passes
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return static_cast<double>(bytes) / (static_cast<double>(times[times.size() / 2]) * 1e-3) / 1e9;
}

}  // namespace plow::cuda
