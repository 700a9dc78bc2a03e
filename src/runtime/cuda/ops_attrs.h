// Attribute packing for the CUDA op bodies in runtime/cuda/ops/ (host side, no CUDA headers): turns a
// plan op's named attributes into the fixed float array OpDesc::attr the device bodies read. Each op
// body documents its layout next to its code; ops_attrs.cpp is the one place that writes them.
#pragma once

#include "plan/plan.h"

namespace plow::cuda {

inline constexpr int kPackedAttrs = 16;  // = kMaxAttrs of device.cuh (static_assert in ops/misc_ops.cuh)

// Fills attr[0..kPackedAttrs) for the norm, elementwise, KDA, MLA, moe_topk and AttnRes ops and returns
// true; returns false for an op it does not handle (the linear family and router logits, experts,
// tokens, embedding).
// Throws plow::Error when a shape exceeds what the device bodies support (KDA head_dim > 128, MLA
// rank > 512 or rank + rope > 576, moe_topk experts > 1024 or top_k > 64, inconsistent groups).
bool pack_misc_attrs(const PlanOp& op, float* attr);

// Fills attr[0..kPackedAttrs) for any op with a body: the weight-streaming family (gemv.cuh documents
// each layout; most have none), the rest through pack_misc_attrs. Throws plow::Error for an op without
// a layout, or with a shape the bodies do not support.
void pack_op_attrs(const PlanOp& op, float* attr);

// Whether the op's tasks cooperate within a step through a global workspace and OpDesc::sync counters
// (MLA split-KV, ops/mla.cuh; chunked KDA prefill, ops/kda_chunked.cuh; AttnRes, ops/attn_res.cuh),
// and the floats of workspace such an op needs for steps of up to max_tokens rows and max_seqs sequences, run by `tasks` tasks.
bool cooperates(const PlanOp& op);
int64_t workspace_floats(const PlanOp& op, int64_t max_tokens, int64_t max_seqs, int32_t tasks);

}  // namespace plow::cuda
