// What a model costs: parameters, stored bytes per dtype, and the bytes one decode token touches at
// batch 1 (every dense weight once, one embedding row, top-k of E routed experts per MoE layer, the
// KDA state read and written, one new MLA latent row) — the numerator of the decode roofline.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "core/dtype.h"
#include "graph/graph.h"

namespace plow {

struct Footprint {
  int64_t parameters = 0;
  std::map<std::string, int64_t> bytes_by_dtype;   // stored bytes ("MXFP4" for packed codes + scales)
  int64_t weight_bytes_per_token = 0;              // weights read by one decode step at batch 1
  int64_t state_bytes_per_token = 0;               // KDA recurrent + conv state read and written
  int64_t mla_cache_bytes_per_context_token = 0;   // latent cache read per decode step, per token of context
};

// storage(decl): the dtype a declared weight is stored in (ignored for MXFP4 declarations);
// act_dtype: what conv windows and the latent cache hold.
Footprint footprint(const Graph& graph, const std::function<DType(const WeightDecl&)>& storage, DType act_dtype);

}  // namespace plow
