// fmoe-bench subcommands. Each Add*Command registers its subcommand on `app`; the subcommand's
// callback runs it and stores the process exit code in `exit_code` (0 ok, 1 failed, 2 bad
// arguments or input).
#pragma once

namespace CLI {
class App;
}

namespace fmoe::bench {

void AddImportTraceCommand(CLI::App& app, int& exit_code);  // trace_import.cc
void AddReplayCommand(CLI::App& app, int& exit_code);       // replay.cc
void AddServeCommand(CLI::App& app, int& exit_code);        // serve.cc
void AddMakeModelCommand(CLI::App& app, int& exit_code);    // make_model.cc

}  // namespace fmoe::bench
