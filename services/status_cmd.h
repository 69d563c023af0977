// `fmoe status MANIFEST`: reads the launcher's status file and probes each process: the router
// over HTTP (/health), the map service over its socket (admin Stats), and each worker through
// what those two report about it. Prints a table (or JSON) and returns 0 when all are healthy.
#pragma once

#include "common/manifest.h"

namespace fmoe {

int PrintStatus(const Manifest& manifest, bool json);

}  // namespace fmoe
