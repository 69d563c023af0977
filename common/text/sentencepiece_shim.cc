#include "common/text/sentencepiece_shim.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <sentencepiece_processor.h>

namespace {

static_assert(sizeof(int) == sizeof(int32_t), "SentencePiece ids are int");

void SetError(char* error, size_t error_size, std::string_view message) {
  if (error == nullptr || error_size == 0) return;
  size_t n = std::min(message.size(), error_size - 1);
  std::memcpy(error, message.data(), n);
  error[n] = '\0';
}

const sentencepiece::SentencePieceProcessor& Model(const void* model) {
  return *static_cast<const sentencepiece::SentencePieceProcessor*>(model);
}

void* Load(const char* path, char* error, size_t error_size) {
  try {
    auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
    sentencepiece::util::Status st = sp->Load(path);
    if (!st.ok()) {
      SetError(error, error_size, st.message());
      return nullptr;
    }
    return sp.release();
  } catch (const std::exception& e) {
    SetError(error, error_size, e.what());
  } catch (...) {
    SetError(error, error_size, "unknown exception in libsentencepiece");
  }
  return nullptr;
}

void Release(void* model) { delete static_cast<sentencepiece::SentencePieceProcessor*>(model); }

int32_t PieceSize(const void* model) { return Model(model).GetPieceSize(); }

const char* IdToPiece(const void* model, int32_t id, size_t* length) {
  const std::string& piece = Model(model).IdToPiece(id);
  *length = piece.size();
  return piece.data();
}

uint32_t PieceKind(const void* model, int32_t id) {
  const auto& sp = Model(model);
  return (sp.IsControl(id) ? kFmoeSpmControl : 0) | (sp.IsUnknown(id) ? kFmoeSpmUnknown : 0) |
         (sp.IsByte(id) ? kFmoeSpmByte : 0) | (sp.IsUnused(id) ? kFmoeSpmUnused : 0);
}

int32_t BosId(const void* model) { return Model(model).bos_id(); }
int32_t EosId(const void* model) { return Model(model).eos_id(); }

int Encode(const void* model, const char* text, size_t length, FmoeSpmSink sink, void* context,
           char* error, size_t error_size) {
  try {
    std::vector<int> ids;
    sentencepiece::util::Status st = Model(model).Encode(std::string_view(text, length), &ids);
    if (!st.ok()) {
      SetError(error, error_size, st.message());
      return -1;
    }
    sink(context, reinterpret_cast<const int32_t*>(ids.data()), ids.size());
    return 0;
  } catch (const std::exception& e) {
    SetError(error, error_size, e.what());
  } catch (...) {
    SetError(error, error_size, "unknown exception in libsentencepiece");
  }
  return -1;
}

constexpr FmoeSpmApi kApi = {kFmoeSpmApiVersion, Load,  Release, PieceSize, IdToPiece,
                             PieceKind,          BosId, EosId,   Encode};

}  // namespace

extern "C" __attribute__((visibility("default"))) const FmoeSpmApi* fmoe_spm_api() { return &kApi; }
