// Quantized projections (DESIGN section 12) against tests/fixtures/quant-kernels: each case is
// one projection stored by a format as the reference libraries write it (compressed-tensors' own
// packing, GPTQ's and AWQ's published layouts, FP8 block and channel scales), with its reference
// dequantization in float32. The loader keeps the stored tensors; the dequantization gives the
// reference exactly, in float32 and rounded to bfloat16; a dense weight in the format loads
// dequantized; a corrupted scale, zero point or group index is a load error naming the tensor.
#include "gpu_worker/experts/quantized.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/checkpoint.h"
#include "common/model/safetensors.h"
#include "gpu_worker/model/tensor_loader.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kDir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/quant-kernels";

struct Case {
  std::string name;
  QuantSpec spec;
  int64_t out, in;
};

std::vector<Case> Cases() {
  std::ifstream in(kDir + "/cases.json");
  const Json j = Json::parse(in);
  std::vector<Case> out;
  for (const Json& c : j) {
    Case k{c["name"].get<std::string>(), {}, c["out"].get<int64_t>(), c["in"].get<int64_t>()};
    const Status s = ParseQuantizationConfig(c["quantization_config"], &k.spec);
    EXPECT_TRUE(s.ok()) << k.name << ": " << s.ToString();
    out.push_back(std::move(k));
  }
  return out;
}

class QuantizedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-quantized-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The kernel fixture as a checkpoint directory.
  std::unique_ptr<Checkpoint> Fixture() {
    fs::create_symlink(kDir + "/kernels.safetensors", dir_ / "model.safetensors");
    auto ckpt = Checkpoint::Open(dir_.string());
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    return ckpt.ok() ? std::move(*ckpt) : nullptr;
  }

  // The fixture rewritten with `edit` applied to one tensor (its name, dtype, shape, bytes).
  std::unique_ptr<Checkpoint> Edited(
      const std::string& target,
      const std::function<void(TensorToWrite*, std::vector<std::byte>*)>& edit) {
    auto file = SafetensorsFile::Open(kDir + "/kernels.safetensors");
    EXPECT_TRUE(file.ok());
    std::vector<std::vector<std::byte>> storage;
    storage.reserve((*file)->tensors().size());
    std::vector<TensorToWrite> tensors;
    for (const TensorView& v : (*file)->tensors()) {
      storage.emplace_back(v.data.begin(), v.data.end());
      TensorToWrite t{v.name, v.dtype, v.shape, {}};
      if (v.name == target) edit(&t, &storage.back());
      t.data = storage.back();
      tensors.push_back(std::move(t));
    }
    EXPECT_TRUE(WriteSafetensors((dir_ / "model.safetensors").string(), tensors).ok());
    auto ckpt = Checkpoint::Open(dir_.string());
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    return ckpt.ok() ? std::move(*ckpt) : nullptr;
  }

  fs::path dir_;
};

at::Tensor Reference(const Checkpoint& ckpt, const Case& c) {
  TensorLoader loader(ckpt, at::kFloat, at::kCPU, {});
  auto r = loader.Load(c.name + ".dequantized", {c.out, c.in});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : at::Tensor();
}

TEST_F(QuantizedTest, EveryFormatDequantizesAsItsReference) {
  auto ckpt = Fixture();
  ASSERT_NE(ckpt, nullptr);
  const std::vector<Case> cases = Cases();
  ASSERT_GE(cases.size(), 9u);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name + " (" + c.spec.Describe() + ")");
    const at::Tensor ref = Reference(*ckpt, c);
    TensorLoader loader(*ckpt, at::kFloat, at::kCPU, {});
    loader.set_quant(c.spec);
    at::Tensor weight;
    ProjectionParts parts;
    const Status s = loader.LoadQuantized(c.name + ".", c.out, c.in, &weight, &parts);
    ASSERT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(ProjectionShape(c.spec, weight), std::make_pair(c.out, c.in));
    auto w = DequantizeProjection(c.spec, weight, parts, at::kFloat);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_EQ(w->sizes(), ref.sizes());
    EXPECT_TRUE(at::equal(*w, ref)) << "max diff " << (*w - ref).abs().max().item<float>();
    auto bf = DequantizeProjection(c.spec, weight, parts, at::kBFloat16);
    ASSERT_TRUE(bf.ok());
    EXPECT_TRUE(at::equal(*bf, ref.to(at::kBFloat16)));

    // A dense weight stored in the format loads dequantized, in the compute dtype.
    ASSERT_TRUE(loader.StoredQuantized(c.name + ".weight"));
    auto dense = loader.Load(c.name + ".weight", {c.out, c.in});
    ASSERT_TRUE(dense.ok()) << dense.status().ToString();
    EXPECT_TRUE(at::equal(*dense, ref));
  }
}

// The expert store keeps every stored byte of a projection and nothing more.
TEST_F(QuantizedTest, TheNativeBytesAreKept) {
  auto ckpt = Fixture();
  ASSERT_NE(ckpt, nullptr);
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    TensorLoader loader(*ckpt, at::kFloat, at::kCPU, {});
    loader.set_quant(c.spec);
    ExpertWeights w;
    w.quant = c.spec;
    ASSERT_TRUE(loader.LoadQuantized(c.name + ".", c.out, c.in, &w.w1, &w.q[0]).ok());
    size_t stored = 0;
    for (const std::string& name : ckpt->TensorNames()) {
      if (name.rfind(c.name + ".", 0) != 0 || name.ends_with(".dequantized") ||
          name.ends_with(".weight_shape")) {
        continue;
      }
      stored += ckpt->Find(name)->data.size();
    }
    EXPECT_EQ(w.bytes(), stored);
    EXPECT_LT(w.bytes(), static_cast<size_t>(c.out * c.in * 2)) << "fewer bytes than bf16";
  }
}

TEST_F(QuantizedTest, CorruptedTensorsAreLoadErrorsNamingThem) {
  const std::vector<Case> cases = Cases();
  auto find = [&](const std::string& name) {
    for (const Case& c : cases) {
      if (c.name == name) return c;
    }
    ADD_FAILURE() << name;
    return cases.front();
  };
  auto load_error = [&](const Checkpoint& ckpt, const Case& c) {
    TensorLoader loader(ckpt, at::kFloat, at::kCPU, {});
    loader.set_quant(c.spec);
    at::Tensor weight;
    ProjectionParts parts;
    const Status s = loader.LoadQuantized(c.name + ".", c.out, c.in, &weight, &parts);
    EXPECT_FALSE(s.ok()) << c.name;
    return s.message();
  };
  {  // A block scale of another shape.
    const Case c = find("fp8_block_16x32_f32");
    auto ckpt = Edited(c.name + ".weight_scale_inv", [](TensorToWrite* t, auto* bytes) {
      t->shape = {t->shape[0] * t->shape[1]};
    });
    const std::string m = load_error(*ckpt, c);
    EXPECT_NE(m.find("tensor \"fp8_block_16x32_f32.weight_scale_inv\": shape [9], expected [3, 3]"),
              std::string::npos)
        << m;
  }
  {  // A scale of another dtype (float32 bytes read as int32).
    const Case c = find("ct_int4_sym_g32");
    auto ckpt = Edited(c.name + ".weight_scale",
                       [](TensorToWrite* t, auto* bytes) { t->dtype = DType::kI16; });
    const std::string m = load_error(*ckpt, c);
    EXPECT_NE(
        m.find("tensor \"ct_int4_sym_g32.weight_scale\": dtype I16, expected BF16 or F16 or F32"),
        std::string::npos)
        << m;
  }
  {  // A group index past the last group.
    const Case c = find("gptq_v1_asym_desc_act_g16");
    auto ckpt = Edited(c.name + ".g_idx", [](TensorToWrite* t, std::vector<std::byte>* bytes) {
      const int32_t bad = 99;
      std::memcpy(bytes->data() + 4 * 3, &bad, 4);
    });
    const std::string m = load_error(*ckpt, c);
    EXPECT_NE(m.find("tensor \"gptq_v1_asym_desc_act_g16.g_idx\": group 99 is outside 0..4"),
              std::string::npos)
        << m;
  }
  {  // A missing zero point.
    const Case c = find("awq_g16");
    auto ckpt =
        Edited(c.name + ".qzeros", [](TensorToWrite* t, auto* bytes) { t->name = "elsewhere"; });
    const std::string m = load_error(*ckpt, c);
    EXPECT_NE(m.find("tensor \"awq_g16.qzeros\" is missing"), std::string::npos) << m;
  }
  {  // compressed-tensors' recorded shape disagreeing with the packed weight.
    const Case c = find("ct_int4_sym_g32");
    auto ckpt =
        Edited(c.name + ".weight_shape", [](TensorToWrite* t, std::vector<std::byte>* bytes) {
          const int64_t bad = 7;
          std::memcpy(bytes->data(), &bad, 8);
        });
    const std::string m = load_error(*ckpt, c);
    EXPECT_NE(m.find("weight_shape\" does not hold [40, 96]"), std::string::npos) << m;
  }
}

TEST(Quantized, ShapesTheFormatCannotPackAreRefused) {
  QuantSpec gptq{.method = QuantMethod::kGptq, .group_size = 16};
  at::Tensor weight = at::zeros({4, 12}, at::kInt);  // [in / 8, out]: out 12 is no multiple of 8.
  ProjectionParts parts;
  parts.zero = at::zeros({2, 1}, at::kInt);
  parts.scale = at::zeros({2, 12}, at::kHalf);
  auto w = DequantizeProjection(gptq, weight, parts, at::kFloat);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("[12, 32]: sizes are not multiples of 8"), std::string::npos)
      << w.status().ToString();
}

// MXFP4 (gpt-oss): the LibTorch dequantization (the device's path) against values worked out by
// hand, and against the CPU kernel's own row decoder through a whole expert.
TEST(Quantized, Mxfp4DequantizesByNibbleAndBlockScale) {
  QuantSpec spec;
  spec.method = QuantMethod::kMxfp4;
  spec.group_size = 32;
  // One row of 64: byte 0 = 0x12 (elements 1.0 then 0.5 before scaling: low nibble 2 -> 1.0,
  // high nibble 1 -> 0.5), byte 1 = 0xf8 (-0.0, -6.0); the rest 0. Block 0 scale 2^1, block 1
  // scale 2^-2; block 1's first byte (16) = 0x7e (-4.0, 6.0).
  at::Tensor w = at::zeros({1, 32}, at::kByte);
  w[0][0] = 0x12;
  w[0][1] = 0xf8;
  w[0][16] = 0x7e;
  at::Tensor s = at::tensor({128, 125}, at::kInt).to(at::kByte).reshape({1, 2});
  ProjectionParts parts;
  parts.scale = s;
  auto d = DequantizeProjection(spec, w, parts, at::kFloat);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->sizes(), (std::vector<int64_t>{1, 64}));
  EXPECT_EQ((*d)[0][0].item<float>(), 2.0f);    // nibble 2 (1.0) x 2
  EXPECT_EQ((*d)[0][1].item<float>(), 1.0f);    // nibble 1 (0.5) x 2
  EXPECT_EQ((*d)[0][2].item<float>(), 0.0f);    // nibble 8 (-0.0)
  EXPECT_EQ((*d)[0][3].item<float>(), -12.0f);  // nibble 15 (-6.0) x 2
  EXPECT_EQ((*d)[0][32].item<float>(), -1.0f);  // nibble 14 (-4.0) x 2^-2
  EXPECT_EQ((*d)[0][33].item<float>(), 1.5f);   // nibble 7 (6.0) x 2^-2
  EXPECT_EQ((*d)[0].sum().item<float>(), 2.0f + 1.0f - 12.0f - 1.0f + 1.5f);
}

}  // namespace
}  // namespace fmoe
