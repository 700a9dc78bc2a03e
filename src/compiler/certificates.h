// Rule certificates: evidence, produced by a test that links the CPU reference, that a rule's two
// sides agree on random instances (several sizes incl. odd ones, several seeds, fp32 and bf16).
// The compiler reads them as data (compiled into the binary from certificates.json) and refuses to
// run a rule whose certificate is missing, failed, or was made for another definition of the rule.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "compiler/rule.h"

namespace plow {

struct Certificate {
  std::string rule;
  std::string definition_hash;
  int cases = 0;
  double max_error = 0;  // max |lhs − rhs| over all cases
  double bound = 0;      // the fused ops compute the exact composition, so the bound is 0
  bool passed() const { return cases > 0 && max_error <= bound; }
};

using CertificateSet = std::map<std::string, Certificate>;

CertificateSet parse_certificates(const std::string& json_text, const std::string& origin);
std::string certificates_to_json(const CertificateSet& set);
const CertificateSet& embedded_certificates();  // src/compiler/certificates.json, built in

// Throws plow::Error naming the first rule without a valid certificate in `set`.
void require_certified(const std::vector<const Rule*>& rules, const CertificateSet& set);

}  // namespace plow
