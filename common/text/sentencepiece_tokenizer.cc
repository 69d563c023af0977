#include "common/text/sentencepiece_tokenizer.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/text/sentencepiece_shim.h"
#include "common/text/unicode.h"

#if defined(__SANITIZE_ADDRESS__)
#define FMOE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FMOE_ASAN 1
#endif
#endif

namespace fmoe {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581, SentencePiece's space.

std::string ReplaceSpaceSymbol(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  for (size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kSpaceSymbol.size()) == kSpaceSymbol) {
      out.push_back(' ');
      i += kSpaceSymbol.size();
    } else {
      out.push_back(piece[i++]);
    }
  }
  return out;
}

// "<0x41>" -> 0x41.
std::optional<char> BytePieceValue(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return std::nullopt;
  int v = 0;
  for (char c : piece.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      v |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      v |= c - 'a' + 10;
    } else {
      return std::nullopt;
    }
  }
  return static_cast<char>(v);
}

constexpr char kShimName[] = "libfmoe_sentencepiece.so";

// Opens libfmoe_sentencepiece.so once per process: next to the executable, else where the build
// put it. RTLD_LOCAL keeps libsentencepiece's protobuf copy out of the global scope, and
// RTLD_DEEPBIND makes it bind to itself even where LibTorch loaded the full libprotobuf
// (AddressSanitizer refuses RTLD_DEEPBIND; its builds hold no LibTorch).
Result<const FmoeSpmApi*> ShimApi() {
  static std::once_flag once;
  static const FmoeSpmApi* api = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    std::error_code ec;
    std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) candidates.push_back((exe.parent_path() / kShimName).string());
#ifdef FMOE_SENTENCEPIECE_SHIM
    candidates.push_back(FMOE_SENTENCEPIECE_SHIM);
#endif
    int flags = RTLD_NOW | RTLD_LOCAL;
#ifndef FMOE_ASAN
    flags |= RTLD_DEEPBIND;
#endif
    for (const std::string& path : candidates) {
      void* handle = dlopen(path.c_str(), flags);
      if (handle == nullptr) {
        const char* why = dlerror();
        failure += (failure.empty() ? "" : "; ") + std::string(why != nullptr ? why : path);
        continue;
      }
      auto fn = reinterpret_cast<FmoeSpmApiFn>(dlsym(handle, kFmoeSpmApiSymbol));
      const FmoeSpmApi* table = fn != nullptr ? fn() : nullptr;
      if (table == nullptr || table->version != kFmoeSpmApiVersion) {
        failure += (failure.empty() ? "" : "; ") + path + ": not a matching " + kShimName;
        continue;
      }
      api = table;  // The handle stays open for the life of the process.
      return;
    }
  });
  if (api == nullptr) return Unavailable("cannot open " + std::string(kShimName) + ": " + failure);
  return api;
}

}  // namespace

struct SentencePieceTokenizer::State {
  const FmoeSpmApi* api = nullptr;
  void* model = nullptr;
  ~State() {
    if (model != nullptr) api->release(model);
  }
  std::vector<std::string> pieces;
  std::vector<std::string> bytes;  // What Decode writes for each id.
  std::vector<bool> special;       // Control and unknown pieces.
  std::vector<bool> strippable;    // Normal pieces that start with U+2581.
  std::unordered_map<std::string, int32_t> ids;
  // Surface forms split out of the text before SentencePiece sees it, longest first.
  std::vector<std::pair<std::string, int32_t>> specials;
  std::array<bool, 256> special_first{};
  bool dummy_prefix = false;  // Decode drops the leading space of the first piece.
  std::optional<int32_t> bos, eos;
  bool add_bos = true;
  bool add_eos = false;
  std::string chat_template;

  // Appends SentencePiece's ids for `text`.
  Status Encode(std::string_view text, std::vector<int32_t>* out) const {
    char error[512] = {0};
    auto sink = [](void* context, const int32_t* ids, size_t count) {
      auto* v = static_cast<std::vector<int32_t>*>(context);
      v->insert(v->end(), ids, ids + count);
    };
    if (api->encode(model, text.data(), text.size(), sink, out, error, sizeof(error)) != 0) {
      return Internal(std::string("tokenizer: sentencepiece: ") + error);
    }
    return Status::Ok();
  }
};

SentencePieceTokenizer::SentencePieceTokenizer(std::unique_ptr<State> state)
    : state_(std::move(state)) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

Result<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    const std::string& path, const TokenizerConfig& config) {
  auto s = std::make_unique<State>();
  FMOE_ASSIGN_OR_RETURN(s->api, ShimApi());
  char error[512] = {0};
  s->model = s->api->load(path.c_str(), error, sizeof(error));
  if (s->model == nullptr) {
    return InvalidArgument(path + ": not a SentencePiece model: " + error);
  }
  const FmoeSpmApi& api = *s->api;
  int32_t n = api.piece_size(s->model);
  if (n <= 0) return InvalidArgument(path + ": the SentencePiece model has no pieces");
  s->pieces.resize(n);
  s->bytes.resize(n);
  s->special.assign(n, false);
  s->strippable.assign(n, false);
  for (int32_t id = 0; id < n; ++id) {
    size_t length = 0;
    const char* data = api.id_to_piece(s->model, id, &length);
    std::string piece(data, length);
    uint32_t kind = api.piece_kind(s->model, id);
    s->pieces[id] = piece;
    s->ids.emplace(piece, id);
    if ((kind & (kFmoeSpmControl | kFmoeSpmUnknown)) != 0) {
      s->special[id] = true;
      s->bytes[id] = piece;
      if (!piece.empty()) s->specials.emplace_back(piece, id);
    } else if (std::optional<char> b; (kind & kFmoeSpmByte) && (b = BytePieceValue(piece))) {
      s->bytes[id] = std::string(1, *b);
    } else {
      s->bytes[id] = ReplaceSpaceSymbol(piece);
      s->strippable[id] = std::string_view(piece).substr(0, kSpaceSymbol.size()) == kSpaceSymbol;
    }
  }
  std::sort(s->specials.begin(), s->specials.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (const auto& [surface, id] : s->specials) {
    s->special_first[static_cast<unsigned char>(surface[0])] = true;
  }
  // Whether the model adds a dummy prefix: then "a" encodes to a piece starting with U+2581.
  std::vector<int32_t> probe;
  if (s->Encode("a", &probe).ok() && !probe.empty() && probe[0] >= 0 && probe[0] < n) {
    s->dummy_prefix = s->strippable[probe[0]];
  }

  auto lookup = [&](const std::string& token, const char* field) -> Result<int32_t> {
    auto it = s->ids.find(token);
    if (it == s->ids.end()) {
      return InvalidArgument(std::string("tokenizer_config.json: ") + field + ": \"" + token +
                             "\" is not a piece of " + path);
    }
    return it->second;
  };
  if (config.bos_token) {
    FMOE_ASSIGN_OR_RETURN(s->bos, lookup(*config.bos_token, "bos_token"));
  } else if (api.bos_id(s->model) >= 0) {
    s->bos = api.bos_id(s->model);
  }
  if (config.eos_token) {
    FMOE_ASSIGN_OR_RETURN(s->eos, lookup(*config.eos_token, "eos_token"));
  } else if (api.eos_id(s->model) >= 0) {
    s->eos = api.eos_id(s->model);
  }
  s->add_bos = config.add_bos_token.value_or(true) && s->bos.has_value();
  s->add_eos = config.add_eos_token.value_or(false);
  if (config.add_bos_token.value_or(false) && !s->bos) {
    return InvalidArgument("tokenizer_config.json: add_bos_token: true but there is no BOS piece");
  }
  if (s->add_eos && !s->eos) {
    return InvalidArgument("tokenizer_config.json: add_eos_token: true but there is no EOS piece");
  }
  s->chat_template = config.chat_template;
  return std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer(std::move(s)));
}

Result<std::vector<int32_t>> SentencePieceTokenizer::Encode(std::string_view text,
                                                            bool add_special_tokens) const {
  size_t bad = FirstInvalidUtf8(text);
  if (bad != text.size()) {
    return InvalidArgument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  const State& s = *state_;
  std::vector<int32_t> out;
  if (add_special_tokens && s.add_bos) out.push_back(*s.bos);
  auto encode = [&](std::string_view stretch) -> Status {
    if (stretch.empty()) return Status::Ok();
    return s.Encode(stretch, &out);
  };
  size_t start = 0;
  for (size_t pos = 0; pos < text.size();) {
    int32_t found = -1;
    size_t len = 0;
    if (s.special_first[static_cast<unsigned char>(text[pos])]) {
      for (const auto& [surface, id] : s.specials) {
        if (text.substr(pos, surface.size()) == surface) {
          found = id;
          len = surface.size();
          break;
        }
      }
    }
    if (found < 0) {
      ++pos;
      continue;
    }
    FMOE_RETURN_IF_ERROR(encode(text.substr(start, pos - start)));
    out.push_back(found);
    pos += len;
    start = pos;
  }
  FMOE_RETURN_IF_ERROR(encode(text.substr(start)));
  if (add_special_tokens && s.add_eos) out.push_back(*s.eos);
  return out;
}

std::string SentencePieceTokenizer::Decode(std::span<const int32_t> ids,
                                           bool skip_special_tokens) const {
  const State& s = *state_;
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= s.bytes.size()) continue;
    if (skip_special_tokens && s.special[id]) continue;
    std::string_view piece = s.bytes[id];
    if (out.empty() && s.dummy_prefix && s.strippable[id]) piece.remove_prefix(1);
    out += piece;
  }
  return out;
}

size_t SentencePieceTokenizer::vocab_size() const { return state_->pieces.size(); }

std::optional<int32_t> SentencePieceTokenizer::TokenToId(std::string_view token) const {
  auto it = state_->ids.find(std::string(token));
  if (it == state_->ids.end()) return std::nullopt;
  return it->second;
}

std::string SentencePieceTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= state_->pieces.size()) return "";
  return state_->pieces[id];
}

bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < state_->special.size() && state_->special[id];
}

std::optional<int32_t> SentencePieceTokenizer::bos_id() const { return state_->bos; }
std::optional<int32_t> SentencePieceTokenizer::eos_id() const { return state_->eos; }
const std::string& SentencePieceTokenizer::chat_template() const { return state_->chat_template; }

}  // namespace fmoe
