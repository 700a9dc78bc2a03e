// all_reduce: the rank's partial sums [T, F] added over the tensor-parallel group, rounded once.
#include "core/error.h"
#include "runtime/cpu/op_context.h"

namespace plow {

void cpu_all_reduce(OpContext& ctx) {
  if (!ctx.collective) fail("{}: all_reduce needs a tensor-parallel group, and this backend has none", ctx.node.label);
  PLOW_CHECK(ctx.begin() == 0 && ctx.end() == ctx.node.width, "{}: all_reduce runs as one task", ctx.node.label);
  const int64_t count = ctx.rows * ctx.node.width;
  for (int64_t t = 0; t < ctx.rows; ++t) std::copy(ctx.in(0, t), ctx.in(0, t) + ctx.node.width, ctx.out_row(t));
  ctx.collective->all_reduce_sum(ctx.out, count);
  for (int64_t i = 0; i < count; ++i) ctx.out[i] = ctx.round_out(ctx.out[i]);
}

}  // namespace plow
