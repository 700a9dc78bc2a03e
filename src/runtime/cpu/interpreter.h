// cpu/interpreter: runs validated Plans with persistent worker threads and the counter protocol of
// DESIGN.md §2 (std::atomic counters, epoch thresholds), the CI path of what the GPU megakernel does
// with on-device counters. Kernels are the reference's, called on column slices, so the outputs are
// bit-identical to cpu/reference for any worker count and any interleaving.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "graph/weights.h"
#include "plan/plan.h"
#include "runtime/backend.h"
#include "runtime/cpu/op_context.h"

namespace plow {

struct InterpreterOptions {
  int workers = 1;                 // threads, the caller's included; every plan needs plan.workers ≤ this
  DType act_dtype = DType::F32;    // F32, BF16 or F16
  int num_slots = 1;
  int64_t max_context_tokens = 0;  // per slot; MLA caches are reserved to it at reset; beyond it: plow::Error
  std::optional<uint64_t> model_fingerprint;  // when set, every plan must carry exactly this one
  Collective* collective = nullptr;  // the tensor-parallel group of a rank's plans (all_reduce)
  int64_t inject_delay_max_us = 0; // test hook: sleep a random 0..N µs before each task
  uint64_t inject_delay_seed = 1;
};

class PlanInterpreter : public Backend {
 public:
  // Validates every plan (validate_plan with this backend's kernels), binds plan weights to `weights`
  // by declaration name (plow::Error on a missing or differently shaped weight), checks that all plans
  // share one state table and output width, then starts the workers. `weights` must outlive this.
  PlanInterpreter(const BoundWeights& weights, std::vector<Plan> plans, const InterpreterOptions& options);
  ~PlanInterpreter() override;
  PlanInterpreter(const PlanInterpreter&) = delete;
  PlanInterpreter& operator=(const PlanInterpreter&) = delete;

  // Picks the smallest plan of the step's phase that holds it: all sequences bring one token → decode
  // plan with max_tokens ≥ sequences; otherwise a prefill plan with max_tokens ≥ T. One caller at a time.
  StepOutput step(const StepInputs& inputs) override;
  void reset_slot(int slot) override;
  int64_t context_tokens(int slot) const override;
  int num_slots() const override { return static_cast<int>(slots_.size()); }
  DType act_dtype() const override { return options_.act_dtype; }
  bool has_snapshots() const override { return true; }
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override;
  void restore_slot(int slot, const SlotSnapshot& snapshot) override;  // within max_context_tokens

  // Whether this backend runs `opcode` (kTokens: filled from the step; others: a CPU kernel exists).
  static bool has_op(uint8_t opcode);

  int workers() const { return options_.workers; }
  const Plan& plan(int index) const;
  int num_plans() const { return static_cast<int>(plans_.size()); }
  int last_plan() const { return last_plan_; }                   // index of the plan the last step ran
  const StepDescriptor& last_step() const { return last_step_; }

 private:
  struct PreparedPlan;

  void prepare(PreparedPlan& prepared, const std::vector<int>& weight_ids);
  int choose_plan(const StepInputs& inputs) const;
  void run_workers();
  void worker_loop(int worker);
  void run_queue(int worker);
  void record_error(std::exception_ptr error);

  const BoundWeights& weights_;
  InterpreterOptions options_;
  std::vector<std::unique_ptr<PreparedPlan>> plans_;
  std::vector<float> arena_;  // shared by all plans (one step runs at a time), sized for the largest
  std::vector<SlotState> slots_;
  std::vector<std::mt19937_64> delay_rngs_;  // one per worker, touched only by that worker

  // The step in flight: written by the caller before it releases the workers (under mutex_).
  PreparedPlan* current_ = nullptr;
  const StepInputs* inputs_ = nullptr;
  int64_t rows_ = 0;
  int last_plan_ = -1;
  StepDescriptor last_step_;

  std::vector<std::thread> threads_;  // workers 1..N−1; the caller runs worker 0
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;  // bumped to release the workers for one step
  int pending_ = 0;          // workers still running the step
  bool stopping_ = false;
  std::atomic<bool> abort_{false};  // a task failed: waiting workers give up
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace plow
