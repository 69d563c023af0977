#include "tools/trainer/bpe_trainer.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::string kFixtures = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers";

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

fs::path TempDir(const std::string& name) {
  fs::path dir = fs::path(testing::TempDir()) / ("fmoe_bpe_trainer_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Trains on `text` and writes DIR/tokenizer.json; returns DIR.
fs::path TrainInto(const std::string& name, const std::string& text, BpeTrainerOptions options) {
  fs::path dir = TempDir(name);
  BpeTrainer trainer(std::move(options));
  Status st = trainer.Add(text);
  EXPECT_TRUE(st.ok()) << st.ToString();
  st = trainer.Train();
  EXPECT_TRUE(st.ok()) << st.ToString();
  st = trainer.Save((dir / "tokenizer.json").string());
  EXPECT_TRUE(st.ok()) << st.ToString();
  return dir;
}

std::vector<std::string> Merges(const fs::path& dir) {
  Json j = Json::parse(ReadFile(dir / "tokenizer.json"));
  return j["model"]["merges"].get<std::vector<std::string>>();
}

// The trained fixture is this trainer's output on train_text.txt: the generator script records
// what Hugging Face `tokenizers` makes of it (tokenizer_test compares our encodings with that),
// so a change in the trainer's output must show up here and be regenerated deliberately.
TEST(BpeTrainer, OutputIsDeterministicAndMatchesTheCommittedFixture) {
  std::string text = ReadFile(kFixtures + "/train_text.txt");
  ASSERT_FALSE(text.empty());
  BpeTrainerOptions options;
  options.vocab_size = 600;
  fs::path a = TrainInto("a", text, options);
  fs::path b = TrainInto("b", text, options);
  std::string out = ReadFile(a / "tokenizer.json");
  EXPECT_EQ(out, ReadFile(b / "tokenizer.json"));
  fs::path fixture = fs::path(kFixtures) / "trained" / "tokenizer.json";
  if (std::getenv("FMOE_UPDATE_FIXTURES") != nullptr) {
    fs::create_directories(fixture.parent_path());
    fs::copy_file(a / "tokenizer.json", fixture, fs::copy_options::overwrite_existing);
  }
  ASSERT_TRUE(fs::exists(fixture)) << "run once with FMOE_UPDATE_FIXTURES=1, then the generator";
  EXPECT_EQ(out, ReadFile(fixture)) << "the trainer's output changed: regenerate the fixtures";
}

TEST(BpeTrainer, OutputLoadsAndRoundTrips) {
  std::string text = ReadFile(kFixtures + "/train_text.txt");
  BpeTrainerOptions options;
  options.vocab_size = 600;
  fs::path dir = TrainInto("load", text, options);
  auto tok = Tokenizer::Load(dir.string());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_LE((*tok)->vocab_size(), 600u);
  EXPECT_GT((*tok)->vocab_size(), 4u + 256u + 100u);
  EXPECT_EQ((*tok)->TokenToId("<unk>"), 0);
  EXPECT_EQ((*tok)->TokenToId("<s>"), 1);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  EXPECT_TRUE((*tok)->IsSpecial(3));
  EXPECT_EQ((*tok)->TokenToId("!"), 4 + 0x21);  // Byte symbols follow the specials in byte order.
  for (const std::string s : {"The quick brown fox.", "  spaced\tout\n", "日本語 😀", ""}) {
    auto ids = (*tok)->Encode(s, true);
    ASSERT_TRUE(ids.ok());
    ASSERT_FALSE(ids->empty());
    EXPECT_EQ(ids->front(), 1);
    EXPECT_EQ((*tok)->Decode(*ids, true), s);
  }
  // Frequent words became single tokens.
  auto ids = (*tok)->Encode(" the", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), 1u);
}

TEST(BpeTrainer, MergesTheMostFrequentPairFirstAndBreaksTiesBySymbols) {
  BpeTrainerOptions options;
  options.vocab_size = 4 + 256 + 2;
  fs::path dir = TrainInto("freq", "aaa aaa aaa bb", options);
  // (a a) is seen 2 + 2 * 2 = 6 times, (Ġ a) twice, (b b) and (Ġ b) once.
  std::vector<std::string> merges = Merges(dir);
  ASSERT_EQ(merges.size(), 2u);
  EXPECT_EQ(merges[0], "a a");
  // Then (aa a): once in "aaa" and twice in " aaa" beats (Ġ aa): 2.
  EXPECT_EQ(merges[1], "aa a");

  options.vocab_size = 4 + 256 + 1;
  dir = TrainInto("tie", "cdab", options);  // Every pair once: no merge at min_frequency 2.
  EXPECT_TRUE(Merges(dir).empty());
  options.min_frequency = 1;
  dir = TrainInto("tie1", "cdab", options);
  ASSERT_EQ(Merges(dir).size(), 1u);
  EXPECT_EQ(Merges(dir)[0], "a b");  // Ties go to the pair with the smaller symbols.
}

TEST(BpeTrainer, SpecialTokensInTheTextAreNotLearnt) {
  BpeTrainerOptions options;
  options.vocab_size = 4 + 256 + 10;
  std::string text;
  for (int i = 0; i < 50; ++i) text += "<s>xy</s>";
  fs::path dir = TrainInto("specials", text, options);
  std::vector<std::string> merges = Merges(dir);
  ASSERT_EQ(merges.size(), 1u);  // Only "xy": the specials were cut out of the words.
  EXPECT_EQ(merges[0], "x y");
}

TEST(BpeTrainer, RejectsBadOptionsAndMisuse) {
  BpeTrainerOptions small;
  small.vocab_size = 100;
  EXPECT_EQ(BpeTrainer(small).Add("x").code(), ErrorCode::kInvalidArgument);

  BpeTrainerOptions dup;
  dup.special_tokens = {"<s>", "<s>"};
  Status st = BpeTrainer(dup).Train();
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.message().find("listed twice"), std::string::npos) << st.message();

  BpeTrainerOptions bos;
  bos.bos_token = "<bos>";
  st = BpeTrainer(bos).Train();
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(st.message().find("is not a special token"), std::string::npos) << st.message();

  BpeTrainerOptions byte;
  byte.special_tokens = {"a"};
  byte.bos_token = byte.eos_token = "";
  EXPECT_EQ(BpeTrainer(byte).Train().code(), ErrorCode::kInvalidArgument);

  BpeTrainer trainer({});
  st = trainer.Add("ok \xC3");
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "bpe trainer: text is not valid UTF-8 at byte 3");
  EXPECT_EQ(trainer.Save((TempDir("misuse") / "tokenizer.json").string()).code(),
            ErrorCode::kFailedPrecondition);
  ASSERT_TRUE(trainer.Train().ok());
  EXPECT_EQ(trainer.Add("more").code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(trainer.Save("/nonexistent-dir/tokenizer.json").code(), ErrorCode::kIoError);
}

TEST(BpeTrainer, ReportsProgress) {
  BpeTrainerOptions options;
  options.vocab_size = 4 + 256 + 50;
  BpeTrainer trainer(options);
  ASSERT_TRUE(trainer.Add(ReadFile(kFixtures + "/train_text.txt")).ok());
  size_t last_done = 0, last_wanted = 0, calls = 0;
  ASSERT_TRUE(trainer
                  .Train([&](size_t done, size_t wanted) {
                    EXPECT_GE(done, last_done);
                    last_done = done;
                    last_wanted = wanted;
                    ++calls;
                  })
                  .ok());
  EXPECT_GE(calls, 1u);
  EXPECT_EQ(last_wanted, 50u);
  EXPECT_GE(last_done, 50u);  // More when a merge rebuilds a string that is already a token.
}

// Training time on a large file: FMOE_BPE_TRAIN_BENCH=<text file> [FMOE_BPE_TRAIN_VOCAB=4096].
TEST(BpeTrainer, TrainingTime) {
  const char* file = std::getenv("FMOE_BPE_TRAIN_BENCH");
  if (file == nullptr) GTEST_SKIP() << "set FMOE_BPE_TRAIN_BENCH=<text file> to measure";
  BpeTrainerOptions options;
  if (const char* v = std::getenv("FMOE_BPE_TRAIN_VOCAB")) options.vocab_size = std::atoi(v);
  std::string text = ReadFile(file);
  auto t0 = std::chrono::steady_clock::now();
  BpeTrainer trainer(options);
  // Documents of ~64 KB, as a corpus reader would hand them over.
  for (size_t at = 0; at < text.size();) {
    size_t end = std::min(text.size(), at + (64 << 10));
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    ASSERT_TRUE(trainer.Add(std::string_view(text).substr(at, end - at)).ok());
    at = end;
  }
  auto t1 = std::chrono::steady_clock::now();
  ASSERT_TRUE(trainer.Train().ok());
  auto t2 = std::chrono::steady_clock::now();
  fs::path dir = TempDir("bench");
  ASSERT_TRUE(trainer.Save((dir / "tokenizer.json").string()).ok());
  auto t3 = std::chrono::steady_clock::now();
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::printf("%zu bytes, vocab %u: count %.2f s, merges %.2f s, save %.2f s, total %.2f s\n",
              text.size(), options.vocab_size, secs(t0, t1), secs(t1, t2), secs(t2, t3),
              secs(t0, t3));
}

}  // namespace
}  // namespace fmoe
