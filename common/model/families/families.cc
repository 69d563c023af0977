#include "common/model/families/family.h"

#include <string>

namespace fmoe {

std::span<const ModelFamily* const> AllModelFamilies() {
  static const ModelFamily* const kAll[] = {
      &MixtralFamily(),   &Qwen2MoeFamily(),   &Qwen3MoeFamily(),   &OlmoeFamily(),
      &PhimoeFamily(),    &DeepseekV2Family(), &DeepseekV3Family(), &Glm4MoeFamily(),
      &MinimaxM2Family(), &GptOssFamily(),
  };
  return kAll;
}

Result<const ModelFamily*> FindModelFamily(std::string_view architecture) {
  std::string list;
  for (const ModelFamily* f : AllModelFamilies()) {
    for (const char* name : f->architectures) {
      if (architecture == name) return f;
      list += (list.empty() ? "" : ", ") + std::string(name);
    }
  }
  return InvalidArgument("architectures: \"" + std::string(architecture) +
                         "\" is not a supported MoE architecture (" + list + ")");
}

}  // namespace fmoe
