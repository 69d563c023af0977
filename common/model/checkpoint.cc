#include "common/model/checkpoint.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string Quote(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  out.append(s);
  out.push_back('"');
  return out;
}

// A shard named by the index must be a plain file name inside the model directory.
bool StaysInDirectory(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Reads the index: tensor name -> shard file name, each file name checked.
Result<std::map<std::string, std::string>> ReadIndex(const fs::path& index_path) {
  const std::string where = "model: " + index_path.string();
  std::ifstream in(index_path, std::ios::binary);
  if (!in) return IoError(where + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError(where + ": cannot read");
  const Json index = Json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded()) return DataLoss(where + ": not valid JSON");
  if (!index.is_object()) return DataLoss(where + ": not a JSON object");
  auto map_it = index.find("weight_map");
  if (map_it == index.end()) return DataLoss(where + ": weight_map: missing");
  if (!map_it->is_object()) return DataLoss(where + ": weight_map: not an object");
  if (map_it->empty()) return DataLoss(where + ": weight_map: empty");
  std::map<std::string, std::string> weight_map;
  for (const auto& [tensor, file] : map_it->items()) {
    if (!file.is_string()) {
      return DataLoss(where + ": weight_map: " + Quote(tensor) + ": not a file name");
    }
    const std::string& name = file.get_ref<const std::string&>();
    if (!StaysInDirectory(name)) {
      return DataLoss(where + ": weight_map: " + Quote(tensor) + " -> " + Quote(name) +
                      " leaves the model directory");
    }
    weight_map[tensor] = name;
  }
  return weight_map;
}

}  // namespace

Status Checkpoint::AddFile(std::unique_ptr<SafetensorsFile> file) {
  for (const TensorView& view : file->tensors()) {
    auto [it, inserted] = tensors_.emplace(view.name, Entry{&view, file.get()});
    if (!inserted) {
      return DataLoss("model: " + dir_ + ": tensor " + Quote(view.name) + " is in both " +
                      it->second.file->path() + " and " + file->path());
    }
  }
  files_.push_back(std::move(file));
  return Status::Ok();
}

Result<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir,
                                                     const Progress& progress) {
  std::error_code ec;
  const fs::path root = fs::absolute(dir, ec).lexically_normal();
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  ckpt->dir_ = root.string();
  // lexically_normal keeps a trailing separator ("/m/"); drop it so messages read "/m: ...".
  if (ckpt->dir_.size() > 1 && ckpt->dir_.back() == '/') ckpt->dir_.pop_back();
  if (ec || !fs::is_directory(root, ec)) {
    return NotFound("model: " + ckpt->dir_ + ": no such directory");
  }

  uint64_t bytes = 0;
  // As Hugging Face does, a single model.safetensors wins over an index.
  if (fs::exists(root / kSingleFile, ec)) {
    auto file = SafetensorsFile::Open((root / kSingleFile).string());
    if (!file.ok()) return file.status().WithContext("model");
    bytes += (*file)->file_bytes();
    FMOE_RETURN_IF_ERROR(ckpt->AddFile(std::move(file).value()));
    if (progress) progress(1, 1, bytes);
    return ckpt;
  }
  const fs::path index_path = root / kIndexFile;
  if (!fs::exists(index_path, ec)) {
    return NotFound("model: " + ckpt->dir_ + ": no " + kSingleFile + " or " + kIndexFile);
  }
  FMOE_ASSIGN_OR_RETURN(auto weight_map, ReadIndex(index_path));

  // Open each shard once, in name order; shards the index does not name are ignored.
  std::map<std::string, std::string> first_tensor;  // shard -> a tensor naming it, for messages.
  for (const auto& [tensor, shard] : weight_map) first_tensor.emplace(shard, tensor);
  const std::string where = "model: " + index_path.string() + ": weight_map: ";
  size_t done = 0;
  for (const auto& [shard, tensor] : first_tensor) {
    auto file = SafetensorsFile::Open((root / shard).string());
    if (!file.ok()) {
      return file.status().WithContext(where + Quote(tensor) + " -> " + Quote(shard));
    }
    bytes += (*file)->file_bytes();
    FMOE_RETURN_IF_ERROR(ckpt->AddFile(std::move(file).value()));
    if (progress) progress(++done, first_tensor.size(), bytes);
  }
  for (const auto& [tensor, shard] : weight_map) {
    const std::string file = (root / shard).string();
    auto it = ckpt->tensors_.find(tensor);
    if (it == ckpt->tensors_.end() || it->second.file->path() != file) {
      return DataLoss(where + Quote(tensor) + " -> " + Quote(shard) + ": " + shard +
                      " has no tensor " + Quote(tensor));
    }
  }
  return ckpt;
}

const TensorView* Checkpoint::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.view;
}

Result<const TensorView*> Checkpoint::Get(const std::string& name,
                                          const std::vector<int64_t>& shape) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return NotFound("model: " + dir_ + ": tensor " + Quote(name) + " is missing");
  }
  const TensorView* view = it->second.view;
  if (!shape.empty() && view->shape != shape) {
    return InvalidArgument("model: " + it->second.file->path() + ": tensor " + Quote(name) +
                           ": shape " + ShapeString(view->shape) + ", expected " +
                           ShapeString(shape));
  }
  return view;
}

std::string Checkpoint::FileOf(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? std::string() : it->second.file->path();
}

Status Checkpoint::ReleasePages(const std::string& name, uint64_t offset, uint64_t bytes) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return NotFound("model: " + dir_ + ": tensor " + Quote(name) + " is missing");
  }
  return it->second.file->ReleasePages(*it->second.view, offset, bytes).WithContext("model");
}

Result<Checkpoint::Location> Checkpoint::Locate(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return NotFound("model: " + dir_ + ": tensor " + Quote(name) + " is missing");
  }
  FMOE_ASSIGN_OR_RETURN(const uint64_t offset, it->second.file->FileOffset(*it->second.view));
  return Location{it->second.file->path(), offset, it->second.view->data.size()};
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, entry] : tensors_) names.push_back(name);
  return names;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->file_bytes();
  return total;
}

}  // namespace fmoe
