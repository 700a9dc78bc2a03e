#include "compiler/certificates.h"

#include <nlohmann/json.hpp>

#include <cmath>

#include "core/error.h"

namespace plow {

extern const char* const kEmbeddedCertificates;  // generated from certificates.json at build time

CertificateSet parse_certificates(const std::string& json_text, const std::string& origin) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed certificates: {}", origin, e.what());
  }
  CertificateSet set;
  if (!root.is_object()) fail("{}: expected an object of certificates keyed by rule name", origin);
  for (const auto& [name, entry] : root.items()) {
    try {
      Certificate c;
      c.rule = name;
      c.definition_hash = entry.at("definition_hash").get<std::string>();
      c.cases = entry.at("cases").get<int>();
      c.max_error = entry.at("max_error").get<double>();
      c.bound = entry.at("bound").get<double>();
      set[name] = c;
    } catch (const nlohmann::json::exception& e) {
      fail("{}: certificate of rule '{}' is malformed: {}", origin, name, e.what());
    }
  }
  return set;
}

std::string certificates_to_json(const CertificateSet& set) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  for (const auto& [name, c] : set) {
    const double error = std::isfinite(c.max_error) ? c.max_error : 1e300;  // JSON has no infinity
    root[name] = {{"definition_hash", c.definition_hash}, {"cases", c.cases}, {"max_error", error}, {"bound", c.bound}};
  }
  return root.dump(2) + "\n";
}

const CertificateSet& embedded_certificates() {
  static const CertificateSet set = parse_certificates(kEmbeddedCertificates, "src/compiler/certificates.json");
  return set;
}

void require_certified(const std::vector<const Rule*>& rules, const CertificateSet& set) {
  for (const Rule* rule : rules) {
    auto it = set.find(rule->name);
    const std::string hash = definition_hash(*rule);
    if (it == set.end()) fail("rule '{}' has no certificate; the compiler refuses uncertified rules", rule->name);
    if (it->second.definition_hash != hash) {
      fail("rule '{}' changed since it was certified (definition hash {} vs certificate {}); re-run the certificate test",
           rule->name, hash, it->second.definition_hash);
    }
    if (!it->second.passed()) {
      fail("rule '{}' failed its certificate (max error {} over {} cases, bound {})", rule->name, it->second.max_error,
           it->second.cases, it->second.bound);
    }
  }
}

}  // namespace plow
