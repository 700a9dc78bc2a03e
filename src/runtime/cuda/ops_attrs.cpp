// OpDesc::attr layouts of the ops outside the GEMV family (placeholder until their bodies land).
#include "plan/plan.h"

namespace plow::cuda {

bool pack_misc_attrs(const PlanOp& op, float* attr) {
  (void)op;
  (void)attr;
  return false;
}

}  // namespace plow::cuda
