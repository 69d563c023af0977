// quantization_config: every format the runtime keeps native, refusals naming the field and
// value, the stored tensors per projection and their bytes against DESIGN section 12's table.
#include "common/model/quant.h"

#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "common/json.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

QuantSpec Parsed(const std::string& text) {
  QuantSpec spec;
  const Status s = ParseQuantizationConfig(Json::parse(text), &spec);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return spec;
}

std::string Refused(const std::string& text) {
  QuantSpec spec;
  const Status s = ParseQuantizationConfig(Json::parse(text), &spec);
  EXPECT_FALSE(s.ok()) << text;
  return s.message();
}

// Kimi-K2-Thinking's quantization_config (the keys that matter).
constexpr const char* kKimiInt4 = R"({"quant_method": "compressed-tensors",
  "format": "pack-quantized", "quantization_status": "compressed", "kv_cache_scheme": null,
  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
  "config_groups": {"group_0": {"input_activations": null, "output_activations": null,
    "targets": ["Linear"], "weights": {"actorder": null, "block_structure": null,
    "dynamic": false, "group_size": 32, "num_bits": 4, "observer": "minmax",
    "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "int"}}}})";

// llm-compressor's FP8_DYNAMIC scheme.
constexpr const char* kFp8Dynamic = R"({"quant_method": "compressed-tensors",
  "format": "float-quantized", "quantization_status": "compressed",
  "config_groups": {"group_0": {"targets": ["Linear"],
    "input_activations": {"dynamic": true, "num_bits": 8, "strategy": "token",
      "symmetric": true, "type": "float"},
    "weights": {"dynamic": false, "num_bits": 8, "observer": "minmax", "strategy": "channel",
      "symmetric": true, "type": "float"}}}})";

TEST(Quant, ReadsEveryFormat) {
  QuantSpec fp8 = Parsed(
      R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": [128, 128]})");
  EXPECT_EQ(fp8.method, QuantMethod::kFp8Block);
  EXPECT_EQ(fp8.block_out, 128u);
  EXPECT_EQ(fp8.block_in, 128u);
  EXPECT_EQ(fp8.Describe(), "fp8 e4m3 block 128x128");

  QuantSpec kimi = Parsed(kKimiInt4);
  EXPECT_EQ(kimi.method, QuantMethod::kInt4Packed);
  EXPECT_EQ(kimi.group_size, 32u);
  EXPECT_TRUE(kimi.symmetric);
  EXPECT_FALSE(kimi.act_order);

  Json asym = Json::parse(kKimiInt4);
  asym["config_groups"]["group_0"]["weights"]["symmetric"] = false;
  asym["config_groups"]["group_0"]["weights"]["group_size"] = 128;
  asym["config_groups"]["group_0"]["weights"]["actorder"] = "group";
  QuantSpec a = Parsed(asym.dump());
  EXPECT_FALSE(a.symmetric);
  EXPECT_TRUE(a.act_order);
  EXPECT_EQ(a.group_size, 128u);

  EXPECT_EQ(Parsed(kFp8Dynamic).method, QuantMethod::kFp8Channel);

  QuantSpec gptq = Parsed(
      R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": true,
          "sym": false, "damp_percent": 0.01, "true_sequential": true})");
  EXPECT_EQ(gptq.method, QuantMethod::kGptq);
  EXPECT_TRUE(gptq.act_order);
  EXPECT_FALSE(gptq.symmetric);
  EXPECT_FALSE(gptq.gptq_v2);

  QuantSpec awq = Parsed(
      R"({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
          "version": "GEMM", "modules_to_not_convert": null})");
  EXPECT_EQ(awq.method, QuantMethod::kAwq);
  EXPECT_EQ(awq.group_size, 128u);
}

TEST(Quant, RefusesWhatItDoesNotImplementNamingTheField) {
  EXPECT_NE(Refused(R"({"quant_method": "bitsandbytes"})")
                .find("quantization_config.quant_method: \"bitsandbytes\" is not implemented"),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})")
                .find("quantization_config.fmt: \"e5m2\""),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "fp8"})").find("weight_block_size: null is required"),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "fp8", "weight_block_size": [128]})")
                .find("weight_block_size: [128]"),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "gptq", "bits": 3, "group_size": 128})")
                .find("quantization_config.bits: 3 is not implemented (4 is)"),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "gptq", "bits": 4, "group_size": -1})")
                .find("group_size: -1 (one group per row) is not implemented"),
            std::string::npos);
  EXPECT_NE(Refused(R"({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})")
                .find("quantization_config.version: \"gemv\""),
            std::string::npos);
  Json j = Json::parse(kKimiInt4);
  j["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  EXPECT_NE(Refused(j.dump()).find("config_groups.group_0.weights.num_bits: 8"), std::string::npos);
  j = Json::parse(kKimiInt4);
  j["config_groups"]["group_1"] = j["config_groups"]["group_0"];
  EXPECT_NE(Refused(j.dump()).find("quantization_config.config_groups"), std::string::npos);
  j = Json::parse(kKimiInt4);
  j["format"] = "marlin-24";
  EXPECT_NE(Refused(j.dump()).find("quantization_config.format: \"marlin-24\""), std::string::npos);
  j = Json::parse(kFp8Dynamic);
  j["config_groups"]["group_0"]["input_activations"]["dynamic"] = false;
  EXPECT_NE(Refused(j.dump()).find("input_activations"), std::string::npos);
  EXPECT_NE(Refused(R"([1, 2])").find("quantization_config: [1,2] is not an object"),
            std::string::npos);
}

double ExpertMiB(const QuantSpec& spec, int64_t hidden, int64_t inter) {
  const uint64_t bytes =
      2 * QuantProjectionBytes(spec, inter, hidden) + QuantProjectionBytes(spec, hidden, inter);
  return static_cast<double>(bytes) / (1 << 20);
}

// DESIGN section 12: bytes per routed expert, computed from the shapes.
TEST(Quant, BytesPerExpertMatchTheDesignTable) {
  QuantSpec bf16;
  QuantSpec fp8{.method = QuantMethod::kFp8Block, .block_out = 128, .block_in = 128};
  QuantSpec gptq{.method = QuantMethod::kGptq, .group_size = 128};
  QuantSpec ct{.method = QuantMethod::kInt4Packed, .group_size = 128};
  QuantSpec kimi{.method = QuantMethod::kInt4Packed, .group_size = 32};
  struct Row {
    int64_t hidden, inter;
    double bf16, fp8, gptq, ct;
  } rows[] = {{4096, 14336, 336, 168, 87.4, 86.6},  // Mixtral-8x7B
              {7168, 2048, 84, 42.0, 21.9, 21.7},   // DeepSeek-V3
              {2048, 768, 9.0, 4.50, 2.36, 2.32}};  // Qwen3-30B-A3B
  for (const Row& r : rows) {
    EXPECT_NEAR(ExpertMiB(bf16, r.hidden, r.inter), r.bf16, 0.05) << r.hidden;
    EXPECT_NEAR(ExpertMiB(fp8, r.hidden, r.inter), r.fp8, 0.05) << r.hidden;
    EXPECT_NEAR(ExpertMiB(gptq, r.hidden, r.inter), r.gptq, 0.05) << r.hidden;
    EXPECT_NEAR(ExpertMiB(ct, r.hidden, r.inter), r.ct, 0.05) << r.hidden;
  }
  EXPECT_NEAR(ExpertMiB(kimi, 7168, 2048), 23.6, 0.05);  // Kimi-K2 INT4 g32.
}

TEST(Quant, TensorsPerProjection) {
  QuantSpec fp8{.method = QuantMethod::kFp8Block, .block_out = 128, .block_in = 128};
  auto t = QuantTensorsOf(fp8, 300, 200);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].suffix, "weight");
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{300, 200}));
  EXPECT_EQ(t[1].suffix, "weight_scale_inv");
  EXPECT_EQ(t[1].shape, (std::vector<int64_t>{3, 2}));  // Partial blocks round up.

  QuantSpec asym{
      .method = QuantMethod::kInt4Packed, .group_size = 32, .symmetric = false, .act_order = true};
  t = QuantTensorsOf(asym, 20, 64);
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].shape, (std::vector<int64_t>{20, 8}));
  EXPECT_EQ(t[1].shape, (std::vector<int64_t>{20, 2}));
  EXPECT_EQ(t[2].suffix, "weight_zero_point");
  EXPECT_EQ(t[2].shape, (std::vector<int64_t>{3, 2}));  // Packed along the rows.
  EXPECT_EQ(t[3].suffix, "weight_g_idx");

  QuantSpec awq{.method = QuantMethod::kAwq, .group_size = 32};
  EXPECT_EQ(QuantShapeError(awq, 64, 48),
            "[64, 48]: input size is not a multiple of the group size 32");
  EXPECT_EQ(QuantShapeError(awq, 60, 64), "[60, 64]: sizes are not multiples of 8 (int4 packing)");
  EXPECT_EQ(QuantShapeError(awq, 64, 64), "");
}

TEST(Quant, DecodesFp8E4m3) {
  EXPECT_EQ(Fp8E4m3ToFloat(0x00), 0.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);  // e=7, m=0.
  EXPECT_EQ(Fp8E4m3ToFloat(0xb8), -1.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);        // The largest finite value.
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), 0.001953125f);  // The smallest subnormal, 2^-9.
  EXPECT_EQ(Fp8E4m3ToFloat(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0xff)));
}

}  // namespace
}  // namespace fmoe
