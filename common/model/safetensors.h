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

// kF8E4M3: FP8 e4m3fn ("F8_E4M3"), the weights of FP8 checkpoints, kept as bytes.
enum class DType : uint8_t { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E4M3 };

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

  // Drops this process's copies of the mapped pages under bytes [offset, offset + bytes) of
  // `tensor`'s data (one of this file's views, once those bytes have been copied out), so they
  // stop counting in the resident set (madvise MADV_DONTNEED). The mapping stays valid: a
  // released page read again is read back from the file, through the page cache, which this
  // leaves alone (another process loading the same file still finds it there). Whole pages go:
  // one shared with neighbouring bytes is read back when they are read. Safe from any thread,
  // while others read the file. kInvalidArgument for a range outside the tensor or a view not in
  // this file's mapping; kIoError when madvise fails. Errors name the file and the tensor.
  Status ReleasePages(const TensorView& tensor, uint64_t offset, uint64_t bytes) const;
  // Where `tensor`'s data (one of this file's views) starts in the file, for reading it without
  // the mapping. kInvalidArgument for a view not in this file.
  Result<uint64_t> FileOffset(const TensorView& tensor) const;

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

// One tensor's name, dtype and shape, for the streaming writer.
struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// Writes a safetensors file whose data arrives piece by piece, so a multi-gigabyte shard is never
// held in memory. Create checks the tensors (the same rules and messages as WriteSafetensors),
// creates a temporary file beside `path` and writes the header; Append takes the data bytes of
// the tensors in the order given, in pieces of any size; Finish checks that every byte came,
// fsyncs, renames the file into place and fsyncs the directory. Until Finish succeeds nothing
// exists at `path`: a writer destroyed earlier, or after an error, removes its temporary file.
// One thread at a time.
class SafetensorsWriter {
 public:
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // kInvalidArgument for a repeated or reserved ("__metadata__") name, a name or metadata that is
  // not UTF-8, or a negative or overflowing shape; kIoError when the temporary file cannot be
  // created or written.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::span<const TensorSpec> tensors,
      const std::map<std::string, std::string>& metadata = {});

  // kInvalidArgument when `data` runs past the last tensor's end; kIoError when the write fails.
  // After an error the writer is spent: every later call returns kFailedPrecondition.
  Status Append(std::span<const std::byte> data);
  // kInvalidArgument when bytes are still missing (the temporary file is removed); kIoError when
  // fsync or rename fails.
  Status Finish();

  const std::string& path() const { return path_; }
  uint64_t data_bytes() const { return data_bytes_; }  // The tensors' bytes together.
  uint64_t appended_bytes() const { return appended_; }
  uint64_t file_bytes() const { return data_start_ + data_bytes_; }

 private:
  SafetensorsWriter() = default;
  Status Fail(Status s);

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  uint64_t data_start_ = 0;  // 8 + header length.
  uint64_t data_bytes_ = 0;
  uint64_t appended_ = 0;
  bool spent_ = false;  // Finished, or failed.
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
