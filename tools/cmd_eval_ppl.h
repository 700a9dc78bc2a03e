// plow eval-ppl: the perplexity of a text file under a model, tokenized with the model's own tokenizer
// and scored teacher-forced through an engine backend (tools/cmd_eval_ppl.cpp).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace plow {

struct SubcommandEntry {
  CLI::App* command = nullptr;
  std::function<int()> run;  // called when `command` was parsed
};

SubcommandEntry add_eval_ppl_command(CLI::App& app);

}  // namespace plow
