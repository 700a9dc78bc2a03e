// `plow eval-ppl` through the real binary on tiny-k3 with the byte-level tokenizer of
// tiny-kimi-linear-chat: the mean NLL equals the float64 PyTorch reference's
// (tests/data/eval-ppl/expected.json, made by tests/reference/make_eval_ppl_fixture.py), for the whole
// text, a --max-tokens prefix, chunked steps and the plan backend; bad input is one stderr line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "cli_test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using plow::test::Outcome;
using plow::test::slurp;

class EvalPpl : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path data(PLOW_TEST_DATA);
    dir_ = fs::temp_directory_path() / (std::string("plow_eval_ppl_") + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    model_ = dir_ / "model";
    fs::create_directories(model_);
    for (const char* name : {"config.json", "model.safetensors"}) fs::copy(data / "tiny-k3" / name, model_ / name);
    fs::copy(data / "tiny-kimi-linear-chat" / "tokenizer.json", model_ / "tokenizer.json");
    text_ = data / "eval-ppl" / "text.txt";
    expected_ = json::parse(slurp(data / "eval-ppl" / "expected.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }

  Outcome run(const std::string& args) { return plow::test::run_plow(args, dir_); }

  json eval(const std::string& extra) {
    const Outcome outcome = run("eval-ppl --model " + model_.string() + " --text-file " + text_.string() + " " + extra);
    EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
    if (outcome.exit_code != 0) return json::object();
    return json::parse(outcome.out);
  }

  void expect_rejected(const Outcome& outcome, const std::string& needle) {
    EXPECT_EQ(outcome.exit_code, 1);
    EXPECT_EQ(outcome.out, "");
    EXPECT_EQ(std::count(outcome.err.begin(), outcome.err.end(), '\n'), 1) << outcome.err;
    EXPECT_NE(outcome.err.find(needle), std::string::npos) << outcome.err;
  }

  fs::path dir_, model_, text_;
  json expected_;
};

// fp32 engine vs float64 reference: the logits agree to ~1e-5, so the mean NLL to far better than 1e-5.
constexpr double kNllRelTol = 1e-5;

TEST_F(EvalPpl, WholeTextMatchesReference) {
  const json r = eval("--dtype f32");
  ASSERT_FALSE(r.empty());
  EXPECT_EQ(r["tokens"], expected_["tokens"]);
  EXPECT_EQ(r["predicted_tokens"], expected_["predicted_tokens"]);
  const double nll = r["nll"], want = expected_["nll"];
  EXPECT_NEAR(nll, want, kNllRelTol * want);
  EXPECT_NEAR(r["ppl"].get<double>(), std::exp(nll), 1e-9 * std::exp(nll));
  EXPECT_EQ(r["dtype"], "F32");
}

TEST_F(EvalPpl, MaxTokensScoresThePrefix) {
  const json& prefix = expected_["prefix"];
  const json r = eval("--dtype f32 --max-tokens " + std::to_string(prefix["max_tokens"].get<int>()));
  ASSERT_FALSE(r.empty());
  EXPECT_EQ(r["tokens"], prefix["max_tokens"]);
  const double want = prefix["nll"];
  EXPECT_NEAR(r["nll"].get<double>(), want, kNllRelTol * want);
}

TEST_F(EvalPpl, ChunksCarryTheContext) {
  // 7-token steps: KDA state, conv windows and the MLA cache carry over; a reset between chunks would
  // change the loss by far more than the tolerance.
  const json r = eval("--dtype f32 --chunk 7");
  ASSERT_FALSE(r.empty());
  const double want = expected_["nll"];
  EXPECT_NEAR(r["nll"].get<double>(), want, kNllRelTol * want);
}

TEST_F(EvalPpl, PlanBackendEqualsReferenceBackend) {
  const json whole = eval("--dtype f32 --chunk 64");
  const json plan = eval("--dtype f32 --chunk 64 --backend cpu-plan --workers 2");
  ASSERT_FALSE(whole.empty());
  ASSERT_FALSE(plan.empty());
  EXPECT_EQ(plan["backend"], "cpu-plan");
  EXPECT_DOUBLE_EQ(plan["nll"].get<double>(), whole["nll"].get<double>());  // bit-identical logits
}

TEST_F(EvalPpl, Bf16StaysClose) {
  const json r = eval("--dtype bf16");
  ASSERT_FALSE(r.empty());
  const double want = expected_["nll"];
  EXPECT_EQ(r["dtype"], "BF16");
  EXPECT_NEAR(r["nll"].get<double>(), want, 1e-2 * want);
}

TEST_F(EvalPpl, BadInputIsOneLine) {
  expect_rejected(run("eval-ppl --model " + model_.string() + " --text-file " + (dir_ / "missing.txt").string()), "cannot open");
  std::ofstream(dir_ / "one.txt") << "x";
  expect_rejected(run("eval-ppl --model " + model_.string() + " --text-file " + (dir_ / "one.txt").string()), "at least 2");
  expect_rejected(run("eval-ppl --model " + model_.string() + " --text-file " + text_.string() + " --backend gpu"), "--backend");
  expect_rejected(run("eval-ppl --model " + model_.string() + " --text-file " + text_.string() + " --chunk 0"), "--chunk");
  fs::remove(model_ / "tokenizer.json");
  expect_rejected(run("eval-ppl --model " + model_.string() + " --text-file " + text_.string()), "tokenizer");
}

}  // namespace
