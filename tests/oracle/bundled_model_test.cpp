// The bundled model (models/<name>, trained by tests/reference/train_k3.py) against the PyTorch K3
// reference's fixtures in tests/data/bundled-model/reference.json, which the same script wrote from the
// exported files: perplexity of the held-out text through `plow eval-ppl`, greedy continuations of five
// prompts through `plow generate --prompt`, the tokenizer's ids for the prompts and the chat template.
#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>

#include "../unit/cli_test_util.h"
#include "serve/chat_template.h"
#include "serve/tokenizer.h"

namespace plow {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::slurp;

std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char ch : text) quoted += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return quoted + "'";
}

class BundledModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    fixture_ = new json(json::parse(slurp(fs::path(PLOW_SOURCE_DIR) / "tests/data/bundled-model/reference.json")));
  }
  static void TearDownTestSuite() { delete fixture_; }

  static const json& fixture() { return *fixture_; }
  static fs::path source(const std::string& relative) { return fs::path(PLOW_SOURCE_DIR) / relative; }
  static fs::path model_dir() { return source(fixture().at("model_dir")); }

  // Runs plow with `args`; returns its stdout parsed as JSON (the test fails on a non-zero exit).
  json plow(const std::string& args) {
    const fs::path scratch = fs::temp_directory_path() / ("plow_bundled_" + std::to_string(::getpid()));
    fs::create_directories(scratch);
    const test::Outcome outcome = test::run_plow(args, scratch, 600);
    fs::remove_all(scratch);
    EXPECT_EQ(outcome.exit_code, 0) << args << "\n" << outcome.err;
    return outcome.exit_code != 0 || outcome.out.empty() ? json::object() : json::parse(outcome.out);
  }

  static json* fixture_;
};

json* BundledModel::fixture_ = nullptr;

// The CI run scores a prefix (`--max-tokens`, recorded by the script) of the held-out text; fp32 in
// the engine, as in the reference. Tolerance 0.5% on the perplexity (the fixture's ppl_tolerance_relative).
TEST_F(BundledModel, PerplexityEqualsReference) {
  const json& ppl = fixture().at("perplexity");
  json want = ppl;
  std::string limit;
  for (const json& prefix : ppl.at("prefixes")) {
    if (prefix.at("max_tokens") == 1024) {
      want = prefix;
      limit = " --max-tokens 1024";
    }
  }
  const json got = plow("eval-ppl --model " + model_dir().string() + " --text-file " + source(ppl.at("text_file")).string() +
                        " --dtype f32" + limit);
  ASSERT_TRUE(got.contains("ppl"));
  EXPECT_EQ(got.at("predicted_tokens"), want.at("predicted_tokens"));
  const double tolerance = fixture().at("ppl_tolerance_relative");
  const double reference = want.at("ppl");
  EXPECT_NEAR(got.at("ppl").get<double>(), reference, tolerance * reference);
  std::printf("eval-ppl: plow %.6f, reference %.6f over %d tokens (%.1f s)\n", got.at("ppl").get<double>(), reference,
              got.at("tokens").get<int>(), got.at("seconds").get<double>());
}

TEST_F(BundledModel, GreedyContinuationsEqualReference) {
  const json& cases = fixture().at("greedy");
  ASSERT_GE(cases.size(), 5u) << "the script writes five prompts";
  for (const json& c : cases) {
    const std::vector<int> want = c.at("greedy_ids");
    const json got = plow("generate --model " + model_dir().string() + " --prompt " + shell_quote(c.at("prompt")) +
                          " --max-new-tokens " + std::to_string(want.size()) + " --ignore-eos --dtype f32");
    ASSERT_TRUE(got.contains("generated_ids"));
    EXPECT_EQ(got.at("prompt_tokens"), c.at("prompt_ids").size()) << c.at("prompt");
    EXPECT_EQ(got.at("generated_ids").get<std::vector<int>>(), want) << c.at("prompt");
  }
}

TEST_F(BundledModel, TokenizerGivesTheReferencePromptIds) {
  const Tokenizer tokenizer = Tokenizer::load(model_dir().string());
  for (const json& c : fixture().at("greedy")) {
    const std::vector<int32_t> ids = tokenizer.encode(c.at("prompt").get<std::string>());
    EXPECT_EQ(ids, c.at("prompt_ids").get<std::vector<int32_t>>()) << c.at("prompt");
    EXPECT_EQ(tokenizer.decode(ids), c.at("prompt").get<std::string>());
  }
}

TEST_F(BundledModel, ChatTemplateRendersTheReferencePrompt) {
  const ChatTemplate chat = ChatTemplate::from_tokenizer_config((model_dir() / "tokenizer_config.json").string());
  int rendered = 0;
  for (const json& c : fixture().at("greedy")) {
    if (!c.contains("messages")) continue;
    const nlohmann::ordered_json context = {{"messages", nlohmann::ordered_json::parse(c.at("messages").dump())},
                                            {"add_generation_prompt", true}};
    EXPECT_EQ(chat.render(context), c.at("prompt").get<std::string>());
    ++rendered;
  }
  EXPECT_EQ(rendered, 1) << "the fixture has one chat prompt";
}

}  // namespace
}  // namespace plow
