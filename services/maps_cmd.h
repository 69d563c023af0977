// `fmoe maps MANIFEST [--export FILE | --import FILE | --drop MODEL] [--model FP] [--json]`: the
// map service's store from the command line, through its admin requests on the map service
// socket. Without an action it prints each model's store (maps, capacity, inserts,
// replacements), the store's state (degraded when its disk refuses writes) and the service's
// ingest and matching figures. Export writes a model's maps to FILE, import loads such a file
// (deduplicating into a full store), so a new replica starts warm. FILE is opened by the map
// service, on its host; a relative path is made absolute here. Drop removes a model (its maps,
// its record and its ranks' records) from disk and memory.
#pragma once

#include <string>

#include "common/manifest.h"

namespace fmoe {

struct MapsCommand {
  std::string export_path;
  std::string import_path;
  std::string drop;   // Fingerprint in hex of the model to remove.
  std::string model;  // Fingerprint in hex; empty = the only stored model.
  bool json = false;
  int timeout_ms = 60000;  // Export and import of a large store take a while.
};

// Returns 0 on success, 1 when the map service fails or does not answer, 2 on bad arguments.
int RunMaps(const Manifest& manifest, const MapsCommand& command);

}  // namespace fmoe
