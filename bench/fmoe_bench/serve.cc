#include <cstdio>

#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"

namespace fmoe::bench {

void AddServeCommand(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("serve", "(not yet implemented)");
  cmd->callback([&exit_code] {
    std::fprintf(stderr, "fmoe-bench serve: not yet implemented\n");
    exit_code = 1;
  });
}

}  // namespace fmoe::bench
