// A Hugging Face checkpoint directory's weights: one `model.safetensors`, or the shards listed
// by `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {tensor: file}}). Opens
// every file once, checks the index against the shards (each listed tensor present in the file
// the index names, no file outside the directory), and answers lookups by tensor name.
// Immutable after Open; safe to read from any thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/model/safetensors.h"
#include "common/status.h"

namespace fmoe {

class Checkpoint {
 public:
  // Called after each file is opened: (files done, files total, bytes mapped so far).
  using Progress = std::function<void(size_t, size_t, uint64_t)>;

  // A single model.safetensors wins over an index (as Hugging Face loads). Errors name the file
  // and the field: "model: /m/model.safetensors.index.json: weight_map:
  // \"model.norm.weight\" -> \"../x.safetensors\" leaves the model directory",
  // "model: /m: no model.safetensors or model.safetensors.index.json". kNotFound for a missing
  // directory, weights file or shard; kDataLoss for a malformed index or shard, a tensor the
  // index lists but its file lacks, or a tensor in two shards. Shards the index does not name
  // are not opened.
  static Result<std::unique_ptr<Checkpoint>> Open(const std::string& dir,
                                                  const Progress& progress = {});

  const std::string& dir() const { return dir_; }
  // nullptr when absent.
  const TensorView* Find(const std::string& name) const;
  // The tensor, checked: kNotFound "model: /m: tensor \"x\" is missing", kInvalidArgument
  // "model: /m/model.safetensors: tensor \"x\": shape [4, 8], expected [4, 16]". An empty
  // `shape` skips the shape check.
  Result<const TensorView*> Get(const std::string& name, const std::vector<int64_t>& shape) const;
  // The path of the file that holds `name` ("" when absent), for messages.
  std::string FileOf(const std::string& name) const;
  // Drops the resident mapped pages under bytes [offset, offset + bytes) of tensor `name` once
  // they have been copied out, so a load's peak memory is the loaded tensors, not them and the
  // mapped files too (SafetensorsFile::ReleasePages: the view stays valid, and reads back from
  // the file). kNotFound when absent; kInvalidArgument for a range outside the tensor; kIoError
  // "model: /m/model.safetensors: tensor \"x\": madvise..." when the kernel refuses.
  Status ReleasePages(const std::string& name, uint64_t offset, uint64_t bytes) const;
  // Where tensor `name`'s bytes are on disk: its file and the byte range in it. kNotFound when
  // absent.
  struct Location {
    std::string path;
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  Result<Location> Locate(const std::string& name) const;
  std::vector<std::string> TensorNames() const;
  uint64_t total_bytes() const;

 private:
  struct Entry {
    const TensorView* view;
    const SafetensorsFile* file;
  };
  Checkpoint() = default;
  Status AddFile(std::unique_ptr<SafetensorsFile> file);

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> tensors_;  // Every tensor of every file, by name.
};

}  // namespace fmoe
