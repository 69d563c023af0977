// Writes the non-weight files of the trained model directory: config.json (a complete HF
// MixtralConfig), tokenizer_config.json (specials, add_bos_token, a Jinja chat template) and
// MODEL_CARD.md (data, commands, training numbers, routing entropy, samples). Pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "tools/trainer/moe_model.h"
#include "tools/trainer/trainer.h"

namespace fmoe::trainer {

struct SpecialIds {
  int32_t bos = 1;
  int32_t eos = 2;
  int32_t pad = 3;
};

Status WriteHfConfig(const std::string& path, const MoeShape& shape, const SpecialIds& ids,
                     double aux_loss_coef);
Status WriteTokenizerConfig(const std::string& path, uint32_t model_max_length);
// `corpus_stats` is the text of corpus_stats.tsv ("" when absent); `model_bytes` the size of
// model.safetensors.
Status WriteModelCard(const std::string& path, const TrainOptions& options,
                      const TrainReport& report, const std::string& corpus_stats,
                      uint64_t model_bytes);

// "User: {content}\nAssistant: ..." as a Hugging Face Jinja chat template.
const char* ChatTemplate();

}  // namespace fmoe::trainer
