// validate_plan: the load-time gate every plan passes before a backend runs it (read from a file or
// lowered in memory). A plan that passes cannot make a worker wait forever, cannot race on a buffer,
// and hands every base-table kernel inputs, weights and state of the sizes it indexes.
#pragma once

#include <cstdint>
#include <functional>

#include "plan/plan.h"

namespace plow {

// Throws plow::Error naming plan.source and the offending op / task / counter / field. Checks:
// counts within PlanLimits; indices in range; every opcode in the op table and known to the backend
// (`backend_has_op`), never skipped; op arity, attributes and widths re-derived through the op
// table's shape rules; state kinds and sizes per stateful op; slices covering each op exactly on its
// granularity; thresholds equal to the number of tasks signalling each counter; producers before
// consumers (acyclic); every input's tasks and every write-after-read hazard of arena reuse covered
// by a counter edge (a read through a view — a slice — counts as a read of the buffer it looks into);
// views without tasks, at their source's offset plus their first column, never the output nor an
// all_reduce's input; buffers inside the arena; queues in op order with every task exactly once;
// every declared weight read by some op.
void validate_plan(const Plan& plan, const std::function<bool(uint8_t opcode)>& backend_has_op);

}  // namespace plow
