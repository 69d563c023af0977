// The map export file (schemas/export.fbs, identifier "FMEX"): a model's shape and its stored
// maps in row order, written by the Export admin request and read by Import. With store_db.cc
// the only code that touches the store's FlatBuffers types. Stateless functions; the map
// service calls them on its store writer thread. A `stop` requested meanwhile ends a long read
// or write early with kUnavailable ("... cancelled: the map service is stopping"), leaving no
// file behind.
#pragma once

#include <cstdint>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "common/status.h"
#include "map_service/store_db.h"

namespace fmoe {

struct MapExportContents {
  ModelRow shape;            // first_seen_unix_ms is not in the file: 0.
  std::vector<MapRow> maps;  // In file (row) order; only maps of the shape, all values finite.
  uint64_t skipped = 0;      // Maps of another shape or with a non-finite value.
};

// Builds an export file map by map, in any order: the file lists them by row, then id. The maps
// are copied once, into the file's bytes (no FlatBuffers type leaves this file).
class MapExportBuilder {
 public:
  // `expected_maps` sizes the buffer once (0: it grows as maps come).
  MapExportBuilder(const ModelRow& shape, size_t expected_maps);
  ~MapExportBuilder();
  MapExportBuilder(const MapExportBuilder&) = delete;
  MapExportBuilder& operator=(const MapExportBuilder&) = delete;

  void Add(const MapView& map);
  size_t maps() const;
  // Writes the file to `path` (absolute) through `path`.tmp renamed over it, so a reader never
  // sees half a file; returns its size in bytes. kResourceExhausted when the maps do not fit in
  // one FlatBuffer (2 GiB). Once only.
  Result<uint64_t> Write(const std::string& path, std::stop_token stop = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The same for maps at hand (tests, benchmarks).
Result<uint64_t> WriteMapExport(const std::string& path, const ModelRow& shape,
                                const std::vector<MapRow>& maps, std::stop_token stop = {});

// Reads an export file: kNotFound when it is missing or not a regular file, kInvalidArgument
// when it is larger than `max_bytes`, not an export (identifier), damaged (verifier), of another
// model than `fingerprint` (0: any) or of an invalid shape (L, J, h or K of 0, or K > J). Each
// message names the path.
Result<MapExportContents> ReadMapExport(const std::string& path, uint64_t max_bytes,
                                        uint64_t fingerprint, std::stop_token stop = {});

}  // namespace fmoe
