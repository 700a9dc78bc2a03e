// Stream time of timed regions, summed (the benchmarks' per-op shares of a prompt): start() and stop()
// record an event pair on the stream around a region; harvest() adds up the pairs recorded since the
// last harvest, waiting for each stop event (no wait once the stream has passed it), and reuses them.
// Internal to src/runtime/cuda (moe_gemm.cpp, mla_gemm.cpp).
#pragma once

#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "runtime/cuda/device_memory.h"

namespace plow::cuda {

class StreamTimer {
 public:
  explicit StreamTimer(cudaStream_t stream) : stream_(stream) {}
  ~StreamTimer() {
    for (auto& [start, stop] : events_) {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
  }
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;

  void start() {
    if (pending_ == events_.size()) {
      events_.emplace_back();
      check(cudaEventCreate(&events_.back().first), "event");
      check(cudaEventCreate(&events_.back().second), "event");
    }
    check(cudaEventRecord(events_[pending_].first, stream_), "event");
  }
  void stop() { check(cudaEventRecord(events_[pending_++].second, stream_), "event"); }

  void harvest() {
    for (size_t i = 0; i < pending_; ++i) {
      check(cudaEventSynchronize(events_[i].second), "timing");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, events_[i].first, events_[i].second), "event");
      total_ms_ += static_cast<double>(ms);
    }
    pending_ = 0;
  }
  // Every region so far, in ms (synchronizes the stream).
  double total_ms() {
    check(cudaStreamSynchronize(stream_), "timing");
    harvest();
    return total_ms_;
  }
  void reset() {
    total_ms();
    total_ms_ = 0;
  }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> events_;  // recorded, not yet read: [0, pending_)
  size_t pending_ = 0;
  double total_ms_ = 0;
};

}  // namespace plow::cuda
