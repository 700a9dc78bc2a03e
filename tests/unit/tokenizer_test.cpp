// Tokenizer parity with the reference libraries on every committed fixture: ids, decode, streaming
// decode (never a partial UTF-8 sequence), special tokens, and the Kimi pattern's PCRE2 translation
// checked code point by code point against the `regex` module's reading of its class intersections.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>

#include "serve/pretoken_regex.h"
#include "serve/tokenizer.h"
#include "serve/tokenizer_model.h"
#include "serve/utf8.h"
#include "tokenizer_test_util.h"

namespace plow {
namespace {

using nlohmann::json;
using test::expected;

const std::vector<std::string> kFixtures = {
    "hf_merges_pairs", "hf_merges_strings", "gpt2_bytelevel", "bytelevel_prefix_space", "split_prefix_space",
    "kimi_split", "split_behaviors", "split_invert", "digits_split_then_gpt2", "added_token_flags",
    "ignore_merges", "kimi_tiktoken"};

// Loads a fixture: its directory, or its base tokenizer.json with the JSON merge patch applied.
const Tokenizer& fixture(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  static std::vector<std::unique_ptr<test::TempDir>> dirs;
  if (auto it = cache.find(name); it != cache.end()) return it->second;
  const json& spec = expected()["fixtures"][name];
  const auto dir = test::tokenizer_data() / spec["dir"].get<std::string>();
  if (!spec.contains("patch")) return cache.emplace(name, Tokenizer::load(dir.string())).first->second;
  json patched = json::parse(test::read_text(dir / "tokenizer.json"));
  patched.merge_patch(spec["patch"]);
  dirs.push_back(std::make_unique<test::TempDir>());
  dirs.back()->write("tokenizer.json", patched.dump());
  return cache.emplace(name, Tokenizer::load(dirs.back()->str())).first->second;
}

std::vector<int32_t> ids_of(const json& array) { return array.get<std::vector<int32_t>>(); }

class TokenizerParity : public ::testing::TestWithParam<std::string> {};

TEST(TokenizerFixtures, ExpectedJsonCoversExactlyTheseFixtures) {
  std::vector<std::string> names;
  for (const auto& [name, spec] : expected()["fixtures"].items()) names.push_back(name);
  std::vector<std::string> sorted = kFixtures;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(names, sorted);
  EXPECT_GE(expected()["strings"].size(), 80u);
}

TEST_P(TokenizerParity, EncodeAndDecodeMatchReference) {
  const Tokenizer& tok = fixture(GetParam());
  const json& cases = expected()["fixtures"][GetParam()]["cases"];
  const json& strings = expected()["strings"];
  ASSERT_EQ(cases.size(), strings.size());
  size_t checked = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    if (cases[i].is_null()) continue;
    const std::string text = test::corpus_string(strings[i]);
    const std::string label = fmt::format("string #{} ({} bytes) \"{}\"", i, text.size(), text.substr(0, 60));
    const std::vector<int32_t> want = ids_of(cases[i]["ids"]);
    const std::vector<int32_t> got = tok.encode(text);
    EXPECT_EQ(got, want) << label;
    const std::vector<int32_t> want_plain = cases[i].contains("ids_no_special") ? ids_of(cases[i]["ids_no_special"]) : want;
    EXPECT_EQ(tok.encode(text, /*allow_special=*/false), want_plain) << label;
    const std::string decoded = cases[i].value("decoded", text);
    EXPECT_EQ(tok.decode(want), decoded) << label;
    EXPECT_EQ(tok.decode(want, /*skip_special=*/true), cases[i].value("decoded_skip_special", decoded)) << label;
    ++checked;
  }
  EXPECT_GE(checked, 85u);
}

// Every chunk is valid UTF-8 on its own, and the chunks add up to the full decode.
void expect_stream_matches(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special,
                           const std::string& label) {
  StreamDecoder stream(tok, skip_special);
  std::string joined;
  for (int32_t id : ids) {
    const std::string chunk = stream.push(id);
    EXPECT_FALSE(utf8::first_invalid(chunk).has_value()) << label << ": partial UTF-8 in a chunk";
    joined += chunk;
  }
  const std::string rest = stream.flush();
  EXPECT_FALSE(utf8::first_invalid(rest).has_value()) << label;
  joined += rest;
  EXPECT_EQ(joined, tok.decode(ids, skip_special)) << label;
  EXPECT_EQ(stream.flush(), "") << label << ": flush must leave nothing behind";
}

TEST_P(TokenizerParity, StreamingDecodeEqualsFullDecode) {
  const Tokenizer& tok = fixture(GetParam());
  const json& cases = expected()["fixtures"][GetParam()]["cases"];
  for (size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].is_null()) continue;
    const std::vector<int32_t> ids = ids_of(cases[i]["ids"]);
    expect_stream_matches(tok, ids, false, fmt::format("string #{}", i));
    expect_stream_matches(tok, ids, true, fmt::format("string #{} skipping specials", i));
  }
}

std::string fixture_name(const ::testing::TestParamInfo<std::string>& param_info) { return param_info.param; }
INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerParity, ::testing::ValuesIn(kFixtures), fixture_name);

TEST(TokenizerDecode, InvalidBytesBecomeReplacementCharactersLikeHf) {
  const json& spec = expected()["decode_cases"];
  const Tokenizer& tok = fixture(spec["fixture"].get<std::string>());
  ASSERT_GE(spec["cases"].size(), 10u);
  for (const json& c : spec["cases"]) {
    const std::vector<int32_t> ids = ids_of(c["ids"]);
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << c.dump();
    if (c.contains("decoded_skip_special")) {
      EXPECT_EQ(tok.decode(ids, true), c["decoded_skip_special"].get<std::string>());
    }
    expect_stream_matches(tok, ids, false, c.dump());
    expect_stream_matches(tok, ids, true, c.dump());
  }
}

TEST(TokenizerDecode, StreamHoldsBackSplitCharacter) {
  const Tokenizer& tok = fixture("hf_merges_pairs");
  // "😀" is F0 9F 98 80: one byte token each, so nothing may come out before the fourth.
  const std::vector<uint8_t> bytes = {0xF0, 0x9F, 0x98, 0x80};
  StreamDecoder stream(tok);
  std::string out;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int32_t id = tok.token_id(std::string(1, static_cast<char>(bytes[i])));
    ASSERT_GE(id, 0) << "byte " << i;
    out = stream.push(id);
    if (i + 1 < bytes.size()) {
      EXPECT_EQ(out, "") << "byte " << i;
    }
  }
  EXPECT_EQ(out, "\xF0\x9F\x98\x80");
  // A lead byte with no continuation is held back, then flushed as one U+FFFD.
  EXPECT_EQ(stream.push(tok.token_id("\xE4")), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
}

TEST(TokenizerSpecial, HfSpecialAndAddedTokens) {
  const Tokenizer& tok = fixture("hf_merges_pairs");
  EXPECT_EQ(tok.vocab_size(), 3001u);
  const int32_t im_end = tok.token_id("<|im_end|>");
  const int32_t think = tok.token_id("<think>");
  ASSERT_EQ(im_end, 3);
  ASSERT_EQ(think, 3000);
  EXPECT_TRUE(tok.is_special(im_end));
  EXPECT_FALSE(tok.is_special(think));
  EXPECT_EQ(tok.token_text(im_end), "<|im_end|>");
  EXPECT_EQ(tok.token_id("no such token"), -1);
  EXPECT_EQ(tok.encode("<|im_end|>"), std::vector<int32_t>{im_end});
  EXPECT_EQ(tok.encode("x<think>"), (std::vector<int32_t>{tok.token_id("x"), think}));
  const std::vector<int32_t> plain = tok.encode("<|im_end|><think>", false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), im_end), 0);
  EXPECT_EQ(plain.back(), think) << "non-special added tokens still match with allow_special=false";
  EXPECT_EQ(tok.decode(plain), "<|im_end|><think>");
  std::vector<int32_t> ids = tok.encode("hi");
  ids.insert(ids.begin(), tok.token_id("[BOS]"));
  ids.push_back(im_end);
  ids.push_back(think);
  EXPECT_EQ(tok.decode(ids), "[BOS]hi<|im_end|><think>");
  EXPECT_EQ(tok.decode(ids, true), "hi<think>");
  // token_text gives bytes: the GPT-2 alphabet's "Ġ" is a space.
  EXPECT_EQ(tok.token_text(tok.token_id(" ")), " ");
}

TEST(TokenizerSpecial, TiktokenReservedRange) {
  const Tokenizer& tok = fixture("kimi_tiktoken");
  const auto base = static_cast<int32_t>(tok.vocab_size()) - 256;
  EXPECT_EQ(base, 2996);
  EXPECT_EQ(tok.token_id("[BOS]"), base);
  EXPECT_EQ(tok.token_id("<|im_end|>"), base + 3);
  EXPECT_EQ(tok.token_id("<think>"), base + 4);
  EXPECT_FALSE(tok.is_special(base + 4));
  EXPECT_EQ(tok.token_id("[PAD]"), base + 255);
  EXPECT_EQ(tok.token_text(base + 7), fmt::format("<|reserved_token_{}|>", base + 7));
  EXPECT_TRUE(tok.is_special(base + 7));
  EXPECT_EQ(tok.encode(fmt::format("a<|reserved_token_{}|>", base + 7)).back(), base + 7);
  std::vector<int32_t> ids = tok.encode("hi");
  ids.insert(ids.begin(), base);
  ids.push_back(base + 4);
  ids.push_back(base + 3);
  EXPECT_EQ(tok.decode(ids, true), "hi<think>");
  EXPECT_EQ(tok.decode(ids), "[BOS]hi<think><|im_end|>");
}

// The Kimi pattern the loader compiles is the one the fixture generator gave tiktoken.
TEST(KimiPattern, IsTokenizationKimiPattern) {
  EXPECT_EQ(std::string(kKimiPattern), expected()["kimi_pattern"].get<std::string>());
  const std::string translated = translate_regex(kKimiPattern, RegexDialect::kRust, "test");
  EXPECT_EQ(translated.find("&&"), std::string::npos) << translated;
  EXPECT_NE(translated.find("(?:(?![\\p{sc:Han}])[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])*"), std::string::npos) << translated;
  RecordProperty("pcre2_pattern", translated);
}

// Each intersected class of the Kimi pattern, translated, matches exactly the code points the `regex`
// module matches (on code points assigned in Unicode 14, the version of both PCRE2 10.42 and Python 3.11,
// less the few whose category changed in the newer tables of `regex`).
TEST(KimiPattern, ClassIntersectionsMatchRegexModuleOnEveryCodePoint) {
  const PretokenRegex unassigned("\\p{Cn}", RegexDialect::kRust, "test");
  for (const auto& [name, spec] : expected()["kimi_classes"].items()) {
    const PretokenRegex cls(spec["pattern"].get<std::string>(), RegexDialect::kRust, "test");
    std::vector<bool> want(0x110000, false);
    for (const json& r : spec["ranges"]) {
      for (uint32_t cp = r[0].get<uint32_t>(); cp <= r[1].get<uint32_t>(); ++cp) want[cp] = true;
    }
    std::vector<bool> skip(0x110000, false);  // general category changed after Unicode 14 (see the generator)
    for (const json& cp : spec["unicode_version_skips"]) skip[cp.get<uint32_t>()] = true;
    size_t mismatches = 0, compared = 0;
    for (uint32_t cp = 0; cp < 0x110000; ++cp) {
      if ((cp >= 0xD800 && cp <= 0xDFFF) || skip[cp]) continue;
      std::string ch;
      utf8::append_code_point(cp, ch);
      if (unassigned.matches_at_start(ch)) continue;
      ++compared;
      if (cls.matches_at_start(ch) != want[cp] && ++mismatches <= 5) {
        ADD_FAILURE() << name << ": U+" << fmt::format("{:04X}", cp) << " expected " << want[cp];
      }
    }
    EXPECT_EQ(mismatches, 0u) << name;
    EXPECT_GT(compared, 200000u);
  }
}

uint64_t fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (int32_t id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int shift = 0; shift < 32; shift += 8) h = (h ^ ((u >> shift) & 0xFF)) * 0x100000001B3ull;
  }
  return h;
}

// Inputs too long to store ids for (one crosses Kimi's 400k-character window inside a word).
TEST(TokenizerScale, LongInputsMatchReferenceByHash) {
  ASSERT_GE(expected()["hashed_cases"].size(), 2u);
  for (const json& c : expected()["hashed_cases"]) {
    const std::string text = test::corpus_string(c["text"]);
    for (const std::string name : {"hf_merges_pairs", "kimi_tiktoken"}) {
      const std::vector<int32_t> ids = fixture(name).encode(text);
      EXPECT_EQ(ids.size(), c[name]["count"].get<size_t>()) << name << " " << c["chars"];
      EXPECT_EQ(fmt::format("{:016x}", fnv1a64(ids)), c[name]["fnv1a64"].get<std::string>()) << name << " " << c["chars"];
    }
  }
}

// Long inputs: linear-time BPE and regex (a quadratic merge loop would take minutes here).
TEST(TokenizerScale, MegabyteRoundTrips) {
  std::string text;
  const json& strings = expected()["strings"];
  while (text.size() < (1u << 20)) {
    for (const json& s : strings) {
      if (s.is_string()) text += s.get<std::string>() + "\n";
    }
  }
  const std::string word(200'000, 'q');  // one pre-token of 200k bytes
  for (const std::string name : {"hf_merges_pairs", "kimi_tiktoken", "kimi_split"}) {
    const Tokenizer& tok = fixture(name);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok.encode(text);
    const auto t1 = std::chrono::steady_clock::now();
    EXPECT_EQ(tok.decode(ids), text) << name;
    EXPECT_EQ(tok.decode(tok.encode(word)), word) << name;
    const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    RecordProperty(name + "_encode_ms_per_MiB", std::to_string(ms * (1 << 20) / static_cast<double>(text.size())));
    std::printf("%s: %zu bytes -> %zu ids in %.1f ms\n", name.c_str(), text.size(), ids.size(), ms);
  }
}

}  // namespace
}  // namespace plow
