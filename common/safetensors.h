// Safetensors files (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {str: str}}, then the data section. Parsed by us, every field bounds-checked,
// the data mmapped read-only. Torch-free: the model runtime turns views into tensors.
// SafetensorsFile is immutable after Open and safe to read from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

enum class DType : uint8_t { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

// "F32", "F16", "BF16", ... as safetensors spells them.
const char* DTypeName(DType dtype);
size_t DTypeSize(DType dtype);

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;  // Points into the mapped file; valid while the file lives.
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  // Maps and validates `path`. Errors name the file and the tensor or field, e.g.
  //   "/m/model.safetensors: tensor \"lm_head.weight\": data_offsets [0, 96] do not match
  //    dtype F32 and shape [4, 8] (128 bytes)"
  // kNotFound / kIoError for a missing or unreadable file, kDataLoss for anything malformed:
  // truncated, header length out of range, JSON not an object, unknown dtype, negative or
  // overflowing shape, offsets outside the data section or overlapping, data section not
  // covered exactly. Also refused: a header that does not start with '{' or repeats a key in
  // one object (JSON readers disagree on which copy wins). Trailing spaces after the JSON are
  // the format's padding. The file must not be truncated while it is open (the mapping would
  // fault).
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensors sorted by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  uint64_t file_bytes_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write. `data` must hold exactly numel * DTypeSize(dtype) bytes.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> data;
};

// Writes a safetensors file atomically (temporary file beside it, fsync, rename, fsync of the
// directory). Tensors are laid out in the order given; the header is padded with spaces so the
// data starts 8-byte aligned. kInvalidArgument for a tensor whose data does not match its dtype
// and shape, a repeated or reserved ("__metadata__") name, or a name that is not UTF-8;
// kIoError when the file cannot be written.
Status WriteSafetensors(const std::string& path, std::span<const TensorToWrite> tensors,
                        const std::map<std::string, std::string>& metadata = {});

// "[4, 8]", for messages.
std::string ShapeString(const std::vector<int64_t>& shape);

// Converts F32/F16/BF16 data (little-endian, as stored) to float32, exactly: out.size()
// elements from data.size() == out.size() * DTypeSize(dtype) bytes. kInvalidArgument for other
// dtypes or a size mismatch.
Status ConvertToF32(DType dtype, std::span<const std::byte> data, std::span<float> out);
// Rounds float32 to bfloat16 / float16 (round to nearest even), for writers.
uint16_t F32ToBF16(float value);
uint16_t F32ToF16(float value);

}  // namespace fmoe
