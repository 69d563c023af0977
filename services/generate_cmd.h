// `fmoe generate --model DIR --prompt TEXT ...`: a quick local check of a checkpoint. The model
// runtime needs LibTorch and the launcher must not link it, so `fmoe` execs `fmoe-generate`
// (gpu_worker/generate_main.cc) from its own directory with every argument after `generate`;
// that binary parses them and prints the text, the timings and its errors. Torch-free.
#pragma once

#include <string>
#include <vector>

namespace fmoe {

// Replaces this process with `<bin_dir>/fmoe-generate ARGS...`, its argv[0] `name` (what its
// help shows, e.g. "build/bin/fmoe generate"), and returns only on failure, with the exit code
// after printing why to stderr: 1 when this build has no model runtime (built without LibTorch)
// or the binary cannot be run.
int ExecGenerate(const std::string& bin_dir, const std::string& name,
                 const std::vector<std::string>& args);

}  // namespace fmoe
