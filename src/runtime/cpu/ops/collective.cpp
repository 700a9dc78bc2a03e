// all_reduce: the rank's partial sums [T, F] added over the tensor-parallel group, rounded once.
#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

void cpu_all_reduce(OpContext& ctx) {
  if (!ctx.collective) fail("{}: all_reduce needs a tensor-parallel group, and this backend has none", ctx.node.label);
  PLOW_CHECK(ctx.begin() == 0 && ctx.end() == ctx.node.width, "{}: all_reduce runs as one task", ctx.node.label);
  const int64_t count = ctx.rows * ctx.node.width;
  std::copy(ctx.inputs[0].data, ctx.inputs[0].data + count, ctx.out);
  ctx.collective->all_reduce_sum(ctx.out, count);
  for (int64_t i = 0; i < count; ++i) ctx.out[i] = ctx.round_out(ctx.out[i]);
}

}  // namespace plow
