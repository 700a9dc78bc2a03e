// The .plow file: a 28-byte binary envelope, then the plan as JSON text.
//   bytes  0..7   magic "PLOWPLAN"
//   bytes  8..11  u32 format version (little-endian)
//   bytes 12..19  u64 body length in bytes
//   bytes 20..27  u64 FNV-1a-64 of the body
//   bytes 28..    body: one JSON object (docs/plan.md lists its fields)
// Reading checks the envelope, then parses and range-checks every field; any malformed file is a
// plow::Error naming the file and the field, never a crash, a hang or an allocation beyond the limits.
// Loaders still run validate_plan on the result (relations between fields, the backend's ops).
#pragma once

#include <string>
#include <string_view>

#include "plan/plan.h"

namespace plow {

inline constexpr size_t kPlanHeaderBytes = 28;

std::string serialize_plan(const Plan& plan);                            // envelope + body
Plan parse_plan(std::string_view bytes, const std::string& source_name);  // source_name: for messages
void write_plan(const std::string& path, const Plan& plan);
Plan read_plan(const std::string& path);  // Plan::source = path

}  // namespace plow
