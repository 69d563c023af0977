// DiskReader (DESIGN section 13): reads byte ranges of checkpoint files straight from disk,
// several reads in flight, for the host tier (host_tier.h). Files are opened with O_DIRECT, so
// an expert read from its shard does not pass through the page cache (and is not kept there a
// second time); a file system that refuses O_DIRECT (tmpfs, some network file systems) is read
// through the page cache instead, and the reader says so once per file in the log. Backends:
// io_uring through liburing where the build has it and the kernel allows it, else a pool of
// threads calling pread. A read of any offset, length and destination alignment is split into
// chunks of chunk_bytes read at 4096-aligned offsets into the reader's own aligned buffers and
// copied out, so callers need no alignment.
//
// Threads: AddFile before the first Submit, from one thread; Submit, Poll and Wait from one
// thread (the owner's, the engine thread); the backend's threads do the reads, and a finishing
// thread (started by the first read with a `then`) runs what a read asks to be done with its
// bytes before it comes back. Finished reads come back through Poll/Wait, never as callbacks.
//
// Order: urgent reads first (FIFO among them), then the others (FIFO); a read already started
// is not preempted (its chunks are queued together).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct DiskReaderOptions {
  // Chunks in flight at once (the device's queue depth). 1..256. Default: 8
  uint32_t queue_depth = 8;
  // Bytes per chunk: a multiple of 4096, 4096..64 MiB. Default: 1 MiB
  size_t chunk_bytes = size_t{1} << 20;
  // Open files with O_DIRECT where the file system allows it. Default: on
  bool direct = true;
  // "auto" (io_uring when available, else threads), "io_uring" (kFailedPrecondition when the
  // build or the kernel lacks it) or "threads". Default: auto
  std::string backend = "auto";
};

struct ReadDone {
  uint64_t id = 0;
  // kDataLoss "DISK_FILE: bytes [A, B): the file ends at C" for a short read (a truncated
  // file), kIoError "DISK_FILE: bytes [A, B): pread: <strerror>" for an error from the kernel.
  Status status;
  int64_t submit_ns = 0;  // Steady clock (ns): Submit, first chunk started, last chunk done.
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

struct DiskReaderStats {
  uint64_t reads = 0;       // Finished Submit calls, failed ones included.
  uint64_t failed = 0;      // Of which failed.
  uint64_t bytes_read = 0;  // Bytes delivered to callers.
  uint64_t chunks = 0;      // Chunk reads issued to the kernel.
  int64_t busy_ns = 0;      // Time with at least one chunk in flight.
};

class DiskReader {
 public:
  static Result<std::unique_ptr<DiskReader>> Create(const DiskReaderOptions& options);
  virtual ~DiskReader() = default;

  // "io_uring" or "threads".
  virtual std::string_view backend() const = 0;
  // Opens `path` for reading and returns its index for Submit. kNotFound / kIoError naming the
  // path. Whether it is read with O_DIRECT is logged when it is not.
  virtual Result<uint32_t> AddFile(const std::string& path) = 0;
  // Whether file `file` is read with O_DIRECT.
  virtual bool direct(uint32_t file) const = 0;
  // Reads bytes [offset, offset + bytes) of file `file` into `dst` (which must stay valid until
  // the read comes back). `id` is the caller's, unique among unfinished reads. A file index out
  // of range or a zero length comes back at once as a failed read (kInvalidArgument).
  // `then`, when given, runs after the bytes are in `dst` and before the read comes back (its
  // time counts in end_ns), on the reader's finishing thread: one thread for every read's
  // `then`, in the order the reads end, never the caller's nor a reading one, so the disk goes
  // on meanwhile. A failed read skips it. It must not throw.
  virtual void Submit(uint64_t id, uint32_t file, uint64_t offset, size_t bytes, void* dst,
                      bool urgent, std::function<void()> then) = 0;
  void Submit(uint64_t id, uint32_t file, uint64_t offset, size_t bytes, void* dst, bool urgent) {
    Submit(id, file, offset, bytes, dst, urgent, nullptr);
  }
  // Appends finished reads to `out` without blocking; returns how many.
  virtual size_t Poll(std::vector<ReadDone>* out) = 0;
  // Blocks until a read finishes or `timeout` passes; appends every finished read; returns how
  // many. Returns 0 at once when nothing is submitted and unfinished.
  virtual size_t Wait(std::vector<ReadDone>* out, std::chrono::milliseconds timeout) = 0;
  // Reads submitted and not yet returned by Poll/Wait.
  virtual size_t pending() const = 0;
  virtual DiskReaderStats stats() const = 0;
};

}  // namespace fmoe
