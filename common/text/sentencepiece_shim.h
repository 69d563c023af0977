// A C table over libsentencepiece, built as its own shared library (libfmoe_sentencepiece.so,
// sentencepiece_shim.cc is the only file that includes sentencepiece_processor.h) and opened
// with dlopen by SentencePieceTokenizer. Why: Debian's libsentencepiece exports its own copy of
// protobuf-lite 3.14; linked into a process that also loads the full libprotobuf (LibTorch
// does), one of the two binds to the other's symbols and aborts (before main, or at the first
// model load). Opened RTLD_LOCAL (and RTLD_DEEPBIND outside ASan builds), its symbols stay out
// of the process's global scope and bind to themselves. Only C types cross this boundary; no
// exception leaves it. Every function is safe from any thread on a loaded model.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

inline constexpr uint32_t kFmoeSpmApiVersion = 1;
inline constexpr char kFmoeSpmApiSymbol[] = "fmoe_spm_api";

// piece_kind bits.
inline constexpr uint32_t kFmoeSpmControl = 1;
inline constexpr uint32_t kFmoeSpmUnknown = 2;
inline constexpr uint32_t kFmoeSpmByte = 4;
inline constexpr uint32_t kFmoeSpmUnused = 8;

typedef void (*FmoeSpmSink)(void* context, const int32_t* ids, size_t count);

struct FmoeSpmApi {
  uint32_t version;  // kFmoeSpmApiVersion.
  // A loaded model, or null with the reason in `error` (NUL-terminated, truncated to fit).
  void* (*load)(const char* path, char* error, size_t error_size);
  void (*release)(void* model);
  int32_t (*piece_size)(const void* model);
  // The piece of `id` (0 <= id < piece_size), valid until release.
  const char* (*id_to_piece)(const void* model, int32_t id, size_t* length);
  uint32_t (*piece_kind)(const void* model, int32_t id);
  int32_t (*bos_id)(const void* model);  // -1 when the model has none.
  int32_t (*eos_id)(const void* model);
  // Encodes UTF-8 text and hands the ids to sink(context, ids, count) once. 0 on success, else
  // -1 with the reason in `error`.
  int (*encode)(const void* model, const char* text, size_t length, FmoeSpmSink sink, void* context,
                char* error, size_t error_size);
};

// The one exported symbol of libfmoe_sentencepiece.so.
typedef const FmoeSpmApi* (*FmoeSpmApiFn)();
}
