#include "common/model/expert_trace.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <unistd.h>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

class ExpertTraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("expert_trace_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    header_.model = "test";
    header_.source = "unit test";
    header_.iteration_unit = "engine iteration";
    header_.semantic = "none";
    header_.num_layers = 2;
    header_.num_experts = 4;
    header_.top_k = 2;
    header_.hidden = 3;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Two tokens, top-2 of 4 experts in each of 2 layers.
  TraceIteration Iteration(uint64_t request, uint32_t iteration, bool last, bool derived) {
    TraceIteration it;
    it.request_id = request;
    it.iteration = iteration;
    it.tokens = 2;
    it.last = last;
    it.sem = {0.5f, -1.0f, 2.0f};
    it.used_offsets = {0, 3, 5};
    it.used_experts = {0, 1, 3, 1, 2};
    it.used_tokens = {2, 1, 1, 2, 2};
    it.map_derived = derived;
    if (!derived) {
      it.map_offsets = {0, 4, 6};
      it.map_experts = {0, 1, 2, 3, 1, 2};
      it.map_probs = {0.5f, 0.25f, 0.05f, 0.2f, 0.6f, 0.4f};
    }
    it.speculation.push_back({0, 1, {1, 2}, {1.0f, 0.5f}});
    return it;
  }

  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
  TraceHeader header_;
};

TEST_F(ExpertTraceTest, RoundTripsEveryField) {
  auto w = TraceWriter::Create(Path("t.trace"), header_);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  TraceIteration first = Iteration(7, 0, false, false);
  first.prefill = true;  // A chunk of a prompt, then its last chunk at iteration 1.
  ASSERT_TRUE(w->Append(first).ok());
  ASSERT_TRUE(w->Append(Iteration(9, 0, true, true)).ok());
  TraceIteration second = Iteration(7, 1, true, false);
  second.prefill = true;
  ASSERT_TRUE(w->Append(second).ok());
  ASSERT_TRUE(w->Close().ok());

  auto t = ReadTrace(Path("t.trace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->header.model, "test");
  EXPECT_EQ(t->header.semantic, "none");
  EXPECT_EQ(t->header.num_layers, 2u);
  EXPECT_EQ(t->header.hidden, 3u);
  ASSERT_EQ(t->iterations.size(), 3u);
  const auto& a = t->iterations[0];
  EXPECT_EQ(a.request_id, 7u);
  EXPECT_FALSE(a.last);
  EXPECT_EQ(a.sem, (std::vector<float>{0.5f, -1.0f, 2.0f}));
  EXPECT_EQ(std::vector<uint16_t>(a.used(1).begin(), a.used(1).end()),
            (std::vector<uint16_t>{1, 2}));
  EXPECT_EQ(a.map_probs, Iteration(7, 0, false, false).map_probs);
  ASSERT_EQ(a.speculation.size(), 1u);
  EXPECT_EQ(a.speculation[0].target, 1u);
  EXPECT_EQ(a.speculation[0].fractions, (std::vector<float>{1.0f, 0.5f}));
  EXPECT_TRUE(t->iterations[1].map_derived);
  EXPECT_TRUE(t->iterations[2].last);
  EXPECT_TRUE(a.prefill);
  EXPECT_FALSE(t->iterations[1].prefill);
  EXPECT_TRUE(t->iterations[2].prefill);

  std::vector<float> map;
  a.FillMap(t->header, &map);
  EXPECT_EQ(map, (std::vector<float>{0.5f, 0.25f, 0.05f, 0.2f, 0.0f, 0.6f, 0.4f, 0.0f}));
  // Derived: tokens routed / (tokens * top_k).
  t->iterations[1].FillMap(t->header, &map);
  EXPECT_EQ(map, (std::vector<float>{0.5f, 0.25f, 0.0f, 0.25f, 0.0f, 0.5f, 0.5f, 0.0f}));
}

TEST_F(ExpertTraceTest, AppendRejectsBadIterations) {
  auto w = TraceWriter::Create(Path("t.trace"), header_);
  ASSERT_TRUE(w.ok());
  auto expect_error = [&](TraceIteration it, const std::string& needle) {
    Status s = w->Append(it);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  };
  auto it = Iteration(1, 0, false, false);
  it.used_experts[1] = 9;
  expect_error(it, "expert 9 >= num_experts 4");
  it = Iteration(1, 0, false, false);
  std::swap(it.used_experts[0], it.used_experts[1]);
  expect_error(it, "not strictly ascending");
  it = Iteration(1, 0, false, false);
  it.used_tokens[0] = 1;
  expect_error(it, "3 tokens routed, expected tokens * top_k = 4");
  it = Iteration(1, 0, false, false);
  it.sem.pop_back();
  expect_error(it, "sem has 2 values, hidden is 3");
  it = Iteration(1, 0, false, false);
  it.map_probs[0] = std::nanf("");
  expect_error(it, "is not in [0, 1]");
  it = Iteration(1, 0, false, false);
  it.speculation[0].target = 0;
  expect_error(it, "needs layer < target < num_layers");
  it = Iteration(1, 0, false, false);
  it.tokens = 0;
  expect_error(it, "tokens is 0");
  it = Iteration(1, 0, false, false);
  it.used_offsets = {0, 9, 5};  // Past the entries, then back: never read out of bounds.
  expect_error(it, "routing offsets out of order at layer 0");
  it = Iteration(1, 0, false, false);
  it.map_offsets = {0, 7, 6};
  expect_error(it, "map offsets out of order at layer 0");
  EXPECT_EQ(w->records(), 0u);
  TraceHeader bad = header_;
  bad.top_k = 5;
  EXPECT_EQ(TraceWriter::Create(Path("b.trace"), bad).status().code(), ErrorCode::kInvalidArgument);
}

TEST_F(ExpertTraceTest, ReadNamesTruncationAndCorruption) {
  {
    auto w = TraceWriter::Create(Path("t.trace"), header_);
    ASSERT_TRUE(w->Append(Iteration(1, 0, false, false)).ok());
    ASSERT_TRUE(w->Append(Iteration(1, 1, true, false)).ok());
    ASSERT_TRUE(w->Close().ok());
  }
  const auto size = fs::file_size(Path("t.trace"));
  fs::copy_file(Path("t.trace"), Path("cut.trace"));
  fs::resize_file(Path("cut.trace"), size - 3);
  auto cut = ReadTrace(Path("cut.trace"));
  EXPECT_EQ(cut.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(cut.status().message().find("record 1: truncated"), std::string::npos)
      << cut.status().message();

  // An expert id out of range inside a record: the first routing expert of record 0.
  std::string bytes;
  {
    std::ifstream in(Path("t.trace"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  uint32_t header_len = 0;
  std::memcpy(&header_len, bytes.data() + 8, 4);
  const size_t first_expert = 12 + header_len + 4 + 20 + 3 * 4 + 2;
  std::string bad = bytes;
  bad[first_expert] = 40;
  {
    std::ofstream out(Path("bad.trace"), std::ios::binary);
    out << bad;
  }
  auto corrupt = ReadTrace(Path("bad.trace"));
  EXPECT_EQ(corrupt.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(corrupt.status().message().find("expert 40 >= num_experts 4"), std::string::npos)
      << corrupt.status().message();

  bad = bytes;
  bad[0] = 'X';
  {
    std::ofstream out(Path("magic.trace"), std::ios::binary);
    out << bad;
  }
  EXPECT_NE(ReadTrace(Path("magic.trace")).status().message().find("not an fmoe trace"),
            std::string::npos);
  EXPECT_EQ(ReadTrace(Path("missing.trace")).status().code(), ErrorCode::kNotFound);
}

TEST_F(ExpertTraceTest, ReadChecksIterationOrder) {
  {
    auto w = TraceWriter::Create(Path("gap.trace"), header_);
    ASSERT_TRUE(w->Append(Iteration(1, 0, false, false)).ok());
    ASSERT_TRUE(w->Append(Iteration(1, 2, true, false)).ok());
    ASSERT_TRUE(w->Close().ok());
  }
  EXPECT_NE(ReadTrace(Path("gap.trace")).status().message().find("iteration 2, expected 1"),
            std::string::npos);
  {
    auto w = TraceWriter::Create(Path("after.trace"), header_);
    ASSERT_TRUE(w->Append(Iteration(1, 0, true, false)).ok());
    ASSERT_TRUE(w->Append(Iteration(1, 1, true, false)).ok());
    ASSERT_TRUE(w->Close().ok());
  }
  EXPECT_NE(
      ReadTrace(Path("after.trace")).status().message().find("continues after its last iteration"),
      std::string::npos);
}

}  // namespace
}  // namespace fmoe
