// Plans through the real binary: plow compile writes a .plow file, plow inspect describes it,
// plow generate --backend cpu-plan runs it (or compiles on the fly) with the reference's tokens; a
// corrupt plan or a plan for another model is one stderr line and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Outcome {
  int exit_code;
  std::string out, err;
};

class PlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / (std::string("plow_plan_cli_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string slurp(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
  }

  Outcome run(const std::string& args) {
    const std::string command = std::string("timeout 300 ") + PLOW_BINARY + " " + args + " >" + (dir_ / "out").string() + " 2>" + (dir_ / "err").string();
    const int status = std::system(command.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, slurp(dir_ / "out"), slurp(dir_ / "err")};
  }

  json run_json(const std::string& args) {
    const Outcome outcome = run(args);
    EXPECT_EQ(outcome.exit_code, 0) << args << "\n" << outcome.err;
    return outcome.exit_code == 0 ? json::parse(outcome.out) : json();
  }

  void expect_rejected(const std::string& args, const std::string& needle) {
    const Outcome outcome = run(args);
    EXPECT_EQ(outcome.exit_code, 1) << outcome.err;
    EXPECT_EQ(outcome.out, "");
    EXPECT_EQ(outcome.err.rfind("plow: error: ", 0), 0u) << outcome.err;
    EXPECT_EQ(std::count(outcome.err.begin(), outcome.err.end(), '\n'), 1) << outcome.err;
    EXPECT_NE(outcome.err.find(needle), std::string::npos) << "expected '" << needle << "' in: " << outcome.err;
  }

  std::string model(const std::string& fixture = "tiny-kimi-linear") const { return (fs::path(PLOW_TEST_DATA) / fixture).string(); }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

constexpr const char* kPrompt = " --prompt-ids 5,17,42,99,7,3,8 --max-new-tokens 12 --ignore-eos";

TEST_F(PlanCli, CompileInspectAndRun) {
  const json decode = run_json("compile --model " + model() + " --workers 3 -o " + file("d.plow"));
  EXPECT_EQ(decode.at("max_tokens"), 1);
  const json prefill = run_json("compile --model " + model() + " --phase prefill --chunk 4 --workers 3 -o " + file("p.plow"));
  EXPECT_EQ(prefill.at("max_tokens"), 4);

  const json info = run_json("inspect " + file("p.plow"));
  EXPECT_EQ(info.at("phase"), "prefill");
  EXPECT_EQ(info.at("bucket"), 4);
  EXPECT_EQ(info.at("workers"), 3);
  EXPECT_LT(info.at("ops_after_fusion").get<int64_t>(), info.at("ops_before_fusion").get<int64_t>());
  EXPECT_GE(info.at("rules_fired").size(), 5u);  // the compiler ran and its certified rules fired
  const json unfused = run_json("compile --model " + model() + " --no-fusion --workers 3 -o " + file("u.plow"));
  const json unfused_info = run_json("inspect " + file("u.plow"));
  EXPECT_EQ(unfused_info.at("ops_before_fusion"), unfused_info.at("ops_after_fusion"));
  EXPECT_EQ(unfused_info.at("rules_fired"), json::array());
  // A rule left out (--disable-rule): the plan's record of what fired no longer names it.
  const json fired = info.at("rules_fired");
  ASSERT_NE(std::find(fired.begin(), fired.end(), "gate-up-silu"), fired.end());
  run_json("compile --model " + model() + " --phase prefill --chunk 4 --workers 3 --disable-rule gate-up-silu -o " + file("r.plow"));
  const json without = run_json("inspect " + file("r.plow")).at("rules_fired");
  EXPECT_EQ(std::find(without.begin(), without.end(), "gate-up-silu"), without.end());
  EXPECT_FALSE(without.empty());
  const int64_t tasks = info.at("tasks");
  EXPECT_GT(tasks, info.at("ops_after_fusion").get<int64_t>());
  EXPECT_GT(info.at("critical_path_tasks").get<int64_t>(), 10);
  EXPECT_LT(info.at("critical_path_tasks").get<int64_t>(), tasks);
  EXPECT_GT(info.at("activation_arena_bytes").get<int64_t>(), 0);
  EXPECT_GT(info.at("weight_bytes_per_step").get<int64_t>(), 0);
  EXPECT_EQ(info.at("by_opcode").at("mla_attention").at("ops"), 1);
  EXPECT_EQ(info.at("by_opcode").at("moe_topk").at("tasks"), info.at("by_opcode").at("moe_topk").at("ops"));  // runs whole
  // Sliced, 4 experts a task (lower.cpp, kRouterTaskColumns): the fixture's 8 experts in 2 tasks.
  EXPECT_EQ(info.at("by_opcode").at("router_logits").at("tasks"), 2 * info.at("by_opcode").at("router_logits").at("ops").get<int64_t>());
  EXPECT_EQ(info.at("cpu_kernels_missing"), json::array());

  const json reference = run_json("generate --model " + model() + kPrompt + " --prefill-chunk 4");
  const json planned = run_json("generate --model " + model() + kPrompt + " --prefill-chunk 4 --backend cpu-plan --plan " + file("d.plow") +
                                " --plan " + file("p.plow"));
  EXPECT_EQ(planned.at("generated_ids"), reference.at("generated_ids"));
  EXPECT_EQ(planned.at("backend"), "cpu-plan");
  // Without --prefill-chunk the prompt is split by the prefill plan's bucket.
  const json split = run_json("generate --model " + model() + kPrompt + " --backend cpu-plan --plan " + file("d.plow") + " --plan " + file("p.plow"));
  EXPECT_EQ(split.at("generated_ids"), reference.at("generated_ids"));
  const json on_the_fly = run_json("generate --model " + model() + kPrompt + " --backend cpu-plan --workers 4");
  EXPECT_EQ(on_the_fly.at("generated_ids"), reference.at("generated_ids"));
}

TEST_F(PlanCli, CompileNeedsNoWeights) {
  const std::string config = (fs::path(PLOW_TEST_DATA) / "tiny-k3" / "config.json").string();
  const json out = run_json("compile --config " + config + " --workers 2 --batch 4 -o " + file("k3.plow"));
  EXPECT_EQ(out.at("max_tokens"), 4);
  EXPECT_EQ(run_json("inspect " + file("k3.plow")).at("phase"), "decode");
}

TEST_F(PlanCli, BadPlansAreOneLineErrors) {
  run_json("compile --model " + model() + " --workers 2 -o " + file("d.plow"));
  std::string bytes = slurp(file("d.plow"));
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 4);
  std::ofstream(file("bad.plow"), std::ios::binary) << bytes;
  expect_rejected("inspect " + file("bad.plow"), "checksum mismatch");
  expect_rejected("generate --model " + model() + kPrompt + " --backend cpu-plan --plan " + file("bad.plow"), "bad.plow");
  std::ofstream(file("short.plow"), std::ios::binary) << bytes.substr(0, 10);
  expect_rejected("inspect " + file("short.plow"), "truncated");
  expect_rejected("inspect " + file("missing.plow"), "missing.plow");
  // A plan compiled for another model.
  run_json("compile --model " + model("tiny-kimi-linear-grouped") + " --workers 2 -o " + file("other.plow"));
  expect_rejected("generate --model " + model() + kPrompt + " --backend cpu-plan --plan " + file("other.plow"), "was compiled for model");
  // Only a decode plan: the 7-token prompt has no prefill plan.
  expect_rejected("generate --model " + model() + kPrompt + " --backend cpu-plan --plan " + file("d.plow"), "no prefill plan");
  expect_rejected("compile --model " + model() + " --phase decode --chunk 8 -o " + file("x.plow"), "--chunk");
  expect_rejected("compile --model " + model() + " --phase sideways -o " + file("x.plow"), "--phase");
  expect_rejected("compile --model " + model() + " --disable-rule no-such-rule -o " + file("x.plow"), "'no-such-rule' is not a compiler rule");
  expect_rejected("generate --model " + model() + kPrompt + " --workers 2", "--backend cpu-plan");
}

}  // namespace
