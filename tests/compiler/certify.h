// Producing a rule's certificate: both sides evaluated by the CPU reference on random instances.
#pragma once

#include "compiler/certificates.h"
#include "compiler/rule.h"

namespace plow {

// Sizes 5, 7, 13, 16 × seeds 1..3 × activations fp32 and bf16, 3 tokens each. A case where the
// rule does not fire, or where the extracted graph does not use its right-hand side, counts as a
// failure (max_error = ∞): a certificate never vouches for a rule that was not exercised.
Certificate certify(const Rule& rule);

}  // namespace plow
