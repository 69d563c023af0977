// libFuzzer target for config.json (common/model/model_config.cc, the families' parsers and
// quantization_config, common/model/quant.cc): each input is a config.json's text, parsed as
// every process that reads a model parses it. Checked, besides ASan/UBSan/LeakSanitizer and
// exceptions escaping:
//   - a refused config has a non-empty message;
//   - an accepted one has 1 <= K <= J, L >= 1 MoE layers among its layers, a positive hidden size
//     and expert width, and, when quantized, a routed expert whose stored bytes are positive and
//     whose projections' shapes the format can store (QuantShapeError empty); DescribeModel runs;
//   - its quantization_config alone parses to the same format.
// A violation aborts with __builtin_trap. Seeds: tests/fuzz/make_config_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/model/quant.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  fmoe::Result<fmoe::ModelInfo> info = fmoe::ParseModelConfig(text, "/fuzz");
  if (!info.ok()) {
    if (info.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (info->top_k < 1 || info->top_k > info->num_experts || info->num_moe_layers < 1 ||
      info->num_moe_layers > info->num_hidden_layers || info->hidden_size < 1 ||
      info->intermediate_size < 1) {
    __builtin_trap();
  }
  if (info->quant.quantized()) {
    const int64_t h = info->hidden_size, inter = info->intermediate_size;
    if (fmoe::RoutedExpertBytes(*info) == 0 ||
        !fmoe::QuantShapeError(info->quant, inter, h).empty() ||
        !fmoe::QuantShapeError(info->quant, h, inter).empty()) {
      __builtin_trap();
    }
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    fmoe::QuantSpec again;
    if (j.is_discarded() ||
        !fmoe::ParseQuantizationConfig(j.at("quantization_config"), &again).ok() ||
        !(again == info->quant)) {
      __builtin_trap();
    }
  }
  if (fmoe::DescribeModel(*info).empty()) __builtin_trap();
  return 0;
}
