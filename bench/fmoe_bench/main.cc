// fmoe-bench: the benchmarks that compare policies side by side (DESIGN section 11).
//   fmoe-bench import-trace   convert a recorded routing trace of another system into ours
//   fmoe-bench replay         every cache policy and the oracle over a trace, with a link model
//   fmoe-bench serve          the real processes once per policy, driven over HTTP
//   fmoe-bench make-model     random-weight checkpoints with real models' shapes
#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"
#include "common/log.h"

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the tables.
  if (fmoe::Status s = fmoe::InitLogging("fmoe-bench", "info"); !s.ok()) return 2;
  CLI::App app{"fmoe-bench: compare expert cache policies on traces and on the running system"};
  app.require_subcommand(1);
  int exit_code = 0;
  fmoe::bench::AddImportTraceCommand(app, exit_code);
  fmoe::bench::AddReplayCommand(app, exit_code);
  fmoe::bench::AddServeCommand(app, exit_code);
  fmoe::bench::AddMakeModelCommand(app, exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
