// Structured output's grammar engine: the JSON Schema compiler (json_schema.h), the byte
// matcher (grammar_matcher.h) and the token mask (token_mask.h). The matcher is checked against
// an independent validator (below) on random schemas: generated instances are accepted, random
// walks over the accepted bytes never get stuck and always end in JSON that validates, and
// mutated instances are accepted only when they still validate.
#include "common/text/json_schema.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/grammar_matcher.h"
#include "common/text/token_mask.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

std::shared_ptr<const JsonGrammar> Compile(const Json& schema) {
  auto g = CompileJsonSchema(schema.dump());
  EXPECT_TRUE(g.ok()) << g.status().message() << " for " << schema.dump();
  return g.ok() ? *g : nullptr;
}

std::string Hex(std::string_view s) {
  std::string out;
  char buf[4];
  for (unsigned char c : s) {
    std::snprintf(buf, sizeof(buf), "%02x ", c);
    out += buf;
  }
  return out;
}

// Concatenation without operator+ (GCC 12's -Wrestrict misfires on "lit" + std::string).
std::string Cat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (std::string_view p : parts) out += p;
  return out;
}

bool Matches(const std::shared_ptr<const JsonGrammar>& g, std::string_view text) {
  GrammarMatcher m(g);
  return m.Accept(text) && m.complete();
}

// ---- An independent validator for the supported subset (resolves local $refs). ----
const Json* Resolve(const Json& root, const std::string& ref) {
  if (ref == "#") return &root;
  try {
    return &root.at(Json::json_pointer(ref.substr(1)));
  } catch (...) {
    return nullptr;
  }
}

bool Validate(const Json& root, const Json& s, const Json& v, int depth = 0) {
  if (depth > 200) return false;
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    const Json* t = Resolve(root, s["$ref"]);
    return t != nullptr && Validate(root, *t, v, depth + 1);
  }
  if (s.contains("nullable") && s["nullable"] == true && v.is_null()) return true;
  if (s.contains("allOf")) {
    for (const Json& sub : s["allOf"]) {
      if (!Validate(root, sub, v, depth + 1)) return false;
    }
  }
  for (const char* key : {"anyOf", "oneOf"}) {
    if (!s.contains(key)) continue;
    int n = 0;
    for (const Json& sub : s[key]) n += Validate(root, sub, v, depth + 1);
    if (n == 0) return false;
  }
  if (s.contains("enum")) {
    bool any = false;
    for (const Json& e : s["enum"]) any = any || e == v;
    if (!any) return false;
  }
  if (s.contains("const") && s["const"] != v) return false;
  if (s.contains("type")) {
    std::vector<std::string> types;
    if (s["type"].is_string()) {
      types.push_back(s["type"]);
    } else {
      for (const Json& t : s["type"]) types.push_back(t);
    }
    bool ok = false;
    for (const std::string& t : types) {
      ok = ok || (t == "object" && v.is_object()) || (t == "array" && v.is_array()) ||
           (t == "string" && v.is_string()) || (t == "number" && v.is_number()) ||
           (t == "integer" &&
            (v.is_number_integer() ||
             (v.is_number_float() && v.get<double>() == std::floor(v.get<double>())))) ||
           (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null());
    }
    if (!ok) return false;
  }
  if (v.is_object()) {
    const Json props = s.value("properties", Json::object());
    for (const auto& [k, sub] : v.items()) {
      if (props.contains(k)) {
        if (!Validate(root, props[k], sub, depth + 1)) return false;
      } else if (s.contains("additionalProperties")) {
        if (!Validate(root, s["additionalProperties"], sub, depth + 1)) return false;
      }
    }
    for (const Json& r : s.value("required", Json::array())) {
      if (!v.contains(r.get<std::string>())) return false;
    }
  }
  if (v.is_array()) {
    if (s.contains("items")) {
      for (const Json& e : v) {
        if (!Validate(root, s["items"], e, depth + 1)) return false;
      }
    }
    if (v.size() < s.value("minItems", size_t{0})) return false;
    if (v.size() > s.value("maxItems", SIZE_MAX)) return false;
  }
  if (v.is_string()) {
    size_t chars = 0;
    for (unsigned char c : v.get<std::string>()) chars += (c & 0xC0) != 0x80;
    if (chars < s.value("minLength", size_t{0}) || chars > s.value("maxLength", SIZE_MAX)) {
      return false;
    }
  }
  return true;
}

// The compiler is stricter than JSON Schema where the schema lists properties without
// additionalProperties (extra keys refused): the validator is given the same rule.
Json Strict(Json s) {
  if (s.is_object()) {
    if (s.contains("properties") && !s["properties"].empty() &&
        !s.contains("additionalProperties")) {
      s["additionalProperties"] = false;
    }
    for (auto& [k, sub] : s.items()) {
      if (k == "enum" || k == "const") continue;
      sub = Strict(sub);
    }
  } else if (s.is_array()) {
    for (auto& e : s) e = Strict(e);
  }
  return s;
}

TEST(JsonSchema, RefusesWhatItCannotCompileNamingThePath) {
  struct Case {
    const char* schema;
    const char* error;
  };
  const Case cases[] = {
      {R"({"type":"object","properties":{"a":{"type":"string","pattern":"x"}}})",
       "schema /properties/a: \"pattern\" is not supported"},
      {R"({"type":"integer","minimum":0})", "schema /: \"minimum\" is not supported"},
      {R"({"$ref":"#/$defs/A","$defs":{"A":{"$ref":"#/$defs/A"}}})", "$ref cycle"},
      {R"({"$ref":"#/$defs/B"})", "\"$ref\" \"#/$defs/B\" points to nothing"},
      {R"({"$ref":"http://x/y"})", "is not a local JSON pointer"},
      {R"({"type":"array","items":false})", "schema /items: the schema false accepts nothing"},
      {R"({"type":"object","properties":{"a":{}},"required":["b"]})",
       "required property \"b\" is not in \"properties\""},
      {R"({"type":"array","minItems":3,"maxItems":2})", "\"minItems\" is more than"},
      {R"({"type":"strung"})", "unknown \"type\" \"strung\""},
      {R"({"enum":[]})", "\"enum\" must be a non-empty array"},
      {R"({"anyOf":[{"type":"string"},{"anyOf":[{"$ref":"#"}]}]})", "$ref cycle"},
      {R"({"type":"string","enum":[1,2]})", "\"enum\" has no value of the given \"type\""},
      {"{not json", "schema: not valid JSON"},
      {R"({"type":"object","properties":{"a\"b":{}}})", "needs escaping"},
      {R"({"type":"array","items":[{"type":"string"}]})", "tuples"},
      {R"({"type":"array","minItems":-1})", "\"minItems\" must be a non-negative integer"},
  };
  for (const Case& c : cases) {
    auto g = CompileJsonSchema(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_NE(g.status().message().find(c.error), std::string::npos)
        << c.schema << " -> " << g.status().message();
  }
  // Too deep, too many properties, too large: refused, never a crash.
  std::string deep = R"({"type":"string"})";
  for (int i = 0; i < 100; ++i) deep = Cat({R"({"type":"array","items":)", deep, "}"});
  EXPECT_NE(CompileJsonSchema(deep).status().message().find("nested deeper than 64"),
            std::string::npos);
  // An enum value nested a hundred thousand deep: refused before anything recurses into it.
  const std::string nested =
      Cat({R"({"enum":[)", std::string(100000, '['), std::string(100000, ']'), "]}"});
  EXPECT_NE(CompileJsonSchema(nested).status().message().find("deeper than 512 JSON levels"),
            std::string::npos);
  Json wide = {{"type", "object"}, {"properties", Json::object()}};
  for (int i = 0; i < 65; ++i) wide["properties"][Cat({"p", std::to_string(i)})] = Json::object();
  EXPECT_NE(CompileJsonSchema(wide.dump()).status().message().find("more than 64 properties"),
            std::string::npos);
  Json big = {{"enum", Json::array()}};
  for (int i = 0; i < 10000; ++i) big["enum"].push_back(std::string(40, 'a') + std::to_string(i));
  EXPECT_NE(CompileJsonSchema(big.dump()).status().message().find("exceed 262144 bytes"),
            std::string::npos);
  EXPECT_NE(CompileJsonSchema(std::string(kMaxSchemaBytes + 1, ' '))
                .status()
                .message()
                .find("larger than 1048576 bytes"),
            std::string::npos);
}

TEST(JsonSchema, AcceptsExactlyTheValidInstances) {
  const Json person = Json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 5},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
      "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
      "score": {"type": ["number", "null"]}
    },
    "required": ["name", "age"],
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"const": "cat"}},
                      "required": ["kind"]}}
  })");
  auto g = Compile(person);
  ASSERT_NE(g, nullptr);
  for (const char* ok : {
           R"({"name":"bob","age":3})",
           R"({"age":-12,"name":"\u00e9x\uD7FF\uE000"})",
           R"({ "name" : "bo",
  "age": 0, "tags": ["a","b"], "pet": {"kind":"cat"}, "score": -1.5e+3})",
           R"({"name":"ü€𝄞x","age":1,"pet":null,"score":null})",
       }) {
    EXPECT_TRUE(Matches(g, ok)) << ok;
  }
  for (const char* bad : {
           R"({"name":"bob"})",                               // age required
           R"({"name":"","age":3})",                          // minLength
           R"({"name":"bobbyb","age":3})",                    // maxLength
           R"({"name":"bob","age":3.5})",                     // integer
           R"({"name":"bob","age":3,"x":1})",                 // no additional properties
           R"({"name":"bob","age":3,"age":4})",               // duplicate
           R"({"name":"bob","age":3,"tags":["a","b","a"]})",  // maxItems
           R"({"name":"bob","age":3,"pet":{"kind":"dog"}})",
           R"({"name":"bob","age":03})",
           R"( {"name":"bob","age":3})",             // no leading whitespace
           R"({"name":"bob","age":3} )",             // none trailing
           "{\"name\":\"b\xC3\",\"age\":3}",         // broken UTF-8
           "{\"name\":\"\xED\xA0\x80\",\"age\":3}",  // a surrogate
           R"({"name":"b\q","age":3})",
           R"({"name":"\ud83d\ude00","age":3})",  // surrogates: written as UTF-8 instead
           R"({"name":"\uDC00","age":3})",
           R"({"name":"bob","age":3,})",
       }) {
    EXPECT_FALSE(Matches(g, bad)) << bad;
  }
  // Whitespace is bounded per gap.
  EXPECT_TRUE(Matches(g, Cat({"{", std::string(kMaxWhitespace, ' '), R"("name":"a","age":1})"})));
  EXPECT_FALSE(
      Matches(g, Cat({"{", std::string(kMaxWhitespace + 1, ' '), R"("name":"a","age":1})"})));
  // Numbers are bounded too.
  EXPECT_TRUE(Matches(g, Cat({R"({"name":"a","age":)", std::string(kMaxIntDigits, '1'), "}"})));
  EXPECT_FALSE(
      Matches(g, Cat({R"({"name":"a","age":)", std::string(kMaxIntDigits + 1, '1'), "}"})));

  // json_object: any object, extra keys of any value.
  auto any = AnyJsonObjectGrammar();
  EXPECT_TRUE(Matches(any, R"({"a":[1,{"b":null}],"c":"d"})"));
  EXPECT_TRUE(Matches(any, "{}"));
  EXPECT_FALSE(Matches(any, "[1]"));
  EXPECT_FALSE(Matches(any, "\"x\""));

  // Recursion through $ref works.
  auto tree = Compile(Json::parse(R"({"$ref":"#/$defs/T","$defs":{"T":{"type":"object",
      "properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/T"}}},
      "required":["v"]}}})"));
  EXPECT_TRUE(Matches(tree, R"({"v":1,"kids":[{"v":2,"kids":[{"v":3}]},{"v":4}]})"));
  EXPECT_FALSE(Matches(tree, R"({"v":1,"kids":[{"kids":[]}]})"));
}

// ---- Random schemas and instances ----
struct Gen {
  std::mt19937_64 rng;
  int Pick(int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }

  Json Schema(int depth) {
    const int kind = depth > 3 ? 3 + Pick(5) : Pick(9);
    switch (kind) {
      case 0: {
        Json s = {{"type", "object"}, {"properties", Json::object()}};
        Json required = Json::array();
        const int n = Pick(4);
        for (int i = 0; i < n; ++i) {
          const std::string name =
              std::string(1, static_cast<char>('a' + Pick(3))) + (Pick(2) ? "b" : "");
          s["properties"][name] = Schema(depth + 1);
          if (Pick(2)) required.push_back(name);
        }
        std::sort(required.begin(), required.end());
        required.erase(std::unique(required.begin(), required.end()), required.end());
        s["required"] = required;
        if (Pick(3) == 0) s["additionalProperties"] = Pick(2) ? Json(true) : Schema(depth + 1);
        return s;
      }
      case 1: {
        Json s = {{"type", "array"}, {"items", Schema(depth + 1)}};
        if (Pick(2)) s["minItems"] = Pick(3);
        if (Pick(2)) s["maxItems"] = s.value("minItems", 0) + Pick(3);
        return s;
      }
      case 2:
        return {{"anyOf", {Schema(depth + 1), Schema(depth + 1)}}};
      case 3: {
        Json s = {{"type", "string"}};
        if (Pick(2)) s["minLength"] = Pick(3);
        if (Pick(2)) s["maxLength"] = s.value("minLength", 0) + Pick(4);
        return s;
      }
      case 4:
        return {{"type", Pick(2) ? "number" : "integer"}};
      case 5:
        return {{"enum", {"x", 1, nullptr, "xy", 12, Json::array({1})}}};
      case 6:
        return {{"type", Json::array({"boolean", "null"})}};
      case 7:
        return Json::object();  // Anything.
      default:
        return {{"type", "string"}, {"nullable", true}};
    }
  }

  // A random byte string the matcher takes, by walking its accepted bytes.
  std::string Walk(const std::shared_ptr<const JsonGrammar>& g, size_t max_len, bool* stuck) {
    GrammarStepper stepper(g);
    MatchState state = stepper.Initial(), next;
    std::string out;
    *stuck = false;
    while (out.size() < max_len) {
      std::vector<std::pair<uint8_t, MatchState>> options;
      for (int b = 0; b < 256; ++b) {
        if (stepper.Step(state, static_cast<uint8_t>(b), &next)) {
          options.push_back({static_cast<uint8_t>(b), next});
        }
      }
      const bool complete = stepper.Complete(state);
      if (options.empty()) {
        *stuck = !complete;
        return out;
      }
      if (complete && Pick(4) == 0) return out;
      // Prefer structure over long strings so that walks finish.
      std::vector<size_t> closers;
      for (size_t i = 0; i < options.size(); ++i) {
        const uint8_t b = options[i].first;
        if (b == '"' || b == '}' || b == ']' || b == ',' || b == ':' || b == 'n' || b == '1') {
          closers.push_back(i);
        }
      }
      const size_t k = !closers.empty() && Pick(3) != 0
                           ? closers[static_cast<size_t>(Pick(static_cast<int>(closers.size())))]
                           : static_cast<size_t>(Pick(static_cast<int>(options.size())));
      out += static_cast<char>(options[k].first);
      state = std::move(options[k].second);
    }
    return stepper.Complete(state) ? out : std::string();
  }
};

TEST(JsonSchema, RandomWalksNeverGetStuckAndAlwaysValidate) {
  Gen gen{std::mt19937_64(7)};
  int validated = 0;
  for (int round = 0; round < 300; ++round) {
    const Json schema = gen.Schema(0);
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    for (int walk = 0; walk < 10; ++walk) {
      bool stuck = false;
      const std::string text = gen.Walk(g, 400, &stuck);
      ASSERT_FALSE(stuck) << schema.dump() << " stuck after " << text;
      if (text.empty()) continue;  // Ran out of length.
      const Json v = Json::parse(text, nullptr, false);
      ASSERT_FALSE(v.is_discarded()) << schema.dump() << " walked to non-JSON " << Hex(text);
      ASSERT_TRUE(Validate(Strict(schema), Strict(schema), v))
          << schema.dump() << " accepted " << text;
      ++validated;
      // Whatever it accepted, a mutation is accepted only if it still validates.
      for (int m = 0; m < 5; ++m) {
        std::string mutated = text;
        const size_t at = static_cast<size_t>(gen.Pick(static_cast<int>(text.size())));
        switch (gen.Pick(3)) {
          case 0:
            mutated[at] = static_cast<char>(gen.Pick(256));
            break;
          case 1:
            mutated.erase(at, 1);
            break;
          default:
            mutated.insert(at, 1, "{}[],:\"0 a\\"[gen.Pick(11)]);
        }
        if (!Matches(g, mutated)) continue;
        const Json mv = Json::parse(mutated, nullptr, false);
        ASSERT_FALSE(mv.is_discarded()) << schema.dump() << " accepted non-JSON " << mutated;
        ASSERT_TRUE(Validate(Strict(schema), Strict(schema), mv))
            << schema.dump() << " accepted " << mutated;
      }
    }
  }
  EXPECT_GT(validated, 1000);
}

// OpenAPI 3.0's `nullable: true` (which the compiler takes) as JSON Schema says it: anyOf the
// schema and null.
Json NullableAsAnyOf(Json s) {
  if (s.is_array()) {
    for (Json& e : s) e = NullableAsAnyOf(e);
  } else if (s.is_object()) {
    for (auto& [k, sub] : s.items()) {
      if (k != "enum" && k != "const") sub = NullableAsAnyOf(sub);
    }
    if (s.contains("nullable")) {
      const bool on = s["nullable"] == true;
      s.erase("nullable");
      if (on) return {{"anyOf", {s, {{"type", "null"}}}}};
    }
  }
  return s;
}

// The same walks checked by a real JSON Schema validator (Python's jsonschema, Draft 2020-12),
// against the schema as given (the extra keys it would allow are never generated; `nullable`
// written as JSON Schema's anyOf with null). Skipped, and
// said so, when python3 has no jsonschema.
TEST(JsonSchema, WalksValidateWithPythonJsonschema) {
  if (std::system("python3 -c 'import jsonschema' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "SKIPPED: python3 with jsonschema is not installed";
  }
  Gen gen{std::mt19937_64(23)};
  std::vector<Json> schemas;
  for (int i = 0; i < 200; ++i) schemas.push_back(gen.Schema(0));
  // What pydantic writes ($defs, $ref, anyOf with null, titles, defaults).
  schemas.push_back(Json::parse(R"({"$defs":{"Pet":{"properties":{"kind":{"enum":["cat","dog"],
      "title":"Kind","type":"string"},"age":{"anyOf":[{"type":"integer"},{"type":"null"}],
      "default":null}},"required":["kind"],"title":"Pet","type":"object"}},"properties":{
      "name":{"title":"Name","type":"string","maxLength":20},"pets":{"items":{"$ref":
      "#/$defs/Pet"},"title":"Pets","type":"array","maxItems":3}},"required":["name","pets"],
      "title":"Person","type":"object"})"));
  const std::string path = ::testing::TempDir() + "/json_schema_walks.jsonl";
  int lines = 0;
  {
    std::ofstream out(path);
    for (const Json& schema : schemas) {
      auto g = Compile(schema);
      ASSERT_NE(g, nullptr);
      for (int walk = 0; walk < 5; ++walk) {
        bool stuck = false;
        const std::string text = gen.Walk(g, 400, &stuck);
        ASSERT_FALSE(stuck);
        if (text.empty()) continue;
        out << Json({{"schema", NullableAsAnyOf(schema)}, {"instance", Json::parse(text)}}).dump()
            << "\n";
        ++lines;
      }
    }
  }
  const std::string script =
      "import json, sys, jsonschema\n"
      "n = 0\n"
      "for line in open(sys.argv[1]):\n"
      "    case = json.loads(line)\n"
      "    jsonschema.Draft202012Validator(case['schema']).validate(case['instance'])\n"
      "    n += 1\n"
      "print('validated', n)\n";
  const std::string command = "python3 -c \"" + script + "\" " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  EXPECT_EQ(pclose(pipe), 0) << output;
  EXPECT_EQ(output, "validated " + std::to_string(lines) + "\n");
  EXPECT_GT(lines, 500);
}

TEST(JsonSchema, ValidInstancesOfRandomSchemasAreAccepted) {
  // Valid instances built by hand from the schema's shape: serialized compactly and pretty.
  Gen gen{std::mt19937_64(11)};
  int checked = 0;
  for (int round = 0; round < 300; ++round) {
    const Json schema = gen.Schema(0);
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    // Candidates: walks of the grammar re-serialized (another whitespace layout, key order).
    for (int walk = 0; walk < 5; ++walk) {
      bool stuck = false;
      const std::string text = gen.Walk(g, 400, &stuck);
      if (text.empty()) continue;
      const Json v = Json::parse(text);
      const std::string compact = v.dump();
      const std::string pretty = v.dump(1);
      // nlohmann sorts keys: accepted in any order. Pretty printing fits the whitespace bound
      // up to a depth of kMaxWhitespace - 1.
      EXPECT_TRUE(Matches(g, compact)) << schema.dump() << " refused " << compact;
      // Enum and const values match only as written compactly.
      if (pretty.size() < 300 && schema.dump().find("enum") == std::string::npos) {
        EXPECT_TRUE(Matches(g, pretty)) << schema.dump() << pretty;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 500);
}

// ---- Token masks ----
std::vector<uint8_t> BruteForce(const std::shared_ptr<const JsonGrammar>& g,
                                const TokenVocab& vocab, const std::string& prefix,
                                const std::vector<int32_t>& ends) {
  std::vector<uint8_t> allowed(vocab.size(), 0);
  GrammarMatcher base(g);
  EXPECT_TRUE(base.Accept(prefix));
  for (size_t id = 0; id < vocab.size(); ++id) {
    const auto tok = static_cast<int32_t>(id);
    if (std::find(ends.begin(), ends.end(), tok) != ends.end()) {
      allowed[id] = base.complete();
      continue;
    }
    if (vocab.special(tok) || vocab.bytes(tok).empty()) continue;
    GrammarMatcher m = base;
    allowed[id] = m.Accept(vocab.bytes(tok));
  }
  return allowed;
}

void CheckMasks(const std::string& dir) {
  auto tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  auto vocab = TokenVocab::FromTokenizer(**tok);
  const std::vector<int32_t> ends = {*(*tok)->eos_id()};
  auto g = Compile(Json::parse(R"({"type":"object","properties":{
      "name":{"type":"string"},"n":{"type":"number"},"ok":{"type":"boolean"},
      "list":{"type":"array","items":{"enum":["red","green"]}}},"required":["name"]})"));
  const std::string text =
      R"({"name": "h\u00e9llo wörld", "n": -12.5e3, "list": ["red"], "ok": true})";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    const std::string prefix = text.substr(0, cut);
    TokenMasker masker(g, vocab, ends);
    GrammarMatcher check(g);
    ASSERT_TRUE(check.Accept(prefix)) << prefix;
    // Feed the prefix through the masker as bytes of tokens: re-encode and accept each token.
    auto ids = (*tok)->Encode(prefix, false);
    if (!ids.ok()) continue;  // The cut splits a character.
    bool fed = true;
    for (int32_t id : *ids) fed = fed && masker.Accept(id);
    if (!fed) continue;  // The encoding put a byte the tokenizer maps differently; skip.
    std::vector<uint8_t> mask;
    masker.Fill(vocab->size(), &mask);
    EXPECT_EQ(mask, BruteForce(g, *vocab, prefix, ends)) << "after " << prefix;
  }
}

TEST(TokenMask, EqualsBruteForceOnTheFixtureTokenizer) {
  CheckMasks(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/mixtral-ref");
}

TEST(TokenMask, EqualsBruteForceOnQwen2) {
  CheckMasks(std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/tokenizers/qwen2");
}

// Random byte-level vocabularies (quotes, escapes, partial UTF-8, JSON pieces) at the states of
// random walks over random schemas: the mask (with its shortcut inside strings) is the brute
// force's.
TEST(TokenMask, EqualsBruteForceOnRandomVocabulariesAndStates) {
  Gen gen{std::mt19937_64(3)};
  const std::string pieces[] = {"\"",       "\\",    "\\u00e9",
                                "\\n",      "\",",   "\"}",
                                "\":",      "\"]",   "{\"",
                                "a",        "ab",    " ",
                                "\n",       "1",     "-1.5",
                                "e+",       "\xC3",  "\xA9",
                                "\xE2\x82", "\xAC",  "true",
                                "null",     "[",     "]",
                                "{",        "}",     ",",
                                ":",        "\"a\"", "\"ab\"",
                                "\\\"",     "\x01",  "\xF0\x9F\x98\x80",
                                "x\"",      "é"};
  int compared = 0;
  for (int round = 0; round < 60; ++round) {
    std::vector<std::string> bytes;
    for (int i = 0; i < 150; ++i) {
      std::string t;
      for (int k = 0, n = 1 + gen.Pick(3); k < n; ++k) {
        t += pieces[gen.Pick(static_cast<int>(std::size(pieces)))];
      }
      bytes.push_back(t);
    }
    bytes.push_back("<eos>");
    std::vector<bool> special(bytes.size(), false);
    special.back() = true;
    auto vocab = std::make_shared<const TokenVocab>(bytes, special);
    const std::vector<int32_t> ends = {static_cast<int32_t>(bytes.size() - 1)};
    const Json schema = gen.Schema(0);
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    for (int walk = 0; walk < 3; ++walk) {
      bool stuck = false;
      const std::string text = gen.Walk(g, 200, &stuck);
      for (size_t cut = 0; cut <= text.size(); cut += 1 + static_cast<size_t>(gen.Pick(4))) {
        const std::string prefix = text.substr(0, cut);
        // Put the masker in the prefix's state through a one-byte-token vocabulary of its own.
        std::vector<std::string> all = bytes;
        for (int b = 0; b < 256; ++b) all.push_back(std::string(1, static_cast<char>(b)));
        std::vector<bool> all_special = special;
        all_special.resize(all.size(), false);
        auto full = std::make_shared<const TokenVocab>(all, all_special);
        TokenMasker masker(g, full, ends);
        bool fed = true;
        for (char c : prefix) {
          fed = fed && masker.Accept(static_cast<int32_t>(bytes.size() + static_cast<uint8_t>(c)));
        }
        ASSERT_TRUE(fed) << prefix;
        std::vector<uint8_t> mask;
        masker.Fill(all.size(), &mask);
        ASSERT_EQ(mask, BruteForce(g, *full, prefix, ends))
            << schema.dump() << " after " << Hex(prefix);
        ++compared;
      }
    }
  }
  EXPECT_GT(compared, 300);
}

TEST(TokenMask, EndTokensOnlyWhenComplete) {
  std::vector<std::string> bytes = {"{", "}", "\"a\"", ":", "1", "<eos>", "{}"};
  std::vector<bool> special = {false, false, false, false, false, true, false};
  auto vocab = std::make_shared<const TokenVocab>(bytes, special);
  TokenMasker m(AnyJsonObjectGrammar(), vocab, {5});
  std::vector<uint8_t> mask;
  EXPECT_EQ(m.Fill(8, &mask), 2u);  // "{" and "{}"
  EXPECT_EQ(mask, (std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 1, 0}));
  EXPECT_FALSE(m.Accept(5));
  EXPECT_FALSE(m.Accept(1));
  EXPECT_TRUE(m.Accept(6));
  EXPECT_EQ(m.Fill(8, &mask), 1u);
  EXPECT_EQ(mask[5], 1);
  EXPECT_TRUE(m.Accept(5));
  EXPECT_EQ(m.Fill(8, &mask), 1u);  // After the end: the end again (ignore_eos).
}

// The per-step cost, printed for bench/RESULTS.md (not asserted: machines differ).
TEST(TokenMask, MeasuresAStep) {
  for (const char* dir : {"/tests/fixtures/mixtral-ref", "/tests/fixtures/tokenizers/qwen2"}) {
    auto tok = Tokenizer::Load(std::string(FMOE_SOURCE_DIR) + dir);
    ASSERT_TRUE(tok.ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto vocab = TokenVocab::FromTokenizer(**tok);
    const auto t1 = std::chrono::steady_clock::now();
    auto g = Compile(Json::parse(R"({"type":"object","properties":{
        "name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]})"));
    for (const char* prefix : {"", "{\"", "{\"name\":\"ab", "{\"name\":\"ab\",\"age\":1"}) {
      TokenMasker m(g, vocab, {0});
      for (char c : std::string(prefix)) {
        auto id = (*tok)->Encode(std::string(1, c), false);
        ASSERT_TRUE(id.ok() && id->size() == 1);
        ASSERT_TRUE(m.Accept((*id)[0]));
      }
      std::vector<uint8_t> mask;
      const int reps = 5;
      size_t allowed = 0;
      const auto s0 = std::chrono::steady_clock::now();
      for (int r = 0; r < reps; ++r) allowed = m.Fill(vocab->size(), &mask);
      const auto s1 = std::chrono::steady_clock::now();
      std::printf("mask %s vocab=%zu after '%s': %zu allowed, %.3f ms/step (vocab trie %.0f ms)\n",
                  dir, vocab->size(), prefix, allowed,
                  std::chrono::duration<double, std::milli>(s1 - s0).count() / reps,
                  std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
  }
}

}  // namespace
}  // namespace fmoe
