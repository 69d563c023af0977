#include "common/model/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("fmoe-st-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes raw bytes to `name` and returns the path.
  std::string WriteRaw(const std::string& name, const std::string& bytes) const {
    std::ofstream out(Path(name), std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return Path(name);
  }

  // Opens `bytes` as a file and expects kDataLoss naming the file and `what`.
  void ExpectDataLoss(const std::string& bytes, const std::string& what) const {
    const std::string path = WriteRaw("bad.safetensors", bytes);
    auto file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok()) << "accepted: " << bytes.substr(0, 200);
    EXPECT_EQ(file.status().code(), ErrorCode::kDataLoss) << file.status().ToString();
    EXPECT_EQ(file.status().message().rfind(path + ": ", 0), 0u) << file.status().message();
    EXPECT_NE(file.status().message().find(what), std::string::npos)
        << "want \"" << what << "\" in: " << file.status().message();
  }

  fs::path dir_;
};

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A file made by hand: length prefix, `header` verbatim, then `data_bytes` bytes.
std::string Raw(const std::string& header, size_t data_bytes) {
  return LengthPrefix(header.size()) + header + std::string(data_bytes, '\x5a');
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::byte> RandomBytes(size_t n, std::mt19937* rng) {
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>((*rng)() & 0xff);
  return out;
}

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float F16(uint16_t h) {
  float out = 0;
  EXPECT_TRUE(ConvertToF32(DType::kF16, std::as_bytes(std::span<const uint16_t>(&h, 1)),
                           std::span<float>(&out, 1))
                  .ok());
  return out;
}

float BF16(uint16_t h) {
  float out = 0;
  EXPECT_TRUE(ConvertToF32(DType::kBF16, std::as_bytes(std::span<const uint16_t>(&h, 1)),
                           std::span<float>(&out, 1))
                  .ok());
  return out;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  const DType all[] = {DType::kF32, DType::kF16,  DType::kBF16,  DType::kF64,
                       DType::kI64, DType::kI32,  DType::kI16,   DType::kI8,
                       DType::kU8,  DType::kBool, DType::kF8E4M3};
  std::mt19937 rng(7);
  std::vector<std::vector<std::byte>> storage;
  storage.reserve(16);
  std::vector<TensorToWrite> tensors;
  int i = 0;
  for (DType dtype : all) {
    std::vector<int64_t> shape = {2, 3, i % 3 + 1};
    size_t bytes = 2 * 3 * (i % 3 + 1) * DTypeSize(dtype);
    storage.push_back(RandomBytes(bytes, &rng));
    std::string name = std::to_string(i);
    name.append(".").append(DTypeName(dtype));
    tensors.push_back({name, dtype, shape, std::span<const std::byte>(storage.back())});
    ++i;
  }
  // A scalar and an empty tensor are legal too.
  storage.push_back(RandomBytes(4, &rng));
  tensors.push_back({"scalar", DType::kI32, {}, std::span<const std::byte>(storage.back())});
  tensors.push_back({"empty", DType::kF32, {3, 0}, {}});
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "caf\xc3\xa9"}};

  const std::string path = Path("all.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, metadata).ok());
  // Nothing but the file is left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);

  const std::string raw = ReadAll(path);
  uint64_t header_bytes = 0;
  for (int k = 7; k >= 0; --k) header_bytes = (header_bytes << 8) | static_cast<uint8_t>(raw[k]);
  EXPECT_EQ((8 + header_bytes) % 8, 0u) << "header padded to 8-byte alignment";

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_EQ((*file)->metadata(), metadata);
  EXPECT_EQ((*file)->file_bytes(), raw.size());
  ASSERT_EQ((*file)->tensors().size(), tensors.size());
  for (size_t k = 1; k < (*file)->tensors().size(); ++k) {
    EXPECT_LT((*file)->tensors()[k - 1].name, (*file)->tensors()[k].name) << "sorted by name";
  }
  for (const TensorToWrite& t : tensors) {
    const TensorView* view = (*file)->Find(t.name);
    ASSERT_NE(view, nullptr) << t.name;
    EXPECT_EQ(view->dtype, t.dtype) << t.name;
    EXPECT_EQ(view->shape, t.shape) << t.name;
    ASSERT_EQ(view->data.size(), t.data.size()) << t.name;
    EXPECT_EQ(static_cast<size_t>(view->numel()) * DTypeSize(t.dtype), t.data.size());
    EXPECT_TRUE(t.data.empty() || std::memcmp(view->data.data(), t.data.data(), t.data.size()) == 0)
        << t.name;
  }
  EXPECT_EQ((*file)->Find("absent"), nullptr);

  // Writing over an existing file replaces it.
  ASSERT_TRUE(WriteSafetensors(path, std::span<const TensorToWrite>(tensors).first(1)).ok());
  auto again = SafetensorsFile::Open(path);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ((*again)->tensors().size(), 1u);
  EXPECT_TRUE((*again)->metadata().empty());
}

TEST_F(SafetensorsTest, DTypeNamesAndSizes) {
  struct {
    DType dtype;
    const char* name;
    size_t size;
  } cases[] = {{DType::kF32, "F32", 4},   {DType::kF16, "F16", 2},       {DType::kBF16, "BF16", 2},
               {DType::kF64, "F64", 8},   {DType::kI64, "I64", 8},       {DType::kI32, "I32", 4},
               {DType::kI16, "I16", 2},   {DType::kI8, "I8", 1},         {DType::kU8, "U8", 1},
               {DType::kBool, "BOOL", 1}, {DType::kF8E4M3, "F8_E4M3", 1}};
  for (const auto& c : cases) {
    EXPECT_STREQ(DTypeName(c.dtype), c.name);
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
  }
}

TEST_F(SafetensorsTest, WriterRejectsInconsistentTensors) {
  std::vector<std::byte> eight(8);
  struct Case {
    TensorToWrite tensor;
    const char* error;
  } cases[] = {
      {{"a", DType::kF32, {3}, eight}, "8 bytes of data, dtype F32 and shape [3] need 12"},
      {{"a", DType::kF32, {-2}, eight}, "shape [-2] is negative or overflows"},
      {{"__metadata__", DType::kF32, {2}, eight}, "the name is reserved"},
      {{"bad\xff", DType::kU8, {8}, eight}, "the name is not UTF-8"},
  };
  for (const auto& c : cases) {
    Status s =
        WriteSafetensors(Path("w.safetensors"), std::span<const TensorToWrite>(&c.tensor, 1));
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << c.error;
    EXPECT_NE(s.message().find(c.error), std::string::npos) << s.message();
  }
  TensorToWrite twice[] = {{"a", DType::kU8, {8}, eight}, {"a", DType::kU8, {8}, eight}};
  Status s = WriteSafetensors(Path("w.safetensors"), twice);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("written twice"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(Path("w.safetensors")));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 0);

  TensorToWrite one = {"a", DType::kU8, {8}, eight};
  s = WriteSafetensors((dir_ / "no" / "such.safetensors").string(), std::span(&one, 1));
  EXPECT_EQ(s.code(), ErrorCode::kIoError) << s.ToString();
}

TEST_F(SafetensorsTest, StreamingWriterWritesWhatWriteSafetensorsWrites) {
  std::mt19937 rng(11);
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
  std::vector<TensorSpec> specs;
  const std::vector<std::pair<DType, std::vector<int64_t>>> shapes = {{DType::kBF16, {3, 5}},
                                                                      {DType::kF32, {7}},
                                                                      {DType::kF16, {}},
                                                                      {DType::kU8, {0, 4}},
                                                                      {DType::kI64, {2, 2}}};
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [dtype, shape] = shapes[i];
    size_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    storage.push_back(RandomBytes(n, &rng));
    std::string name = "t";  // Not "t" + ...: GCC 12 warns falsely (-Wrestrict) on that.
    name += std::to_string(i);
    tensors.push_back({name, dtype, shape, std::span<const std::byte>(storage.back())});
    specs.push_back({name, dtype, shape});
  }
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  ASSERT_TRUE(WriteSafetensors(Path("whole.safetensors"), tensors, metadata).ok());

  const std::string path = Path("streamed.safetensors");
  auto writer = SafetensorsWriter::Create(path, specs, metadata);
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  std::vector<std::byte> all;
  for (const auto& b : storage) all.insert(all.end(), b.begin(), b.end());
  EXPECT_EQ((*writer)->data_bytes(), all.size());
  // Pieces of 7 bytes, across tensor boundaries.
  for (size_t at = 0; at < all.size(); at += 7) {
    const size_t n = std::min<size_t>(7, all.size() - at);
    ASSERT_TRUE((*writer)->Append(std::span<const std::byte>(all).subspan(at, n)).ok());
    EXPECT_FALSE(fs::exists(path)) << "visible before Finish";
  }
  EXPECT_EQ((*writer)->appended_bytes(), all.size());
  ASSERT_TRUE((*writer)->Finish().ok());
  EXPECT_EQ(ReadAll(path), ReadAll(Path("whole.safetensors")));
  EXPECT_EQ((*writer)->file_bytes(), ReadAll(path).size());
  writer->reset();
  EXPECT_TRUE(fs::exists(path)) << "the destructor keeps a finished file";
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

TEST_F(SafetensorsTest, StreamingWriterChecksItsBytesAndLeavesNothingOnFailure) {
  const std::vector<TensorSpec> specs = {{"a", DType::kF32, {2}}, {"b", DType::kU8, {3}}};
  const std::vector<std::byte> bytes(16);
  const std::string path = Path("s.safetensors");
  auto count_files = [&] {
    return std::distance(fs::directory_iterator(dir_), fs::directory_iterator());
  };

  // Too many bytes: refused, the temporary file is gone, the writer is spent.
  auto w = SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(count_files(), 1);  // The temporary file.
  ASSERT_TRUE((*w)->Append(std::span(bytes).first(8)).ok());
  Status s = (*w)->Append(std::span(bytes).first(4));
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("12 bytes of data appended, the tensors hold 11"), std::string::npos)
      << s.message();
  EXPECT_EQ(count_files(), 0);
  EXPECT_EQ((*w)->Append(std::span(bytes).first(1)).code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ((*w)->Finish().code(), ErrorCode::kFailedPrecondition);

  // Too few bytes at Finish.
  w = SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append(std::span(bytes).first(10)).ok());
  s = (*w)->Finish();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("10 bytes of data appended, the tensors hold 11"), std::string::npos)
      << s.message();
  EXPECT_EQ(count_files(), 0);

  // Abandoned: the destructor removes the temporary file.
  w = SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Append(std::span(bytes).first(11)).ok());
  w->reset();
  EXPECT_EQ(count_files(), 0);

  // The same header rules as WriteSafetensors; nothing is created.
  struct Case {
    std::vector<TensorSpec> specs;
    const char* error;
  } cases[] = {
      {{{"a", DType::kU8, {1}}, {"a", DType::kU8, {1}}}, "tensor \"a\": written twice"},
      {{{"__metadata__", DType::kU8, {1}}}, "the name is reserved"},
      {{{"bad\xff", DType::kU8, {1}}}, "the name is not UTF-8"},
      {{{"a", DType::kF32, {-1}}}, "shape [-1] is negative or overflows"},
      {{{"a", DType::kF32, {1ll << 40, 1ll << 40}}}, "is negative or overflows"},
  };
  for (const Case& c : cases) {
    auto bad = SafetensorsWriter::Create(path, c.specs);
    ASSERT_FALSE(bad.ok()) << c.error;
    EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(c.error), std::string::npos) << bad.status().message();
    EXPECT_EQ(count_files(), 0);
  }
  auto bad_meta = SafetensorsWriter::Create(path, specs, {{"k", "\xc0"}});
  EXPECT_EQ(bad_meta.status().code(), ErrorCode::kInvalidArgument);
  auto no_dir = SafetensorsWriter::Create((dir_ / "no" / "s.safetensors").string(), specs);
  EXPECT_EQ(no_dir.status().code(), ErrorCode::kIoError) << no_dir.status().ToString();

  // No tensors at all is a valid (empty) file.
  auto empty = SafetensorsWriter::Create(path, {});
  ASSERT_TRUE(empty.ok());
  ASSERT_TRUE((*empty)->Finish().ok());
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  EXPECT_TRUE((*opened)->tensors().empty());
}

TEST_F(SafetensorsTest, MissingOrUnreadableFile) {
  auto missing = SafetensorsFile::Open(Path("absent.safetensors"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(missing.status().message(), Path("absent.safetensors") + ": no such file");

  fs::create_directories(dir_ / "d.safetensors");
  auto directory = SafetensorsFile::Open(Path("d.safetensors"));
  ASSERT_FALSE(directory.ok());
  EXPECT_EQ(directory.status().code(), ErrorCode::kIoError);
}

TEST_F(SafetensorsTest, AcceptsMinimalAndPaddedHeaders) {
  auto empty = SafetensorsFile::Open(WriteRaw("e.safetensors", Raw("{}", 0)));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE((*empty)->tensors().empty());

  auto padded = SafetensorsFile::Open(
      WriteRaw("p.safetensors", Raw(R"({"b":{"dtype":"U8","shape":[3],"data_offsets":[5,8]},)"
                                    R"("a":{"dtype":"I8","shape":[5],"data_offsets":[0,5]}})"
                                    "       ",
                                    8)));
  ASSERT_TRUE(padded.ok()) << padded.status().ToString();
  ASSERT_EQ((*padded)->tensors().size(), 2u);
  EXPECT_EQ((*padded)->tensors()[0].name, "a");
  EXPECT_EQ((*padded)->tensors()[0].data.size(), 5u);
  EXPECT_EQ((*padded)->tensors()[1].data.size(), 3u);
}

TEST_F(SafetensorsTest, EveryPrefixOfAValidFileIsDataLoss) {
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<uint16_t> b = {7, 8, 9};
  TensorToWrite tensors[] = {
      {"a", DType::kF32, {2, 3}, std::as_bytes(std::span<const float>(a))},
      {"b", DType::kF16, {3}, std::as_bytes(std::span<const uint16_t>(b))},
  };
  const std::string path = Path("ok.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"k", "v"}}).ok());
  const std::string whole = ReadAll(path);
  ASSERT_TRUE(SafetensorsFile::Open(path).ok());
  for (size_t n = 0; n < whole.size(); ++n) {
    auto file = SafetensorsFile::Open(WriteRaw("prefix.safetensors", whole.substr(0, n)));
    ASSERT_FALSE(file.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(file.status().code(), ErrorCode::kDataLoss) << n << ": " << file.status().ToString();
  }
  // So is a file with bytes after the last tensor.
  ExpectDataLoss(whole + "x", "the tensors cover");
}

TEST_F(SafetensorsTest, RejectsLyingHeaders) {
  struct Case {
    std::string header;
    size_t data_bytes;
    const char* error;
  } cases[] = {
      // Offsets.
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4,
       "tensor \"t\": data_offsets [0, 8] run past the data section (4 bytes)"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8,
       "tensor \"t\": data_offsets [8, 0]: begin > end"},
      {R"({"t":{"dtype":"F32","shape":[4,8],"data_offsets":[0,96]}})", 96,
       "tensor \"t\": data_offsets [0, 96] do not match dtype F32 and shape [4, 8] (128 bytes)"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "tensor \"u\" overlaps tensor \"t\""},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("u":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "overlaps"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12,
       "data bytes [0, 4) before tensor \"t\" belong to no tensor"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("u":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, "data bytes [4, 8) before tensor \"u\" belong to no tensor"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 6,
       "data section has 6 bytes, the tensors cover 4"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4,
       "tensor \"t\": data_offsets: not a list of two non-negative integers"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4,
       "data_offsets: not a list of two non-negative integers"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}})", 4,
       "data_offsets: not a list of two non-negative integers"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":"0-4"}})", 4,
       "data_offsets: not a list of two non-negative integers"},
      {R"({"t":{"dtype":"F32","shape":[1]}})", 4, "tensor \"t\": data_offsets: missing"},
      // Dtype.
      {R"({"t":{"dtype":"F8_E5M2","shape":[4],"data_offsets":[0,4]}})", 4,
       "tensor \"t\": unknown dtype \"F8_E5M2\""},
      {R"({"t":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4, "unknown dtype \"f32\""},
      {R"({"t":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4,
       "tensor \"t\": dtype: 4 is not a string"},
      {R"({"t":{"shape":[1],"data_offsets":[0,4]}})", 4, "tensor \"t\": dtype: missing"},
      // Shape.
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4,
       "tensor \"t\": shape: -1 is not a non-negative integer"},
      {R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4,
       "shape: 1.5 is not a non-negative integer"},
      {R"({"t":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})", 4,
       "shape: 18446744073709551615 is not a non-negative integer"},
      {R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4,
       "tensor \"t\": shape [4294967296, 4294967296] overflows"},
      {R"({"t":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,4]}})", 4,
       "shape [2305843009213693952] overflows"},
      {R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})", 0,
       "overflows"},
      {R"({"t":{"dtype":"F32","shape":"[1]","data_offsets":[0,4]}})", 4,
       "tensor \"t\": shape: \"[1]\" is not a list"},
      {R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", 4, "tensor \"t\": shape: missing"},
      {R"({"t":[1,2]})", 4, "tensor \"t\": a list is not an object"},
      // JSON and metadata.
      {R"([1,2])", 0, "header is not a JSON object"},
      {R"("x")", 0, "header is not a JSON object"},
      {R"( {})", 0, "header is not a JSON object: it does not start with '{'"},
      {R"({"t":)", 0, "header is not valid JSON"},
      {R"({"a":1} {)", 0, "header is not valid JSON"},
      {std::string("{\"a\":\"\xff\"}"), 0, "header is not valid JSON"},
      {R"({"__metadata__":[]})", 0, "__metadata__: a list is not an object"},
      {R"({"__metadata__":"x"})", 0, "__metadata__: \"x\" is not an object"},
      {R"({"__metadata__":{"k":1}})", 0, "__metadata__: \"k\": 1 is not a string"},
      {R"({"__metadata__":{"k":{"x":"y"}}})", 0, "__metadata__: \"k\": an object is not a string"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8, "header: key \"t\" repeats"},
      {R"({"t":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", 4,
       "header: key \"dtype\" repeats"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    ExpectDataLoss(Raw(c.header, c.data_bytes), c.error);
  }
}

TEST_F(SafetensorsTest, RejectsBadHeaderLengths) {
  ExpectDataLoss("", "0 bytes, shorter than the 8-byte header length");
  ExpectDataLoss(std::string("\x02\0\0", 3), "3 bytes, shorter than the 8-byte header length");
  ExpectDataLoss(LengthPrefix(0) + "{}", "header length is 0");
  ExpectDataLoss(LengthPrefix((100ull << 20) + 1) + "{}",
                 "header length 104857601 exceeds the 100 MB limit");
  ExpectDataLoss(LengthPrefix(~0ull) + "{}", "exceeds the 100 MB limit");
  ExpectDataLoss(LengthPrefix(3) + "{}",
                 "header length 3 runs past the end of the file (10 bytes)");
  ExpectDataLoss(LengthPrefix(100ull << 20) + "{}", "runs past the end of the file");
  // A header length shorter than the JSON cuts it: what follows is not part of the header.
  ExpectDataLoss(LengthPrefix(1) + "{}", "header is not valid JSON");
}

// libFuzzer-style robustness: random byte changes in the length prefix and header of a valid
// file never crash; whatever opens still satisfies the reader's guarantees.
TEST_F(SafetensorsTest, RandomHeaderCorruptionNeverCrashes) {
  std::vector<float> a(12, 1.5f);
  std::vector<int64_t> b = {1, 2, 3};
  std::vector<uint8_t> c = {1, 0, 1, 1};
  TensorToWrite tensors[] = {
      {"model.layers.0.w", DType::kF32, {3, 4}, std::as_bytes(std::span<const float>(a))},
      {"ids", DType::kI64, {3}, std::as_bytes(std::span<const int64_t>(b))},
      {"mask", DType::kBool, {2, 2}, std::as_bytes(std::span<const uint8_t>(c))},
  };
  const std::string path = Path("seed.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  const std::string seed = ReadAll(path);
  uint64_t header_bytes = 0;
  for (int k = 7; k >= 0; --k) header_bytes = (header_bytes << 8) | static_cast<uint8_t>(seed[k]);
  const size_t span = 8 + header_bytes;
  const char interesting[] = {'{', '}', '[', ']', '"', ',', ':', '-', '0', '9', '\\', '\0', 'e'};

  std::mt19937 rng(20240601);
  int opened = 0;
  constexpr int kIterations = 4000;
  for (int iter = 0; iter < kIterations; ++iter) {
    std::string bytes = seed;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = rng() % span;
      switch (rng() % 3) {
        case 0:
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          bytes[at] = static_cast<char>(rng() & 0xff);
          break;
        default:
          bytes[at] = interesting[rng() % sizeof(interesting)];
          break;
      }
    }
    if (rng() % 8 == 0) bytes.resize(rng() % (bytes.size() + 1));
    auto file = SafetensorsFile::Open(WriteRaw("fuzz.safetensors", bytes));
    if (!file.ok()) {
      EXPECT_EQ(file.status().code(), ErrorCode::kDataLoss) << file.status().ToString();
      continue;
    }
    ++opened;
    uint64_t covered = 0;
    for (const TensorView& t : (*file)->tensors()) {
      EXPECT_EQ(static_cast<uint64_t>(t.numel()) * DTypeSize(t.dtype), t.data.size());
      // Touch every byte: ASan would see a read outside the mapping.
      unsigned sum = 0;
      for (std::byte x : t.data) sum += static_cast<unsigned>(x);
      (void)sum;
      covered += t.data.size();
    }
    EXPECT_LE(covered, (*file)->file_bytes());
  }
  // Some mutations (inside names or metadata values) leave a valid file.
  EXPECT_GT(opened, 0);
  EXPECT_LT(opened, kIterations);
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

TEST_F(SafetensorsTest, ReleasePagesDropsResidentPagesAndTheDataReadsBack) {
  std::mt19937 rng(11);
  const std::vector<std::byte> a = RandomBytes(4 << 20, &rng);
  const std::vector<std::byte> b = RandomBytes((4 << 20) + 6, &rng);
  const std::vector<TensorToWrite> tensors = {{"a", DType::kU8, {4 << 20}, a},
                                              {"b", DType::kU8, {(4 << 20) + 6}, b}};
  const std::string path = Path("m.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  const TensorView& va = *(*file)->Find("a");
  const TensorView& vb = *(*file)->Find("b");
  auto touch = [](const TensorView& v) {
    unsigned sum = 0;
    for (size_t i = 0; i < v.data.size(); i += 4096) sum += static_cast<unsigned>(v.data[i]);
    return sum;
  };
  volatile unsigned sink = touch(va) + touch(vb);  // volatile: the reads must happen.
  (void)sink;
  const int64_t all = MappedRss(path);
  EXPECT_GE(all, 8 << 20);

  // Half of a: 2 MiB fewer resident; then the rest of a and all of b: next to nothing.
  ASSERT_TRUE((*file)->ReleasePages(va, 0, 2 << 20).ok());
  // At least the range goes (the kernel may drop a whole huge-page mapping around it: such pages
  // read back from the file too).
  EXPECT_LE(MappedRss(path), all - (2 << 20) + 8192);
  ASSERT_TRUE((*file)->ReleasePages(va, 2 << 20, 2 << 20).ok());
  ASSERT_TRUE((*file)->ReleasePages(vb, 0, vb.data.size()).ok());
  EXPECT_LT(MappedRss(path), 256 << 10);
  ASSERT_TRUE((*file)->ReleasePages(vb, 3, 0).ok()) << "an empty range is nothing to do";

  // The mapping stays valid: released pages read back the file's bytes.
  EXPECT_EQ(std::memcmp(va.data.data(), a.data(), a.size()), 0);
  EXPECT_EQ(std::memcmp(vb.data.data(), b.data(), b.size()), 0);

  // A range past the tensor, or a view of another file, is refused naming the file and tensor.
  Status past = (*file)->ReleasePages(vb, 7, vb.data.size() - 6);
  EXPECT_EQ(past.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(past.message().rfind(path + ": tensor \"b\": bytes [7, +", 0), 0u) << past.message();
  EXPECT_EQ((*file)->ReleasePages(vb, vb.data.size() + 1, 0).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE(WriteSafetensors(Path("other.safetensors"), tensors).ok());
  auto other = SafetensorsFile::Open(Path("other.safetensors"));
  ASSERT_TRUE(other.ok()) << other.status().ToString();
  Status foreign = (*file)->ReleasePages(*(*other)->Find("a"), 0, 1);
  EXPECT_EQ(foreign.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(foreign.message(), path + ": tensor \"a\": its data is not in this file's mapping");
}

TEST(SafetensorsConvert, F16ToF32IsExactForEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F16(static_cast<uint16_t>(h));
    const bool negative = (h & 0x8000) != 0;
    const int exp = (h >> 10) & 0x1f;
    const int mant = h & 0x3ff;
    if (exp == 0x1f) {
      if (mant == 0) {
        EXPECT_TRUE(std::isinf(f)) << h;
        EXPECT_EQ(std::signbit(f), negative) << h;
      } else {
        EXPECT_TRUE(std::isnan(f)) << h;
      }
      continue;
    }
    // Normal: (1024 + mant) * 2^(exp - 25); subnormal: mant * 2^-24.
    double want = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
    if (negative) want = -want;
    EXPECT_EQ(static_cast<double>(f), want) << h;
    EXPECT_EQ(std::signbit(f), negative) << h;
    // And back, bit for bit (zeros keep their sign).
    EXPECT_EQ(F32ToF16(f), h) << h;
  }
  EXPECT_EQ(F16(0x0001), std::ldexp(1.0f, -24));  // Smallest subnormal.
  EXPECT_EQ(F16(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(F16(0x0400), std::ldexp(1.0f, -14));  // Smallest normal.
  EXPECT_EQ(F16(0x7bff), 65504.0f);
  EXPECT_EQ(F16(0x3c00), 1.0f);
  EXPECT_EQ(F16(0xc000), -2.0f);
}

TEST(SafetensorsConvert, BF16ToF32IsExact) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = BF16(static_cast<uint16_t>(h));
    EXPECT_EQ(BitsOf(f), h << 16) << h;
    if (!std::isnan(f)) {
      EXPECT_EQ(F32ToBF16(f), h) << h;
    }
  }
  EXPECT_EQ(BF16(0x3f80), 1.0f);
  EXPECT_EQ(BF16(0xc000), -2.0f);
  EXPECT_EQ(BF16(0x0001), std::ldexp(1.0f, -133));  // Subnormal.
  EXPECT_TRUE(std::isinf(BF16(0xff80)) && BF16(0xff80) < 0);
  EXPECT_TRUE(std::isnan(BF16(0x7fc1)));
}

// A rounding is nearest-even when no neighbour of the result is closer, and ties pick even.
template <class ToHalf, class FromHalf>
void ExpectNearestEven(float f, ToHalf to_half, FromHalf from_half) {
  const uint16_t h = to_half(f);
  const double err = std::fabs(static_cast<double>(from_half(h)) - f);
  for (int delta : {-1, 1}) {
    const uint16_t n = static_cast<uint16_t>(h + delta);
    if ((n & 0x7fff) == 0x7fff || ((n ^ h) & 0x8000)) continue;  // Past NaN or across the sign.
    const double nf = static_cast<double>(from_half(n));
    if (std::isinf(nf) || std::isnan(nf)) continue;
    const double nerr = std::fabs(nf - f);
    EXPECT_LE(err, nerr) << f << " -> " << h << ", neighbour " << n;
    if (err == nerr) {
      EXPECT_EQ(h & 1, 0) << f << ": tie must round to even";
    }
  }
}

TEST(SafetensorsConvert, F32ToHalfRoundsToNearestEven) {
  // Ties, exactly half-way between two halves.
  EXPECT_EQ(F32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // 1 + half ulp -> 1 (even)
  EXPECT_EQ(F32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // -> up to even
  EXPECT_EQ(F32ToF16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);      // Half the smallest subnormal: even 0.
  EXPECT_EQ(F32ToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 subnormal units -> 2.
  EXPECT_EQ(F32ToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(F32ToF16(std::ldexp(1023.5f, -24)), 0x0400);  // Rounds up into the normals.
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);
  EXPECT_EQ(F32ToF16(65519.99f), 0x7bff);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);  // Tie with an odd max: to infinity.
  EXPECT_EQ(F32ToF16(-1e30f), 0xfc00);
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_TRUE(std::isnan(F16(F32ToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(F16(F32ToF16(Bits(0x7f800001)))));  // Signalling NaN stays NaN.

  EXPECT_EQ(F32ToBF16(Bits(0x3f808000)), 0x3f80);  // Tie -> even.
  EXPECT_EQ(F32ToBF16(Bits(0x3f818000)), 0x3f82);  // Tie -> even (up).
  EXPECT_EQ(F32ToBF16(Bits(0x3f808001)), 0x3f81);
  EXPECT_EQ(F32ToBF16(Bits(0x7f7fffff)), 0x7f80);  // Max float rounds to infinity.
  EXPECT_EQ(F32ToBF16(Bits(0x00000001)), 0x0000);
  EXPECT_EQ(F32ToBF16(Bits(0x80008000)), 0x8000);
  EXPECT_EQ(F32ToBF16(Bits(0x00008001)), 0x0001);
  EXPECT_TRUE(std::isnan(BF16(F32ToBF16(Bits(0x7f800001)))));
  EXPECT_TRUE(std::isnan(BF16(F32ToBF16(Bits(0xffc00000)))));

  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const float f = Bits(static_cast<uint32_t>(rng()));
    if (std::isnan(f) || std::isinf(f)) continue;
    if (std::fabs(f) < 65520.0f) ExpectNearestEven(f, F32ToF16, F16);
    if (std::fabs(f) < 3.38e38f) ExpectNearestEven(f, F32ToBF16, BF16);
    // Values near the half range, where random bit patterns rarely land.
    const float g =
        std::ldexp(static_cast<float>(rng() % 0x1000000), -24 - static_cast<int>(rng() % 40));
    ExpectNearestEven(g, F32ToF16, F16);
    ExpectNearestEven(-g, F32ToF16, F16);
  }
}

TEST(SafetensorsConvert, RejectsOtherDtypesAndSizes) {
  std::vector<std::byte> bytes(8);
  std::vector<float> out(2);
  Status s = ConvertToF32(DType::kI32, bytes, out);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("I32"), std::string::npos) << s.message();
  EXPECT_EQ(ConvertToF32(DType::kF16, bytes, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(ConvertToF32(DType::kF32, bytes, out).ok());
  std::vector<float> f32 = {1.5f, -0.0f, std::numeric_limits<float>::infinity()};
  std::vector<float> copy(3);
  ASSERT_TRUE(ConvertToF32(DType::kF32, std::as_bytes(std::span<const float>(f32)), copy).ok());
  EXPECT_EQ(std::memcmp(copy.data(), f32.data(), 12), 0);
}

}  // namespace
}  // namespace fmoe
