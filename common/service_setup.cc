#include "common/service_setup.h"

#include <cstdio>

#include "common/log.h"
#include "common/process_util.h"

namespace fmoe {

int SetUpService(const std::string& binary, const std::string& manifest_path,
                 const std::string& log_name, Manifest* manifest) {
  StopSignals::Install();
  auto loaded = LoadManifest(manifest_path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s: %s\n", binary.c_str(), loaded.status().message().c_str());
    return 2;
  }
  *manifest = std::move(*loaded);
  if (Status s = InitLogging(log_name, manifest->logging.level); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", binary.c_str(), s.message().c_str());
    return 2;
  }
  return 0;
}

}  // namespace fmoe
