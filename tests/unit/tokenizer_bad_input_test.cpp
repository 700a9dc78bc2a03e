// Malformed and unsupported tokenizer files, bad text and bad ids: each is a plow::Error whose message
// names the file and the field or line, never a crash or a silently different tokenizer.
#include <gtest/gtest.h>

#include "core/error.h"
#include "serve/pretoken_regex.h"
#include "serve/tokenizer.h"
#include "tokenizer_test_util.h"

namespace plow {
namespace {

using nlohmann::json;

json base_tokenizer_json() {
  static const json j = json::parse(test::read_text(test::tokenizer_data() / "hf_merges_pairs" / "tokenizer.json"));
  return j;
}

// The message of the plow::Error that loading `dir` throws ("" if it loads).
std::string load_error(const test::TempDir& dir) {
  try {
    Tokenizer::load(dir.str());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string hf_error(const json& patch) {
  json j = base_tokenizer_json();
  j.merge_patch(patch);
  test::TempDir dir;
  dir.write("tokenizer.json", j.dump());
  return load_error(dir);
}

#define EXPECT_MENTIONS(message, ...)                                              \
  do {                                                                             \
    const std::string msg_ = (message);                                           \
    EXPECT_FALSE(msg_.empty()) << "expected a plow::Error";                         \
    for (const char* part : {__VA_ARGS__}) EXPECT_NE(msg_.find(part), std::string::npos) << msg_; \
  } while (0)

TEST(TokenizerBadInput, HfTokenizerJson) {
  test::TempDir dir;
  dir.write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, )");
  EXPECT_MENTIONS(load_error(dir), "tokenizer.json", "invalid JSON");

  EXPECT_MENTIONS(hf_error({{"model", {{"type", "WordPiece"}}}}), "tokenizer.json", "model.type", "WordPiece");
  EXPECT_MENTIONS(hf_error({{"model", {{"type", "Unigram"}}}}), "tokenizer.json", "model.type", "Unigram");
  EXPECT_MENTIONS(hf_error({{"model", {{"merges", nullptr}}}}), "tokenizer.json", "model.merges", "missing");
  EXPECT_MENTIONS(hf_error({{"model", {{"merges", json::array({json::array({"Ġ", "zzzz"})})}}}}), "model.merges[0]",
                  "zzzz");
  EXPECT_MENTIONS(hf_error({{"model", {{"merges", json::array({"a b c"})}}}}), "model.merges[0]", "one space");
  EXPECT_MENTIONS(hf_error({{"model", {{"merges", json::array({42})}}}}), "model.merges[0]");
  EXPECT_MENTIONS(hf_error({{"model", {{"vocab", {{"a", -3}}}}}}), "model.vocab");
  EXPECT_MENTIONS(hf_error({{"model", {{"vocab", {{"a", 7}, {"b", 7}}}}}}), "model.vocab", "id 7");
  EXPECT_MENTIONS(hf_error({{"model", {{"vocab", {{"a", 2147483000}}}}}}), "model.vocab[\"a\"]", "2147483000");
  EXPECT_MENTIONS(hf_error({{"model", {{"vocab", {{"a", 1.5}}}}}}), "model.vocab[\"a\"]");
  EXPECT_MENTIONS(hf_error({{"model", {{"dropout", 0.1}}}}), "model.dropout");
  EXPECT_MENTIONS(hf_error({{"model", {{"byte_fallback", true}}}}), "model.byte_fallback");
  EXPECT_MENTIONS(hf_error({{"model", {{"continuing_subword_prefix", "##"}}}}), "continuing_subword_prefix");
  EXPECT_MENTIONS(hf_error({{"model", {{"unk_token", "<unk>"}}}}), "model.unk_token", "<unk>");
  EXPECT_MENTIONS(hf_error({{"normalizer", {{"type", "NFC"}}}}), "tokenizer.json", "normalizer.type", "NFC");
  EXPECT_MENTIONS(hf_error({{"normalizer", {{"type", "Lowercase"}}}}), "normalizer.type", "Lowercase");
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", nullptr}}), "pre_tokenizer");
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", {{"type", "Whitespace"}}}}), "pre_tokenizer.type", "Whitespace");
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", {{"type", "Metaspace"}}}}), "pre_tokenizer.type", "Metaspace");
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", {{"type", "ByteLevel"}, {"use_regex", true}}}}), "add_prefix_space");
  const json split_only = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", split_only}}), "pre_tokenizer", "ByteLevel");
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  json bad_regex = split_only;
  bad_regex["pattern"]["Regex"] = "(unclosed";
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {bad_regex, byte_level}}}}}),
                  "tokenizer.json", "pre_tokenizer.pretokenizers[0].pattern", "(unclosed");
  json bad_behavior = split_only;
  bad_behavior["behavior"] = "Sideways";
  EXPECT_MENTIONS(hf_error({{"pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {bad_behavior, byte_level}}}}}),
                  "pretokenizers[0].behavior", "Sideways");
  EXPECT_MENTIONS(hf_error({{"decoder", nullptr}}), "decoder", "missing");
  EXPECT_MENTIONS(hf_error({{"decoder", {{"type", "WordPiece"}}}}), "decoder.type", "WordPiece");
  json added = base_tokenizer_json()["added_tokens"];
  added[0]["id"] = 5;  // "[BOS]" is id 0 in model.vocab
  EXPECT_MENTIONS(hf_error({{"added_tokens", added}}), "added_tokens[0].id");
  added = base_tokenizer_json()["added_tokens"];
  added[1]["content"] = "";
  EXPECT_MENTIONS(hf_error({{"added_tokens", added}}), "added_tokens[1].content");
  added = base_tokenizer_json()["added_tokens"];
  added[4]["special"] = "yes";
  EXPECT_MENTIONS(hf_error({{"added_tokens", added}}), "added_tokens[4].special");
}

std::string tiktoken_error(const std::string& model, const std::string& config) {
  test::TempDir dir;
  dir.write("tiktoken.model", model);
  if (!config.empty()) dir.write("tokenizer_config.json", config);
  return load_error(dir);
}

TEST(TokenizerBadInput, Tiktoken) {
  const std::string model = test::read_text(test::tokenizer_data() / "kimi_tiktoken" / "tiktoken.model");
  const std::string config = test::read_text(test::tokenizer_data() / "kimi_tiktoken" / "tokenizer_config.json");
  EXPECT_EQ(tiktoken_error(model, config), "") << "the unmodified fixture must load";
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\nIg= 1\n", config), "tiktoken.model:2", "base64", "Ig=");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\nI*== 1\n", config), "tiktoken.model:2", "base64");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\nIg== 0\n", config), "tiktoken.model:2", "rank 0", "line 1");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\nIQ== 1\n", config), "tiktoken.model:2", "already given");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\nIg== 2\n", config), "tiktoken.model", "rank 1 is missing");
  EXPECT_MENTIONS(tiktoken_error("IQ== x\n", config), "tiktoken.model:1", "rank");
  EXPECT_MENTIONS(tiktoken_error("IQ== 2000000000\n", config), "tiktoken.model:1", "2000000000");
  EXPECT_MENTIONS(tiktoken_error("IQ== -1\n", config), "tiktoken.model:1", "-1");
  EXPECT_MENTIONS(tiktoken_error("IQ==\n", config), "tiktoken.model:1");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0 extra\n", config), "tiktoken.model:1");
  EXPECT_MENTIONS(tiktoken_error("", config), "tiktoken.model", "no tokens");
  EXPECT_MENTIONS(tiktoken_error("IQ== 0\n", config), "tiktoken.model", "byte 0x00");
  EXPECT_MENTIONS(tiktoken_error(model, ""), "tokenizer_config.json", "cannot open");
  EXPECT_MENTIONS(tiktoken_error(model, "{\"added_tokens_decoder\": "), "tokenizer_config.json", "invalid JSON");
  EXPECT_MENTIONS(tiktoken_error(model, R"({"added_tokens_decoder": {"5": {"content": "[X]"}}})"),
                  "tokenizer_config.json", "added_tokens_decoder[\"5\"]", "outside");
  EXPECT_MENTIONS(tiktoken_error(model, R"({"added_tokens_decoder": {"2996": {"content": 7}}})"),
                  "added_tokens_decoder[\"2996\"].content");
  EXPECT_MENTIONS(tiktoken_error(model, R"({"added_tokens_decoder": {"2996": {"content": "[A]"}, "2997": {"content": "[A]"}}})"),
                  "tokenizer_config.json", "[A]");
}

TEST(TokenizerBadInput, Directories) {
  test::TempDir empty;
  EXPECT_MENTIONS(load_error(empty), "no tokenizer.json or tiktoken.model");
  try {
    Tokenizer::load(empty.str() + "/missing");
    ADD_FAILURE() << "expected a plow::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
  }
}

TEST(TokenizerBadInput, TextAndIds) {
  const Tokenizer tok = Tokenizer::load((test::tokenizer_data() / "hf_merges_pairs").string());
  for (const std::string bad : {"abc\xff", "\xc3", "\xed\xa0\x80", "\xc0\xaf", "ok\xf4\x90\x80\x80"}) {
    try {
      tok.encode(bad);
      ADD_FAILURE() << "expected a plow::Error for invalid UTF-8";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
    }
  }
  for (int32_t id : {-1, 3001, 1 << 30}) {
    EXPECT_THROW(tok.decode(std::vector<int32_t>{id}), Error) << id;
    EXPECT_THROW(tok.token_text(id), Error) << id;
    StreamDecoder stream(tok);
    EXPECT_THROW(stream.push(id), Error) << id;
  }
}

// Constructs PCRE2 lacks or reads differently are translated; the rest are rejected by name.
TEST(PretokenRegex, TranslatesDialects) {
  const auto onig = [](std::string_view p) { return translate_regex(p, RegexDialect::kOniguruma, "t"); };
  const auto rust = [](std::string_view p) { return translate_regex(p, RegexDialect::kRust, "t"); };
  EXPECT_EQ(rust("\\p{Han}+"), "\\p{sc:Han}+");
  EXPECT_EQ(onig("\\p{^Greek}\\P{Lu}\\pL"), "\\P{sc:Greek}\\P{Lu}\\p{L}");
  EXPECT_EQ(rust("\\p{Letter}\\p{scx=Han}\\p{gc=Nd}"), "\\p{L}\\p{scx:Han}\\p{Nd}");
  EXPECT_EQ(rust("\\s+(?!\\S)"), "\\p{White_Space}+(?!\\P{White_Space})");
  EXPECT_EQ(rust("[^\\s\\p{L}]"), "[^\\p{White_Space}\\p{L}]");
  EXPECT_EQ(rust("[a-z&&[^aeiou]]"), "(?:(?![aeiou])[a-z])");
  EXPECT_EQ(rust("[a-z--[aeiou]]"), "(?:(?![aeiou])[a-z])");
  EXPECT_EQ(onig("[\\p{L}&&\\p{Lu}]"), "(?:(?=[\\p{Lu}])[\\p{L}])");
  EXPECT_EQ(onig("[a[0-9]]"), "(?:[a]|[0-9])");
  EXPECT_EQ(onig("^a$"), "(?m:^)a(?m:$)");
  EXPECT_EQ(onig("(?m:.)(?i)x"), "(?s:.)(?i)x");
  EXPECT_EQ(onig("a{,3}\\h"), "a{0,3}[0-9A-Fa-f]");
  EXPECT_EQ(rust("\\u00e9\\x{1F600}\\v"), "\\x{00e9}\\x{1F600}\\x{0B}");
  EXPECT_EQ(rust("(?u:x)"), "(?:x)");
  EXPECT_THROW(rust("[a~~b]"), Error);
  EXPECT_THROW(rust("[a&&b--c]"), Error);
  EXPECT_THROW(onig("(?a)x"), Error);
  EXPECT_THROW(rust("\\p{Bogus=1}"), Error);
  EXPECT_THROW(PretokenRegex("\\p{NotAProperty}", RegexDialect::kRust, "t"), Error);
  EXPECT_THROW(PretokenRegex("[abc", RegexDialect::kRust, "t"), Error);
}

TEST(PretokenRegex, MatchesLikeTheSourceEngine) {
  std::vector<MatchSpan> spans;
  const std::string text = "abcXYZé 中文、。 k\xE1\xA0\x8E";  // U+180E is not White_Space
  PretokenRegex("[\\p{L}&&[^a-z]]+", RegexDialect::kRust, "t").find_all(text, spans);
  ASSERT_GE(spans.size(), 2u);
  EXPECT_EQ(text.substr(spans[0].begin, spans[0].end - spans[0].begin), "XYZé");
  spans.clear();
  PretokenRegex("\\p{Han}+", RegexDialect::kRust, "t").find_all(text, spans);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(text.substr(spans[0].begin, spans[0].end - spans[0].begin), "中文") << "、 is Han only by Script_Extensions";
  spans.clear();
  PretokenRegex("\\s", RegexDialect::kOniguruma, "t").find_all(text, spans);
  EXPECT_EQ(spans.size(), 2u);
  spans.clear();
  PretokenRegex("x*", RegexDialect::kRust, "t").find_all("axb", spans);  // empty matches, Rust's iteration
  ASSERT_EQ(spans.size(), 3u);
  EXPECT_EQ(spans[1].begin, 1u);
  EXPECT_EQ(spans[1].end, 2u);
  EXPECT_EQ(spans[2].begin, 3u);
  spans.clear();
  PretokenRegex::literal("a.b", "t").find_all("axb a.b", spans);
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].begin, 4u);
  spans.clear();
  PretokenRegex::literal("", "t").find_all("abc", spans);
  EXPECT_TRUE(spans.empty());
}

}  // namespace
}  // namespace plow
