// POST /tokenize and POST /detokenize, in vLLM's shapes. /tokenize takes a completion's
// {"prompt": "...", "add_special_tokens": true} or a chat's {"messages": [...],
// "add_generation_prompt": true} (rendered through the model's chat template) and answers
// {"count", "max_model_len", "tokens", "token_strs"}; /detokenize takes {"tokens": [...]} and
// answers {"prompt": "..."}, ill-formed UTF-8 replaced by U+FFFD. "model", when given, must be
// the served model. GET /tokenizer_info answers vLLM's summary of the tokenizer: its bos, eos
// and pad tokens' texts (null when it has none), model_max_length (the served context) and the
// chat template, which lm-evaluation-harness's remote tokenizer reads. Stateless and
// thread-safe.
#pragma once

#include "common/text/tokenizer.h"
#include "router/completion_request.h"
#include "router/http_server.h"

namespace fmoe {

HttpResponse Tokenize(const std::string& body, const CompletionsOptions& options,
                      const Tokenizer& tokenizer);
HttpResponse Detokenize(const std::string& body, const CompletionsOptions& options,
                        const Tokenizer& tokenizer);
HttpResponse TokenizerInfo(const CompletionsOptions& options, const Tokenizer& tokenizer);

}  // namespace fmoe
