// Writes the seed corpus of json_schema_fuzz into the directory named on the command line: the
// schemas clients send (pydantic with $defs and refs, LangChain, OpenAI strict, vLLM's tool_choice
// list), some the compiler refuses, each followed by a NUL and an instance or a walk's bytes.
// Usage: make_json_schema_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_json_schema_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  const std::vector<std::pair<std::string, std::string>> seeds = {
      {R"({"type":"object"})", R"({"a": [1, 2.5e-3, {"b": null}], "c": "\u00e9"})"},
      {R"({"$defs":{"Pet":{"properties":{"kind":{"enum":["cat","dog"],"title":"Kind","type":"string"}},"required":["kind"],"title":"Pet","type":"object"}},"properties":{"name":{"title":"Name","type":"string"},"pets":{"items":{"$ref":"#/$defs/Pet"},"title":"Pets","type":"array"},"age":{"anyOf":[{"type":"integer"},{"type":"null"}],"default":null}},"required":["name","pets"],"title":"Person","type":"object"})",
       R"({"name": "Ann", "pets": [{"kind": "cat"}], "age": null})"},
      {R"({"type":"object","properties":{"city":{"type":"string","minLength":1,"maxLength":20},"unit":{"type":"string","enum":["c","f"]}},"required":["city","unit"],"additionalProperties":false})",
       R"({"city":"Paris","unit":"c"})"},
      {R"({"type":"array","minItems":1,"items":{"anyOf":[{"type":"object","properties":{"name":{"const":"f"},"parameters":{"type":"object","properties":{"x":{"type":"number"}}}},"required":["name","parameters"]}]}})",
       R"([{"name":"f","parameters":{"x":-1.5}}])"},
      {R"({"$ref":"#/definitions/T","definitions":{"T":{"type":"object","properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/definitions/T"}}},"required":["v"]}}})",
       R"({"v":1,"kids":[{"v":2,"kids":[]}]})"},
      {R"({"type":["string","null"],"nullable":true})", R"("x\n\"y\"")"},
      {R"({"oneOf":[{"type":"boolean"},{"type":"integer"}]})", "true"},
      {R"({"type":"object","properties":{"a":{"type":"string","pattern":"^x"}}})", "{}"},
      {R"({"$ref":"#/$defs/A","$defs":{"A":{"$ref":"#/$defs/A"}}})", "{}"},
      {R"({"type":"object","additionalProperties":{"type":"integer"}})", R"({"k": 1, "j": -0})"},
  };
  int i = 0;
  for (const auto& [schema, bytes] : seeds) {
    std::ofstream f(out / ("seed_" + std::to_string(i++)), std::ios::binary);
    f << schema << '\0' << bytes;
  }
  return 0;
}
