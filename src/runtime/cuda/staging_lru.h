// Which of a few staging buffers holds the converted copy of which input, the least recently used one
// overwritten. GemmRunner (prefill_gemm.h) keeps its GEMM inputs' bf16/f16 copies by this rule, and
// `plow bench prefill` replays a step's GEMMs through the same class to count the conversions the step
// makes (tools/cuda_bench_prefill.cpp), so the count follows the runner. Host code only.
#pragma once

#include <array>
#include <cstdint>
#include <optional>

namespace plow::cuda {

template <class Key, int Slots>
class StagingLru {
  static_assert(Slots > 0);

 public:
  struct Use {
    int slot = 0;
    bool hit = false;  // the slot already holds the key's copy: nothing to convert
  };

  // The slot that holds `key`'s copy, else the least recently used one (the lowest index on a tie),
  // which holds it from now on.
  Use use(const Key& key) {
    for (int s = 0; s < Slots; ++s) {
      if (keys_[s] && *keys_[s] == key) {
        used_[s] = ++uses_;
        return {s, true};
      }
    }
    const int s = take();
    keys_[s] = key;
    return {s, false};
  }
  // The least recently used slot, for a copy that no later call can name (it holds no key).
  int take() {
    int pick = 0;
    for (int s = 1; s < Slots; ++s) {
      if (used_[s] < used_[pick]) pick = s;
    }
    keys_[pick].reset();
    used_[pick] = ++uses_;
    return pick;
  }
  // `slot` was overwritten by something no key names: it holds nothing and is the next one taken.
  void forget(int slot) {
    keys_[slot].reset();
    used_[slot] = 0;
  }
  // Every copy is stale (a new step).
  void clear() {
    for (int s = 0; s < Slots; ++s) forget(s);
  }

 private:
  std::array<std::optional<Key>, Slots> keys_{};
  std::array<uint64_t, Slots> used_{};
  uint64_t uses_ = 0;
};

}  // namespace plow::cuda
