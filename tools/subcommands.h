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

// `plow bench`, declared by the first benchmark that asks for it.
inline CLI::App* bench_group(CLI::App& app) {
  try {
    return app.get_subcommand("bench");
  } catch (const CLI::OptionNotFound&) {
    CLI::App* bench = app.add_subcommand("bench", "benchmarks");
    bench->require_subcommand(1);
    return bench;
  }
}

Subcommand add_chat_command(CLI::App& app);          // plow chat --model DIR (cmd_chat.cpp)
Subcommand add_bench_serve_command(CLI::App& app);   // plow bench serve (cmd_bench_serve.cpp)
Subcommand add_bench_sample_command(CLI::App& app);  // plow bench sample (cmd_bench_sample.cpp)

}  // namespace plow
