// TensorLoader: bfloat16, float16 and float32 checkpoints load to each compute dtype with the
// values of the reference conversion (common/safetensors ConvertToF32, then LibTorch to the
// compute dtype), bit for bit, through tensors that span several chunks, an unaligned tensor and
// empty and scalar ones; the mapped pages are released once read; other dtypes and shapes are
// refused naming the file and the tensor.
#include "gpu_worker/model/tensor_loader.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/model/safetensors.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;

class TensorLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-loader-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// Random bytes of `dtype` for `numel` values: floats spread over many magnitudes (including
// float16 and bfloat16 subnormals, values that round either way and overflow float16) for F32;
// for F16 and BF16, every bit pattern but NaN in turn, then random ones.
std::vector<std::byte> Values(DType dtype, int64_t numel, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> out(static_cast<size_t>(numel) * DTypeSize(dtype));
  if (dtype == DType::kF32) {
    std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
    std::uniform_int_distribution<int> exponent(-30, 20);
    for (int64_t i = 0; i < numel; ++i) {
      const float v = std::ldexp(mantissa(rng), exponent(rng));
      std::memcpy(out.data() + 4 * i, &v, 4);
    }
    return out;
  }
  const bool f16 = dtype == DType::kF16;
  uint32_t pattern = 0;
  for (int64_t i = 0; i < numel; ++i) {
    uint16_t h = 0;
    for (;;) {
      h = pattern < 0x10000 ? static_cast<uint16_t>(pattern++) : static_cast<uint16_t>(rng());
      const bool nan = f16 ? (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0
                           : (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
      if (!nan) break;
    }
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

// The reference: ConvertToF32, then LibTorch's conversion to `dtype` (what the loader did before
// it converted directly).
at::Tensor Reference(DType stored, std::span<const std::byte> data,
                     const std::vector<int64_t>& shape, at::ScalarType dtype) {
  at::Tensor f32 = at::empty(shape, at::dtype(at::kFloat));
  const Status s = ConvertToF32(
      stored, data, std::span<float>(f32.data_ptr<float>(), static_cast<size_t>(f32.numel())));
  EXPECT_TRUE(s.ok()) << s.ToString();
  return f32.to(dtype);
}

// Bitwise equality (NaN-safe, and -0 differs from 0).
bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.nbytes() == 0 ||
          std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<size_t>(a.nbytes())) == 0);
}

// Resident bytes of this process's mapping of `path` (/proc/self/smaps), or -1 when unmapped.
int64_t MappedRss(const std::string& path) {
  std::ifstream in("/proc/self/smaps");
  bool in_mapping = false;
  int64_t rss = -1;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find('-') < line.find(' ')) {
      in_mapping = line.size() >= path.size() &&
                   line.compare(line.size() - path.size(), path.size(), path) == 0;
    } else if (in_mapping && line.rfind("Rss:", 0) == 0) {
      rss = std::max<int64_t>(rss, 0) + std::stoll(line.substr(4)) * 1024;
    }
  }
  return rss;
}

struct Written {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

TEST_F(TensorLoaderTest, EveryStoredDtypeLoadsToEveryComputeDtypeAsTheReference) {
  const DType stored_dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  const at::ScalarType compute_dtypes[] = {at::kBFloat16, at::kHalf, at::kFloat};
  for (DType stored : stored_dtypes) {
    SCOPED_TRACE(DTypeName(stored));
    // "big" spans three 16 MiB chunks with a partial last one; "small" starts unaligned for F32
    // (after "odd", an odd number of bfloat16 values).
    const int64_t big_rows = (2 * (16 << 20) / static_cast<int64_t>(DTypeSize(stored))) / 1000 + 7;
    std::vector<Written> tensors = {
        {"model.odd", DType::kBF16, {3}, {}},        {"model.small", stored, {5, 7}, {}},
        {"model.big", stored, {big_rows, 1000}, {}}, {"model.scalar", stored, {}, {}},
        {"model.empty", stored, {0, 4}, {}},         {"model.patterns", stored, {1 << 17}, {}},
    };
    uint32_t seed = 1;
    for (Written& t : tensors) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      t.data = Values(t.dtype, n, seed++);
    }
    std::vector<TensorToWrite> to_write;
    for (const Written& t : tensors) to_write.push_back({t.name, t.dtype, t.shape, t.data});
    const fs::path model = dir_ / DTypeName(stored);
    fs::create_directories(model);
    const std::string file = (model / "model.safetensors").string();
    ASSERT_TRUE(WriteSafetensors(file, to_write).ok());
    auto ckpt = Checkpoint::Open(model.string());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    if (stored == DType::kF32) {
      const auto* small = (*ckpt)->Find("model.small")->data.data();
      ASSERT_NE(reinterpret_cast<uintptr_t>(small) % 4, 0u) << "the unaligned case is covered";
    }

    for (at::ScalarType compute : compute_dtypes) {
      SCOPED_TRACE(c10::toString(compute));
      std::vector<std::pair<uint64_t, uint64_t>> calls;
      const LoadProgress progress = [&](uint64_t done, uint64_t total) {
        calls.emplace_back(done, total);
      };
      TensorLoader loader(**ckpt, compute, at::kCPU, progress);
      uint64_t done = 0;
      for (const Written& t : tensors) {
        SCOPED_TRACE(t.name);
        auto loaded = loader.Load(t.name, t.shape);
        ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
        EXPECT_EQ(loaded->device(), at::Device(at::kCPU));
        EXPECT_TRUE(loaded->is_contiguous());
        const at::Tensor want = Reference(t.dtype, t.data, t.shape, compute);
        EXPECT_TRUE(SameBits(*loaded, want));
        // The tensor owns its memory: it is not a view over the mapping.
        const auto* begin = reinterpret_cast<const std::byte*>(loaded->data_ptr());
        const auto& view = (*ckpt)->Find(t.name)->data;
        EXPECT_TRUE(t.data.empty() || begin < view.data() || begin >= view.data() + view.size());
        done += t.data.size();
        ASSERT_FALSE(calls.empty());
        EXPECT_EQ(calls.back(), std::make_pair(done, (*ckpt)->total_bytes()));
      }
      // Released pages read back from the file: the views still hold the file's bytes.
      for (const Written& t : tensors) {
        const auto& view = (*ckpt)->Find(t.name)->data;
        ASSERT_EQ(view.size(), t.data.size());
        EXPECT_TRUE(t.data.empty() || std::memcmp(view.data(), t.data.data(), view.size()) == 0)
            << t.name;
      }
    }
  }
}

TEST_F(TensorLoaderTest, NaNsStayNaN) {
  const uint16_t bf16[] = {0x7fc0, 0xffc1, 0x7f81};
  const uint16_t f16[] = {0x7e00, 0xfc01, 0x7d00};
  const float nan = std::nanf("");
  const std::vector<TensorToWrite> tensors = {
      {"bf16", DType::kBF16, {3}, std::as_bytes(std::span<const uint16_t>(bf16))},
      {"f16", DType::kF16, {3}, std::as_bytes(std::span<const uint16_t>(f16))},
      {"f32", DType::kF32, {1}, std::as_bytes(std::span<const float>(&nan, 1))},
  };
  ASSERT_TRUE(WriteSafetensors(Path("model.safetensors"), tensors).ok());
  auto ckpt = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  for (at::ScalarType compute : {at::kBFloat16, at::kHalf, at::kFloat}) {
    TensorLoader loader(**ckpt, compute, at::kCPU, {});
    for (const char* name : {"bf16", "f16", "f32"}) {
      auto t = loader.Load(name, {});
      ASSERT_TRUE(t.ok()) << t.status().ToString();
      EXPECT_TRUE(t->isnan().all().item<bool>()) << name << " as " << c10::toString(compute);
    }
  }
}

TEST_F(TensorLoaderTest, ReleasesTheMappedPagesOfWhatItRead) {
  // 48 MiB of bfloat16, read as float32: once loaded, next to nothing of the mapping is resident.
  const std::vector<std::byte> data = Values(DType::kBF16, 24 << 20, 3);
  const TensorToWrite t = {"w", DType::kBF16, {24, 1 << 20}, data};
  const std::string file = Path("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(file, std::span<const TensorToWrite>(&t, 1)).ok());
  auto ckpt = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  const int64_t before = MappedRss(file);
  ASSERT_GE(before, 0) << file << " is not mapped";
  EXPECT_LT(before, 1 << 20);
  TensorLoader loader(**ckpt, at::kFloat, at::kCPU, {});
  auto loaded = loader.Load("w", {24, 1 << 20});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_LT(MappedRss(file), 1 << 20);
  // The mapping is still good: read again, it is the file's bytes, resident again.
  EXPECT_EQ(std::memcmp((*ckpt)->Find("w")->data.data(), data.data(), data.size()), 0);
  EXPECT_GT(MappedRss(file), 40 << 20);
  // A second load of the same tensor gives the same values.
  auto again = loader.Load("w", {});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(SameBits(*loaded, *again));
}

TEST_F(TensorLoaderTest, OtherDtypesAndShapesAreRefusedNamingTheTensor) {
  const int32_t ints[] = {1, 2, 3, 4};
  const double doubles[] = {1.0, 2.0};
  const float floats[] = {1.0f, 2.0f};
  const std::vector<TensorToWrite> tensors = {
      {"model.layers.0.ids", DType::kI32, {4}, std::as_bytes(std::span<const int32_t>(ints))},
      {"model.f64", DType::kF64, {2}, std::as_bytes(std::span<const double>(doubles))},
      {"model.norm.weight", DType::kF32, {2}, std::as_bytes(std::span<const float>(floats))},
  };
  const std::string file = Path("model.safetensors");
  ASSERT_TRUE(WriteSafetensors(file, tensors).ok());
  auto ckpt = Checkpoint::Open(dir_.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::vector<uint64_t> calls;
  const LoadProgress progress = [&](uint64_t done, uint64_t) { calls.push_back(done); };
  TensorLoader loader(**ckpt, at::kBFloat16, at::kCPU, progress);

  auto ids = loader.Load("model.layers.0.ids", {4});
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ids.status().message(),
            "model: " + file +
                ": tensor \"model.layers.0.ids\": dtype I32 is not a floating-point weight type "
                "(F32, F16, BF16)");
  auto f64 = loader.Load("model.f64", {2});
  ASSERT_FALSE(f64.ok());
  EXPECT_NE(f64.status().message().find("tensor \"model.f64\": dtype F64 is not"),
            std::string::npos)
      << f64.status().message();

  auto shape = loader.Load("model.norm.weight", {3});
  ASSERT_FALSE(shape.ok());
  EXPECT_EQ(shape.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(shape.status().message(),
            "model: " + file + ": tensor \"model.norm.weight\": shape [2], expected [3]");
  auto missing = loader.Load("lm_head.weight", {2});
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(missing.status().message().find("tensor \"lm_head.weight\" is missing"),
            std::string::npos);
  EXPECT_TRUE(calls.empty()) << "nothing was counted";

  // Skip checks and counts without reading.
  EXPECT_FALSE(loader.Skip("model.norm.weight", {3}).ok());
  ASSERT_TRUE(loader.Skip("model.norm.weight", {2}).ok());
  EXPECT_EQ(calls, std::vector<uint64_t>{8});
}

}  // namespace
}  // namespace fmoe
