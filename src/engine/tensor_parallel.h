// Tensor parallelism (DESIGN.md §5): one backend per rank, each over its rank's graph (graph/models:
// Megatron splits, all_reduce per sublayer), stepped in lockstep from one thread per rank; the ranks'
// vocabulary blocks of the logits are gathered into whole rows (the lm_head is column-parallel). The
// ranks' collectives are a LocalGroup (CPU backends: simulated ranks, the CI path of the sharding math)
// or NCCL communicators (one GPU per rank, built in runtime/cuda). A rank's backend may be a proxy to a
// process of its own (engine/remote_rank: `plow serve --tp N --backend cuda`).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "engine/model.h"
#include "runtime/backend.h"
#include "runtime/cpu/local_group.h"

namespace plow {

struct TpRank {
  // The rank's graph and weight blocks (the backend points into it); none for a rank whose backend
  // runs in another process (engine/remote_rank). Rank 0 always has one: its state table is every rank's.
  std::unique_ptr<LoadedModel> model;
  std::unique_ptr<Backend> backend;
};

// What joins the ranks: `abort` is called when one rank's step failed and other ranks are still
// running `abort_after` later (blocked in a collective, they must give up instead of hanging); `reset`
// before the next step after a failure. A LocalGroup aborts at once and resets; an aborted NCCL group
// is gone, so it waits long enough for healthy ranks to finish their step.
struct TpGroupControl {
  std::function<void()> abort;
  std::chrono::milliseconds abort_after{0};
  std::function<void()> reset;
  std::shared_ptr<void> keep_alive;  // the group object the ranks' backends use
};

class TensorParallelBackend : public Backend {
 public:
  TensorParallelBackend(std::vector<TpRank> ranks, TpGroupControl control);
  ~TensorParallelBackend() override;

  // Every rank runs the step; logits rows are the ranks' blocks side by side (rank order). The first
  // rank's error is rethrown (see TpGroupControl for when the group is aborted); the step's slots are
  // then undefined.
  StepOutput step(const StepInputs& inputs) override;
  void reset_slot(int slot) override;
  int64_t context_tokens(int slot) const override;
  int num_slots() const override;
  DType act_dtype() const override;
  // A snapshot holds rank 0's states and the fixed-size states (conv windows, KDA state: each rank
  // has its heads) of ranks 1..N−1 after them; the MLA latent cache is the same on every rank and is
  // kept once.
  bool has_snapshots() const override;
  SlotSnapshot save_slot(int slot, int64_t rows_begin) const override;
  void restore_slot(int slot, const SlotSnapshot& snapshot) override;

  int size() const { return static_cast<int>(ranks_.size()); }
  Backend& rank(int r) { return *ranks_.at(static_cast<size_t>(r)).backend; }

 private:
  // Runs fn(rank) on every rank at once (rank 0 on the calling thread); rethrows the first failure.
  void on_every_rank(const std::function<void(int)>& fn);

  TpGroupControl control_;  // declared first: the ranks' backends go before the group they use
  std::vector<TpRank> ranks_;
  size_t states_per_rank_ = 0;
};

// `size` simulated ranks of `load(shard)` on the CPU, joined by a LocalGroup; `make` builds a rank's
// backend (ReferenceBackend or a PlanInterpreter) over its model and the group's collective.
std::unique_ptr<TensorParallelBackend> make_local_tp_backend(int size, const std::function<std::unique_ptr<LoadedModel>(TpShard)>& load,
                                                             const std::function<std::unique_ptr<Backend>(const LoadedModel&, Collective&)>& make);

}  // namespace plow
