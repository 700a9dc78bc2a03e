// kEmbedding (cpu: ops/linear.cpp cpu_embedding): out[t, c] = act(table[id_t, c]) over the task's element_share.
// A prefill step gives each task whole rows: by column slices a task walked the step's rows one after
// another (a token id load, then a table load, per row) with 17 of its 512 threads busy at 2304
// columns on 132 workers: 0.87 ms for the 1,024 rows of one op. A token id outside the table is an
// error (kErrBadToken); its row is left unwritten. The table is dense (weight_flat: f32, bf16, f16).
#pragma once

#include "runtime/cuda/ops/common.cuh"

namespace plow::cuda {

// Inputs: the token ids [T, 1] (exact in fp32). attrs: none.
__device__ __noinline__ void op_embedding(const TaskCtx& ctx) {
  const DeviceWeight table = ctx.weight(0);
  const Rows<const float> ids = ctx.in_rows(0);
  const Rows<float> out = ctx.out_rows();
  const int32_t act = ctx.out_act();
  auto known = [&](float id) { return id >= 0.0f && static_cast<int64_t>(id) < table.rows; };  // NaN: unknown
  for_each_share_element(
      ctx,
      [&](int t, int64_t c) {
        const float id = ids[t][0];
        return Operands{id, known(id) ? weight_flat(table, static_cast<int64_t>(id) * table.cols + c) : 0.0f};
      },
      [&](int t, int64_t c, Operands v) {
        if (known(v.a)) {
          out[t][c] = round_act(act, v.b);
        } else {
          report_error(ctx, kErrBadToken);
        }
      });
}

}  // namespace plow::cuda
