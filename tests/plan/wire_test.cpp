// The .plow wire format: round trip, and every malformed file is a plow::Error naming the file —
// random bit flips (raw, and re-checksummed so the parser and range checks see them), truncation at
// every part of the envelope and body, absurd counts in an otherwise valid body. Runs under ASan/UBSan.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "engine/model.h"
#include "plan/lower.h"
#include "plan/validate.h"
#include "plan/wire.h"

namespace plow {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Plan tiny_plan() {
  static const auto model = LoadedModel::describe((fs::path(PLOW_TEST_DATA) / "tiny-kimi-linear" / "config.json").string());
  Plan plan = lower_to_plan(model->graph, {PlanPhase::kPrefill, 3, 3, 0, 0x0123456789abcdefULL});
  plan.compile.ops_before_fusion = 130;
  plan.compile.rules_fired = {"rms_norm+linear", "silu_mul+linear"};
  return plan;
}

std::string with_body(const std::string& body) {  // a fresh envelope with a correct checksum
  std::string out = "PLOWPLAN";
  auto put = [&](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(kPlanFormatVersion, 4);
  put(body.size(), 8);
  put(fnv1a64(body), 8);
  return out + body;
}

json body_of(const std::string& bytes) { return json::parse(bytes.substr(kPlanHeaderBytes)); }

// parse + validate, as a loader does: either a valid plan or a plow::Error; anything else fails.
bool loads(const std::string& bytes) {
  try {
    const Plan plan = parse_plan(bytes, "fuzz.plow");
    validate_plan(plan, [](uint8_t) { return true; });
    return true;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fuzz.plow"), std::string::npos) << e.what();
    return false;
  }
}

void expect_error(const std::string& bytes, const std::string& needle) {
  try {
    const Plan plan = parse_plan(bytes, "bad.plow");
    validate_plan(plan, [](uint8_t) { return true; });
    FAIL() << "accepted; expected an error containing: " << needle;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("bad.plow"), std::string::npos) << message;
    EXPECT_NE(message.find(needle), std::string::npos) << message;
  }
}

TEST(PlanWire, RoundTripIsExact) {
  const Plan plan = tiny_plan();
  const std::string bytes = serialize_plan(plan);
  const Plan back = parse_plan(bytes, "mem");
  EXPECT_EQ(serialize_plan(back), bytes);
  EXPECT_NO_THROW(validate_plan(back, [](uint8_t) { return true; }));
  EXPECT_EQ(back.model_fingerprint, 0x0123456789abcdefULL);
  EXPECT_EQ(back.phase, PlanPhase::kPrefill);
  EXPECT_EQ(back.compile.rules_fired, plan.compile.rules_fired);
  ASSERT_EQ(back.ops.size(), plan.ops.size());
  for (size_t i = 0; i < plan.ops.size(); ++i) EXPECT_EQ(back.ops[i].attrs.values(), plan.ops[i].attrs.values()) << "attrs must round-trip bit for bit";

  const fs::path path = fs::temp_directory_path() / "plow_wire_roundtrip.plow";
  write_plan(path.string(), plan);
  EXPECT_EQ(serialize_plan(read_plan(path.string())), bytes);
  EXPECT_EQ(read_plan(path.string()).source, path.string());
  fs::remove(path);
  EXPECT_THROW(read_plan(path.string()), Error);                               // missing
  EXPECT_THROW(read_plan(fs::temp_directory_path().string()), Error);         // a directory
}

TEST(PlanWire, RawBitFlipsAreAlwaysRejected) {
  const std::string good = serialize_plan(tiny_plan());
  for (uint64_t seed = 0; seed < 400; ++seed) {
    std::mt19937_64 rng(seed);
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      // Half the flips land in the 28-byte header, the rest anywhere.
      const size_t at = rng() % 2 ? rng() % kPlanHeaderBytes : rng() % bytes.size();
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
    }
    if (bytes == good) continue;
    EXPECT_FALSE(loads(bytes)) << "seed " << seed;
  }
}

TEST(PlanWire, RechecksummedBitFlipsNeverCrash) {
  const std::string good = serialize_plan(tiny_plan());
  const std::string body = good.substr(kPlanHeaderBytes);
  int rejected = 0, total = 0;
  for (uint64_t seed = 0; seed < 600; ++seed) {
    std::mt19937_64 rng(seed);
    std::string mutated = body;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % mutated.size();
      mutated[at] = static_cast<char>(mutated[at] ^ (1 << (rng() % 8)));
    }
    ++total;
    rejected += loads(with_body(mutated)) ? 0 : 1;
  }
  std::printf("re-checksummed bit flips: %d of %d rejected (the rest changed labels, names or values consistently)\n", rejected, total);
  EXPECT_GT(rejected, total / 2);
}

TEST(PlanWire, TruncationAtEveryLengthClassIsRejected) {
  const std::string good = serialize_plan(tiny_plan());
  const size_t n = good.size();
  for (size_t length : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{11}, size_t{12}, size_t{19}, size_t{20}, size_t{27},
                        size_t{28}, size_t{29}, size_t{40}, n / 3, n / 2, n - 2, n - 1}) {
    expect_error(good.substr(0, length), length < kPlanHeaderBytes ? "truncated" : "the file holds");
  }
  // Truncated bodies with a consistent envelope reach the JSON parser.
  const std::string body = good.substr(kPlanHeaderBytes);
  for (size_t length : {size_t{0}, size_t{1}, body.size() / 2, body.size() - 1}) expect_error(with_body(body.substr(0, length)), "not valid JSON");
}

TEST(PlanWire, EnvelopeFieldsAreChecked) {
  std::string bytes = serialize_plan(tiny_plan());
  std::string other = bytes;
  other[0] = 'X';
  expect_error(other, "PLOWPLAN");
  other = bytes;
  other[8] = 9;  // version
  expect_error(other, "format version 9");
  other = bytes;
  for (int i = 12; i < 20; ++i) other[static_cast<size_t>(i)] = static_cast<char>(0xff);  // body length 2^64−1
  expect_error(other, "exceeds the limit");
  other = bytes;
  other[25] = static_cast<char>(other[25] ^ 0x10);
  expect_error(other, "checksum mismatch");
}

// Each edit keeps the JSON well formed and the checksum right, so only range checks can reject it.
TEST(PlanWire, AbsurdCountsInAValidBodyAreRejected) {
  const json good = body_of(serialize_plan(tiny_plan()));
  const std::vector<std::pair<std::function<void(json&)>, std::string>> edits = {
      {[](json& b) { b["workers"] = 1000000000; }, "field 'workers' is 1000000000"},
      {[](json& b) { b["counters"] = int64_t{1} << 40; }, "field 'counters'"},
      {[](json& b) { b["arena_floats"] = uint64_t{1} << 62; }, "field 'arena_floats'"},
      {[](json& b) { b["max_tokens"] = int64_t{1} << 40; }, "field 'max_tokens'"},
      {[](json& b) { b["max_tokens"] = 2.5; }, "must be an integer"},
      {[](json& b) { b["max_tokens"] = -3; }, "field 'max_tokens' is -3"},
      {[](json& b) { b["output_op"] = uint64_t{18446744073709551615ULL}; }, "field 'output_op'"},
      {[](json& b) { b["tasks"][0]["signals"] = std::vector<int>(5000, 1); }, "tasks[0].signals' has 5000 entries"},
      {[](json& b) { b["tasks"][3]["threshold"] = int64_t{1} << 50; }, "tasks[3].threshold"},
      {[](json& b) { b["tasks"][2]["cols"] = json::array({0, 1, 2}); }, "tasks[2].cols"},
      {[](json& b) { b["ops"][4]["inputs"] = json::array({int64_t{1} << 33}); }, "ops[4].inputs[0]"},
      {[](json& b) { b["ops"][4]["width"] = int64_t{1} << 30; }, "ops[4].width"},
      {[](json& b) { b["ops"][4]["attrs"] = json::array({json::array({"eps", 1e-5}), json::array({"eps", 1e-6})}); }, "appears twice"},
      {[](json& b) { b["ops"][4]["op"] = "quantum_linear"; }, "opcode 'quantum_linear' is not in this build's op table"},
      {[](json& b) { b["ops"][4]["label"] = std::string(100000, 'x'); }, "ops[4].label' is 100000 bytes"},
      {[](json& b) { b["weights"][0]["shape"] = json::array({int64_t{1} << 50, 2}); }, "weights[0].shape[0]"},
      {[](json& b) { b["weights"][0]["parts"] = std::vector<std::string>(70000, "p"); }, "weights[0].parts' has 70000 entries"},
      {[](json& b) { b["states"][0]["kind"] = "hologram"; }, "states[0].kind"},
      {[](json& b) { b["queues"] = std::vector<std::vector<int>>(2000); }, "field 'queues' has 2000 entries"},
      {[](json& b) { b["queues"].push_back(json::array()); }, "field 'queues' is 4"},
      {[](json& b) { b["model_fingerprint"] = "not-hex"; }, "model_fingerprint"},
      {[](json& b) { b["phase"] = "training"; }, "field 'phase'"},
      {[](json& b) { b.erase("tasks"); }, "field 'tasks' is missing"},
      {[](json& b) { b["compile"]["rules_fired"] = json::array({1, 2}); }, "compile.rules_fired[0]' must be a string"},
      {[](json& b) {
         json deep = json::array();
         for (int i = 0; i < 200; ++i) deep = json::array({deep});
         b["compile"]["rules_fired"] = deep;
       },
       "nests deeper"},
      {[](json& b) { b = json::array({1, 2, 3}); }, "must be an object"},
  };
  for (const auto& [edit, needle] : edits) {
    json body = good;
    edit(body);
    expect_error(with_body(body.dump()), needle);
  }
}

}  // namespace
}  // namespace plow
