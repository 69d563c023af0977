// The common start of every service binary: install the stop-signal thread, load the manifest,
// set up logging under the process's name. Errors are printed as one line on stderr.
#pragma once

#include <string>

#include "common/manifest.h"

namespace fmoe {

// Returns 0 and fills *manifest, or the exit code to return from main(): 2 for a bad manifest
// or log level. `binary` prefixes error lines ("fmoe-router"); `log_name` names the logger.
int SetUpService(const std::string& binary, const std::string& manifest_path,
                 const std::string& log_name, Manifest* manifest);

}  // namespace fmoe
