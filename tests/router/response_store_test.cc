// The Responses API's kept responses on disk (router/responses.h ResponseStore::Open,
// router/response_db.h): they survive reopening and a kill -9 of the process that wrote them,
// least recently used first out past the capacity (also when reopened with a smaller one),
// records that do not read back whole are skipped and kept, and a directory another store holds
// or that cannot be created leaves the store in memory, still serving.
#include "router/responses.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router/response_db.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// prefix + i (built by appending: GCC 12 warns falsely on "literal" + std::to_string at -O3).
std::string Name(const char* prefix, int i) {
  std::string out = prefix;
  out += std::to_string(i);
  return out;
}

Json Conversation(const std::string& question, const std::string& answer) {
  return Json::array(
      {{{"role", "user"}, {"content", question}}, {{"role", "assistant"}, {"content", answer}}});
}

TEST(ResponseStore, StoredResponsesSurviveReopeningInTheirOrderOfUse) {
  const testing::ScopedTempDir tmp("responses");
  const std::string dir = tmp.path() + "/db";
  {
    ResponseStore store(3);
    ASSERT_TRUE(store.Open(dir).ok());
    EXPECT_TRUE(store.persistent());
    store.Put("resp_a", Conversation("a?", "A"));
    store.Put("resp_b", Conversation("b?", "B"));
    store.Put("resp_c", Conversation("c?", "C"));
    ASSERT_TRUE(store.Get("resp_a").has_value());  // a is now the most recently used.
  }
  {
    ResponseStore store(3);
    ASSERT_TRUE(store.Open(dir).ok());
    EXPECT_EQ(store.size(), 3u);
    EXPECT_EQ(store.Get("resp_b"), Conversation("b?", "B"));  // b, then c, are used now.
    EXPECT_EQ(store.Get("resp_c"), Conversation("c?", "C"));
    store.Put("resp_d", Conversation("d?", "D"));  // a is the least recently used: out.
    EXPECT_FALSE(store.Get("resp_a").has_value());
  }
  ResponseStore store(3);
  ASSERT_TRUE(store.Open(dir).ok());
  EXPECT_EQ(store.size(), 3u);
  EXPECT_FALSE(store.Get("resp_a").has_value());
  for (const char* id : {"resp_b", "resp_c", "resp_d"}) EXPECT_TRUE(store.Get(id).has_value());
}

TEST(ResponseStore, AReopenedStoreKeepsTheNewestUpToItsCapacity) {
  const testing::ScopedTempDir tmp("responses");
  const std::string dir = tmp.path() + "/db";
  {
    ResponseStore store(10);
    ASSERT_TRUE(store.Open(dir).ok());
    for (int i = 0; i < 5; ++i) store.Put(Name("r", i), Conversation("q", "a"));
  }
  {
    ResponseStore store(2);
    ASSERT_TRUE(store.Open(dir).ok());
    EXPECT_EQ(store.size(), 2u);
    EXPECT_TRUE(store.Get("r3").has_value() && store.Get("r4").has_value());
  }
  ResponseStore store(10);  // The older three were deleted from disk, not only skipped.
  ASSERT_TRUE(store.Open(dir).ok());
  EXPECT_EQ(store.size(), 2u);
  EXPECT_FALSE(store.Get("r0").has_value());
}

TEST(ResponseStore, RecordsThatDoNotReadBackAreSkippedAndKept) {
  const testing::ScopedTempDir tmp("responses");
  const std::string dir = tmp.path() + "/db";
  {
    auto db = ResponseDb::Open(dir);
    ASSERT_TRUE(db.ok()) << db.status().ToString();
    ASSERT_TRUE((*db)->Put("good", 7, Conversation("q", "a").dump()).ok());
    ASSERT_TRUE((*db)->PutRawForTest("c/torn", "[{\"role\": \"us").ok());  // Not JSON.
    ASSERT_TRUE((*db)->PutRawForTest("s/torn", std::string(8, '\1')).ok());
    ASSERT_TRUE((*db)->PutRawForTest("c/object", "{\"role\": \"user\"}").ok());  // Not an array.
    ASSERT_TRUE((*db)->PutRawForTest("s/object", std::string(8, '\2')).ok());
    ASSERT_TRUE((*db)->PutRawForTest("c/short", "[]").ok());
    ASSERT_TRUE((*db)->PutRawForTest("s/short", "abc").ok());                  // Not 8 bytes.
    ASSERT_TRUE((*db)->PutRawForTest("s/lonely", std::string(8, '\3')).ok());  // No conversation.
    ASSERT_TRUE((*db)->PutRawForTest("zzz", "x").ok());                        // Not ours.
  }
  {
    ResponseStore store(8);
    ASSERT_TRUE(store.Open(dir).ok());
    EXPECT_EQ(store.size(), 1u);
    EXPECT_EQ(store.Get("good"), Conversation("q", "a"));
    EXPECT_FALSE(store.Get("torn").has_value());
  }
  auto db = ResponseDb::Open(dir);
  ASSERT_TRUE(db.ok());
  std::vector<std::string> skipped;
  auto rows = (*db)->Load(&skipped);
  ASSERT_TRUE(rows.ok());
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0].id, "good");
  std::sort(skipped.begin(), skipped.end());
  EXPECT_EQ(skipped, (std::vector<std::string>{"lonely", "object", "short", "torn", "zzz"}));
}

TEST(ResponseStore, ADirectoryItCannotUseLeavesItInMemory) {
  const testing::ScopedTempDir tmp("responses");
  const std::string base = tmp.path();
  ResponseStore first(4);
  ASSERT_TRUE(first.Open(base + "/db").ok());
  ResponseStore second(4);
  const Status held = second.Open(base + "/db");
  EXPECT_EQ(held.code(), ErrorCode::kUnavailable);
  EXPECT_NE(held.message().find("in use by another router"), std::string::npos) << held.message();
  EXPECT_FALSE(second.persistent());
  second.Put("x", Conversation("q", "a"));
  EXPECT_EQ(second.Get("x"), Conversation("q", "a"));
  std::ofstream(base + "/file") << "not a directory";
  ResponseStore third(4);
  const Status blocked = third.Open(base + "/file/db");
  EXPECT_EQ(blocked.code(), ErrorCode::kUnavailable);
  EXPECT_NE(blocked.message().find(base + "/file/db"), std::string::npos) << blocked.message();
  third.Put("y", Conversation("q", "a"));
  EXPECT_TRUE(third.Get("y").has_value());
}

// A writer killed with SIGKILL right after its last Put loses none of them (the WAL is written
// before Put returns; the page cache outlives the process).
TEST(ResponseStore, StoredResponsesSurviveKillNine) {
  const testing::ScopedTempDir tmp("responses");
  const std::string dir = tmp.path() + "/db";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ResponseStore store(100);
    if (!store.Open(dir).ok()) _exit(3);
    for (int i = 0; i < 40; ++i) {
      store.Put(Name("r", i), Conversation(Name("q", i), "a"));
    }
    raise(SIGKILL);
    _exit(4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  ResponseStore store(100);
  ASSERT_TRUE(store.Open(dir).ok());
  EXPECT_EQ(store.size(), 40u);
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(store.Get(Name("r", i)), Conversation(Name("q", i), "a")) << i;
  }
}

}  // namespace
}  // namespace fmoe
