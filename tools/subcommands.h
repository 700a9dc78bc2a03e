// Subcommands that live in their own files under tools/: each add_*() declares its options on the
// app and returns the parsed-or-not command with the function that runs it, so tools/plow.cpp needs
// one registration line and one dispatch line per subcommand.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace plow {

struct Subcommand {
  CLI::App* command = nullptr;
  std::function<int()> run;
};

Subcommand add_chat_command(CLI::App& app);         // plow chat --model DIR (cmd_chat.cpp)
Subcommand add_bench_serve_command(CLI::App& app);  // plow bench serve (cmd_bench_serve.cpp)

}  // namespace plow
