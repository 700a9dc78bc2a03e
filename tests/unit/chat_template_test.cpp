// ChatTemplate against Python jinja2 configured as HF transformers renders chat templates: every real
// template x conversation and every construct case must match tests/data/chat_templates/expected.json
// byte for byte (or fail where jinja2 fails); plus load-time errors with origin:line:column, runtime
// errors, limits on hostile templates, mutated templates, and tokenizer_config.json loading.
#include "serve/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>

#include "core/error.h"

namespace plow {
namespace {

using nlohmann::ordered_json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

const std::string kDir = std::string(PLOW_TEST_DATA) + "/chat_templates";

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

ordered_json load_json(const std::string& name) {
  std::string text = read_text(kDir + "/" + name);
  return text.empty() ? ordered_json() : ordered_json::parse(text);
}

const ordered_json& expected() {
  static const ordered_json data = load_json("expected.json");
  return data;
}

// make_expected.py pins strftime_now to 2025-03-14 09:26:53 (a Friday, day 73 of the year).
std::tm fixed_now() {
  std::tm tm{};
  tm.tm_year = 2025 - 1900;
  tm.tm_mon = 2;
  tm.tm_mday = 14;
  tm.tm_hour = 9;
  tm.tm_min = 26;
  tm.tm_sec = 53;
  tm.tm_wday = 5;
  tm.tm_yday = 72;
  return tm;
}

// A directory of this process's own (ctest runs test processes in parallel), removed at exit.
const std::string& temp_dir() {
  static const std::string dir = [] {
    std::string d = ::testing::TempDir() + "/plow_chat_template_" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    std::atexit([] { std::filesystem::remove_all(::testing::TempDir() + "/plow_chat_template_" + std::to_string(::getpid())); });
    return d;
  }();
  return dir;
}

std::string write_temp(const std::string& name, const std::string& text) {
  std::string path = temp_dir() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// Loads each real template through a tokenizer_config.json carrying it and its special tokens.
const ChatTemplate& real_template(const std::string& name) {
  static std::map<std::string, ChatTemplate> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const ordered_json& info = expected()["templates"][name];
  ordered_json config = info["special_tokens"];
  config["chat_template"] = read_text(kDir + "/" + info["file"].get<std::string>());
  config["model_max_length"] = 131072;
  ChatTemplate t = ChatTemplate::from_tokenizer_config(write_temp(name + "/tokenizer_config.json", config.dump(1)));
  t.set_clock(fixed_now);
  return cache.emplace(name, std::move(t)).first->second;
}

// Where jinja2 raises (raise_exception, undefined values, sandbox, Python type errors), the render
// must fail too, with the same message after the origin:line:column prefix.
void expect_error(const std::function<std::string()>& render, const ordered_json& want) {
  try {
    std::string out = render();
    ADD_FAILURE() << "rendered instead of failing with " << want["error_type"] << ": " << want["error"] << "\n" << out;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(": " + want["error"].get<std::string>())) << want["error_type"];
  }
}

// ---- Parity: real templates x conversations ----

struct RenderCase {
  std::string template_name, conversation;
  size_t index;
};

std::vector<RenderCase> render_cases() {
  std::vector<RenderCase> cases;
  if (expected().is_null()) return cases;
  const ordered_json& renders = expected()["renders"];
  for (size_t i = 0; i < renders.size(); ++i) cases.push_back({renders[i]["template"], renders[i]["conversation"], i});
  return cases;
}

class TemplateParity : public ::testing::TestWithParam<RenderCase> {};

TEST_P(TemplateParity, MatchesJinja2) {
  const RenderCase& c = GetParam();
  static const ordered_json conversations = load_json("conversations.json");
  const ordered_json* conversation = nullptr;
  for (const auto& conv : conversations["conversations"]) {
    if (conv["name"] == c.conversation) conversation = &conv;
  }
  ASSERT_NE(conversation, nullptr);
  // What a server passes: messages, tools when there are any, the flag and template kwargs; render()
  // adds tools/documents = None and the tokenizer's special tokens like apply_chat_template.
  ordered_json context = {{"messages", (*conversation)["messages"]},
                          {"add_generation_prompt", (*conversation)["add_generation_prompt"]}};
  if (conversation->contains("tools")) {
    context["tools"] = conversations["tool_sets"][(*conversation)["tools"].get<std::string>()];
  }
  if (conversation->contains("kwargs")) context.update((*conversation)["kwargs"]);
  const ChatTemplate& t = real_template(c.template_name);
  const ordered_json& want = expected()["renders"][c.index];
  if (want.contains("output")) {
    EXPECT_EQ(t.render(context), want["output"].get<std::string>());
  } else {
    expect_error([&] { return t.render(context); }, want);
  }
}

INSTANTIATE_TEST_SUITE_P(RealTemplates, TemplateParity, ::testing::ValuesIn(render_cases()),
                         [](const auto& test_info) { return test_info.param.template_name + "__" + test_info.param.conversation; });

// ---- Parity: one construct per case ----

struct ConstructCase {
  std::string name;
  size_t index;
};

std::vector<ConstructCase> construct_cases() {
  std::vector<ConstructCase> cases;
  if (expected().is_null()) return cases;
  const ordered_json& constructs = expected()["constructs"];
  for (size_t i = 0; i < constructs.size(); ++i) cases.push_back({constructs[i]["name"], i});
  return cases;
}

class ConstructParity : public ::testing::TestWithParam<ConstructCase> {};

TEST_P(ConstructParity, MatchesJinja2) {
  static const ordered_json constructs = load_json("constructs.json");
  const ordered_json& input = constructs["cases"][GetParam().index];
  const ordered_json& want = expected()["constructs"][GetParam().index];
  ASSERT_EQ(input["name"], want["name"]);
  auto render = [&] {
    ChatTemplate t = ChatTemplate::parse(input["template"].get<std::string>(), "construct " + GetParam().name);
    t.set_clock(fixed_now);
    return t.render(input["context"]);
  };
  if (want.contains("output")) {
    EXPECT_EQ(render(), want["output"].get<std::string>());
  } else {
    expect_error(render, want);
  }
}

INSTANTIATE_TEST_SUITE_P(Constructs, ConstructParity, ::testing::ValuesIn(construct_cases()),
                         [](const auto& test_info) { return test_info.param.name; });

TEST(ChatTemplateData, ExpectedFileCoversEveryTemplate) {
  ASSERT_FALSE(expected().is_null()) << "missing " << kDir << "/expected.json";
  EXPECT_EQ(expected()["templates"].size(), 12u);
  EXPECT_EQ(render_cases().size(), 12u * load_json("conversations.json")["conversations"].size());
  EXPECT_GE(construct_cases().size(), 80u);
}

// ---- Load-time errors: origin, line and column ----

std::string parse_error(const std::string& source) {
  try {
    ChatTemplate::parse(source, "tokenizer_config.json: chat_template");
  } catch (const Error& e) {
    return e.what();
  }
  return "(parsed)";
}

TEST(ChatTemplateParse, ErrorsNameOriginLineAndColumn) {
  EXPECT_EQ(parse_error("ok\n{{ x | frobnicate }}"),
            "tokenizer_config.json: chat_template:2:8: no filter named 'frobnicate'");
  EXPECT_EQ(parse_error("{% if x is frob %}{% endif %}"), "tokenizer_config.json: chat_template:1:12: no test named 'frob'");
  EXPECT_THAT(parse_error("a\n\n  {% if x %}\nnever closed"), StartsWith("tokenizer_config.json: chat_template:3:6: 'if' block is never closed"));
  EXPECT_THAT(parse_error("{% for m in messages %}{{ m }}"), HasSubstr(":1:4: 'for' block is never closed (expected 'endfor' or 'else')"));
  EXPECT_THAT(parse_error("{% macro f() %}x"), HasSubstr(":1:4: 'macro' block is never closed"));
  EXPECT_THAT(parse_error("x {# open comment"), HasSubstr(":1:3: missing end of comment tag"));
  EXPECT_THAT(parse_error("{{ 'unterminated }}"), HasSubstr(":1:4: unexpected char"));
  EXPECT_THAT(parse_error("{{ x "), HasSubstr(":1:1: missing '}}'"));
  EXPECT_THAT(parse_error("{{ 1 + }}"), HasSubstr(":1:8: unexpected end of print statement"));
  EXPECT_THAT(parse_error("{{ a b }}"), HasSubstr(":1:6: expected end of print statement '}}', got 'b'"));
  EXPECT_THAT(parse_error("{% endif %}"), HasSubstr(":1:4: unknown tag 'endif'"));
  EXPECT_THAT(parse_error("{{ (1, 2] }}"), HasSubstr(":1:9: unexpected ']', expected ')'"));
  EXPECT_THAT(parse_error("{{ x @ y }}"), HasSubstr(":1:6: unexpected char '@'"));
  EXPECT_THAT(parse_error("{% set %}"), HasSubstr(":1:8: expected a variable name"));
  EXPECT_THAT(parse_error("{% if true %}{% break %}{% endif %}"), HasSubstr(":1:17: 'break' outside of a for loop"));
  EXPECT_THAT(parse_error("{% for x in y %}{% macro m() %}{% continue %}{% endmacro %}{% endfor %}"),
              HasSubstr("'continue' outside of a for loop"));
}

TEST(ChatTemplateParse, UnsupportedTagsFailAtLoad) {
  for (std::string tag : {"include 'x.jinja'", "extends 'base'", "import 'm' as m", "from 'm' import f",
                          "block body", "do x.append(1)", "autoescape true", "frobnicate"}) {
    std::string error = parse_error("line\n{% " + tag + " %}");
    EXPECT_THAT(error, StartsWith("tokenizer_config.json: chat_template:2:4: ")) << tag;
    EXPECT_THAT(error, HasSubstr("tag '" + tag.substr(0, tag.find(' ')) + "'")) << tag;
  }
}

TEST(ChatTemplateParse, UnsupportedCallsFailAtLoad) {
  EXPECT_THAT(parse_error("{{ 'a'.encode('utf-8') }}"), HasSubstr(":1:4: the method 'encode' is not supported"));
  EXPECT_THAT(parse_error("{{ cycler('a', 'b') }}"), HasSubstr(":1:4: the global 'cycler' is not supported"));
  EXPECT_THAT(parse_error("{% for x in y recursive %}{% endfor %}"), HasSubstr("recursive for loops are not supported"));
  EXPECT_THAT(parse_error("{{ f(*args) }}"), HasSubstr("*args and **kwargs in calls are not supported"));
  EXPECT_THAT(parse_error("{{ x|map('nosuchfilter') }}"), HasSubstr("no filter named 'nosuchfilter'"));
}

TEST(ChatTemplateParse, HostileTemplatesAreRejectedNotCrashed) {
  EXPECT_THAT(parse_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}"),
              HasSubstr("template nests deeper than"));
  EXPECT_THAT(parse_error("{{ " + std::string(100000, '[') + " }}"), HasSubstr(":1:100005: unexpected '}', expected ']'"));
  EXPECT_THAT(parse_error("{{ " + std::string(100000, '[') + std::string(100000, ']') + " }}"),
              HasSubstr("template nests deeper than"));
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if x %}";
  EXPECT_THAT(parse_error(ifs), HasSubstr("template nests deeper than"));
  std::string nots = "{{ ";
  for (int i = 0; i < 50000; ++i) nots += "not ";
  EXPECT_THAT(parse_error(nots + "x }}"), HasSubstr("template nests deeper than"));
  EXPECT_THAT(parse_error("{{ x" + std::string(60000, '|') + " }}"), HasSubstr("expected a name"));
  EXPECT_THAT(parse_error(std::string(2 << 20, 'a')), HasSubstr("larger than the 1048576 bytes accepted"));
}

// ---- Runtime errors and limits ----

std::string render_error(const std::string& source, const ordered_json& context = ordered_json::object()) {
  try {
    return "(rendered) " + ChatTemplate::parse(source, "t").render(context);
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(ChatTemplateRender, RuntimeErrorsCarryTheMessage) {
  EXPECT_EQ(render_error("\n\n  {{ raise_exception('Only user and assistant roles are supported!') }}"),
            "t:3:6: Only user and assistant roles are supported!");
  EXPECT_EQ(render_error("{{ messages[0].content.upper }}", {{"messages", ordered_json::array()}}),
            "t:1:4: list object has no element 0");
  EXPECT_EQ(render_error("{{ m.content.strip() }}", {{"m", {{"role", "user"}}}}),
            "t:1:4: 'dict object' has no attribute 'content'");
  EXPECT_EQ(render_error("{{ 'a' + 1 }}"), "t:1:8: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(render_error("{% set ns = 1 %}{% set ns.x = 2 %}"), "t:1:20: cannot assign attribute on non-namespace object");
}

std::string limited_error(const std::string& source, const ChatTemplateLimits& limits) {
  ChatTemplate t = ChatTemplate::parse(source, "t");
  t.set_limits(limits);
  try {
    return "(rendered) " + t.render(ordered_json::object());
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(ChatTemplateRender, RunawayTemplatesHitLimits) {
  ChatTemplateLimits small;
  small.max_steps = 200'000;
  small.max_loop_iterations = 20'000;
  small.max_output_bytes = 100'000;
  EXPECT_THAT(render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
              HasSubstr("macro calls nested deeper than 100 levels"));
  EXPECT_THAT(limited_error("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", small),
              HasSubstr("render exceeded 20000 loop iterations"));
  EXPECT_THAT(limited_error("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                            small),
              HasSubstr("render exceeded 200000 evaluation steps"));
  EXPECT_THAT(limited_error("{% for i in range(1000) %}{{ 'y' * 1000 }}{% endfor %}", small),
              HasSubstr("output longer than 100000 bytes"));
  // Work that grows with the size of strings counts too: quadratic growth and repeated scans stop.
  EXPECT_THAT(limited_error("{% set ns = namespace(s='') %}{% for i in range(10000) %}"
                            "{% set ns.s = ns.s ~ '0123456789abcdef0123456789abcdef' %}{% endfor %}", small),
              HasSubstr("render exceeded 200000 evaluation steps"));
  EXPECT_THAT(limited_error("{% set s = 'x' * 1000000 %}{% for i in range(10000) %}{{ s[i] }}{% endfor %}", small),
              HasSubstr("render exceeded 200000 evaluation steps"));
  EXPECT_THAT(render_error("{{ 'x' * 1000000000000 }}"), HasSubstr("string longer than"));
  EXPECT_THAT(render_error("{{ range(100001)|length }}"), HasSubstr("Range too big"));
  EXPECT_THAT(render_error("{% set ns = namespace(v=[]) %}{% for i in range(5000) %}{% set ns.v = [ns.v] %}{% endfor %}"),
              HasSubstr("value nests deeper than"));
  EXPECT_THAT(render_error("{{ 9223372036854775807 + 1 }}"), HasSubstr("integer overflow"));
  // A namespace that holds itself and macros kept in scopes they close over are freed (LeakSanitizer).
  EXPECT_EQ(render_error("{% set ns = namespace() %}{% set ns.me = ns %}{% macro m() %}{% endmacro %}"
                         "{% for i in range(3) %}{% macro k() %}{{ ns }}{% endmacro %}{% set ns.k = k %}{% endfor %}ok"),
            "(rendered) ok");
}

TEST(ChatTemplateRender, DeepRecursionIsAnErrorNotAStackOverflow) {
  std::string open, close;
  for (int i = 0; i < 40; ++i) open += "{% if true %}", close += "{% endif %}";
  EXPECT_THAT(render_error("{% macro f(n) %}" + open + "{{ f(n + 1) }}" + close + "{% endmacro %}{{ f(0) }}"),
              HasSubstr("template recursion deeper than 1500 levels"));
  EXPECT_THAT(render_error("{% macro f(n) %}{{ " + std::string(40, '[') + "f(n + 1)" + std::string(40, ']') +
                           " }}{% endmacro %}{{ f(0) }}"),
              HasSubstr("template recursion deeper than 1500 levels"));
}

TEST(ChatTemplateRender, DefaultLimitsLeaveRoomForLongConversations) {
  ordered_json messages = ordered_json::array();
  for (int i = 0; i < 2000; ++i) {
    messages.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "turn " + std::to_string(i)}});
  }
  for (const char* name : {"qwen3", "kimi_k3", "gpt_oss", "llama3_3"}) {
    std::string out = real_template(name).render(ordered_json{{"messages", messages}, {"add_generation_prompt", true}});
    EXPECT_THAT(out, HasSubstr("turn 1999")) << name;
  }
}

TEST(ChatTemplateRender, MutatedRealTemplatesNeverCrash) {
  std::mt19937 rng(1234);
  const ordered_json context = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"add_generation_prompt", true}};
  int parsed = 0, rendered = 0;
  for (const auto& [name, info] : expected()["templates"].items()) {
    std::string source = read_text(kDir + "/" + info["file"].get<std::string>());
    for (int trial = 0; trial < 60; ++trial) {
      std::string mutated = source;
      std::uniform_int_distribution<size_t> position(0, mutated.size() - 1);
      if (trial % 3 == 0) {
        mutated.resize(position(rng));
      } else {
        for (int k = 0; k < 3; ++k) mutated[position(rng)] = "{}%#()[]|.'\"-x \n"[rng() % 16];
      }
      try {
        ChatTemplate t = ChatTemplate::parse(mutated, name);
        ++parsed;
        t.render(context);
        ++rendered;
      } catch (const Error&) {
      }
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(rendered, 0);
}

TEST(ChatTemplateRender, ContextKeyOrderIsWhatTojsonPrints) {
  ChatTemplate t = ChatTemplate::parse("{{ tools|tojson }}", "t");
  ordered_json tools = ordered_json::array({{{"type", "function"}, {"function", {{"name", "f"}}}}});
  EXPECT_EQ(t.render(ordered_json{{"tools", tools}}), R"([{"type": "function", "function": {"name": "f"}}])");
  nlohmann::json sorted = {{"tools", nlohmann::json::parse(tools.dump())}};
  EXPECT_EQ(t.render(sorted), R"([{"function": {"name": "f"}, "type": "function"}])");
  EXPECT_THAT(render_error("{{ x }}", ordered_json::array()), HasSubstr("the render context must be a JSON object"));
}

TEST(ChatTemplateRender, HfDefaultsAndClock) {
  ChatTemplate t = ChatTemplate::parse(
      "{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ bos_token }}|{{ strftime_now('%Y') }}", "t");
  t.set_default("bos_token", "<s>");
  t.set_clock(fixed_now);
  EXPECT_EQ(t.render(ordered_json::object()), "True|True|False|<s>|2025");
  EXPECT_EQ(t.render(ordered_json{{"bos_token", "[B]"}, {"add_generation_prompt", true}}), "True|True|True|[B]|2025");
  ChatTemplate wall = ChatTemplate::parse("{{ strftime_now('%Y')|int > 2000 }}", "t");
  EXPECT_EQ(wall.render(ordered_json::object()), "True");
}

// ---- tokenizer_config.json ----

TEST(ChatTemplateConfig, ReadsStringListAndTokenObjects) {
  std::string path = write_temp("string_config.json", R"({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
      "bos_token": {"content": "<|bos|>", "lstrip": false}, "eos_token": "<|eos|>", "pad_token": null})");
  ChatTemplate t = ChatTemplate::from_tokenizer_config(path);
  EXPECT_EQ(t.origin(), path + ": chat_template");
  EXPECT_EQ(t.render(ordered_json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}), "<|bos|>hi<|eos|>");
  EXPECT_FALSE(t.defaults().contains("pad_token"));

  path = write_temp("list_config.json", R"({"chat_template": [{"name": "tool_use", "template": "tools"},
      {"name": "default", "template": "default {{ 1 + 1 }}"}]})");
  ChatTemplate listed = ChatTemplate::from_tokenizer_config(path);
  EXPECT_EQ(listed.render(ordered_json::object()), "default 2");
  EXPECT_EQ(listed.origin(), path + ": chat_template[default]");
}

TEST(ChatTemplateConfig, ParseErrorsNameTheConfigFile) {
  std::string path = write_temp("bad_template.json", R"({"chat_template": "{% for m in messages %}"})");
  EXPECT_THAT([&] { ChatTemplate::from_tokenizer_config(path); },
              ::testing::ThrowsMessage<Error>(HasSubstr(path + ": chat_template:1:4: 'for' block is never closed")));
}

TEST(ChatTemplateConfig, BadConfigsAreErrors) {
  auto error = [](const std::string& name, const std::string& text) {
    try {
      ChatTemplate::from_tokenizer_config(write_temp(name, text));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_THAT(error("none.json", R"({"eos_token": "x"})"), HasSubstr("no 'chat_template' field"));
  EXPECT_THAT(error("nodefault.json", R"({"chat_template": [{"name": "rag", "template": "x"}]})"),
              HasSubstr("no entry named 'default' (found: rag)"));
  EXPECT_THAT(error("number.json", R"({"chat_template": 3})"), HasSubstr("must be a string or a list"));
  EXPECT_THAT(error("broken.json", R"({"chat_template": )"), HasSubstr("not valid JSON"));
  EXPECT_THAT(error("token.json", R"({"chat_template": "x", "eos_token": 5})"), HasSubstr("'eos_token' must be"));
  EXPECT_THAT([] { ChatTemplate::from_tokenizer_config("/nonexistent/tokenizer_config.json"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("cannot open")));
}

TEST(ChatTemplateConfig, FallsBackToChatTemplateJinjaBesideTheConfig) {
  std::string config = write_temp("sibling/tokenizer_config.json", R"({"eos_token": "</s>"})");
  write_temp("sibling/chat_template.jinja", "{{ eos_token }}\n");
  ChatTemplate t = ChatTemplate::from_tokenizer_config(config);
  EXPECT_EQ(t.render(ordered_json::object()), "</s>");
}

}  // namespace
}  // namespace plow
