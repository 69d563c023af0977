#include "common/text/json_schema.h"

#include <algorithm>
#include <array>
#include <map>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;
using Kind = JsonGrammar::Kind;

// Keywords that narrow the accepted language and that the compiler does not implement: refused,
// so that no output is accepted that the schema rejects.
constexpr std::array<std::string_view, 26> kRefused = {"pattern",
                                                       "minimum",
                                                       "maximum",
                                                       "exclusiveMinimum",
                                                       "exclusiveMaximum",
                                                       "multipleOf",
                                                       "uniqueItems",
                                                       "contains",
                                                       "minContains",
                                                       "maxContains",
                                                       "prefixItems",
                                                       "additionalItems",
                                                       "unevaluatedItems",
                                                       "patternProperties",
                                                       "propertyNames",
                                                       "minProperties",
                                                       "maxProperties",
                                                       "dependentRequired",
                                                       "dependentSchemas",
                                                       "dependencies",
                                                       "unevaluatedProperties",
                                                       "not",
                                                       "if",
                                                       "then",
                                                       "else",
                                                       "$dynamicRef"};

// Keywords that give a schema its structure; a $ref or allOf beside them is refused (merging
// schemas is not implemented).
constexpr std::array<std::string_view, 16> kStructural = {
    "type",      "properties", "required", "additionalProperties",
    "items",     "enum",       "const",    "anyOf",
    "oneOf",     "allOf",      "minItems", "maxItems",
    "minLength", "maxLength",  "nullable", "$ref"};

std::string QuoteName(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q += '"';
  q += s;
  q += '"';
  return q;
}

class Compiler {
 public:
  explicit Compiler(const Json& root) : root_(root) {}

  Result<std::shared_ptr<const JsonGrammar>> Run() {
    auto root = Compile(root_, "", 0);
    if (!root.ok()) return root.status();
    g_.root = *root;
    FMOE_RETURN_IF_ERROR(CheckCycles());
    return std::shared_ptr<const JsonGrammar>(std::make_shared<JsonGrammar>(std::move(g_)));
  }

  // Any JSON value: anyOf [object of anything, array of anything, string, number, literals].
  Result<int32_t> Any() {
    if (any_ >= 0) return any_;
    FMOE_ASSIGN_OR_RETURN(any_, New(Kind::kAnyOf, "(any)"));
    JsonGrammar::Node object{.kind = Kind::kObject, .additional = any_};
    JsonGrammar::Node array{.kind = Kind::kArray, .items = any_};
    std::vector<int32_t> alts;
    for (JsonGrammar::Node* n : {&object, &array}) {
      FMOE_ASSIGN_OR_RETURN(int32_t id, New(n->kind, "(any)"));
      g_.nodes[id] = std::move(*n);
      alts.push_back(id);
    }
    FMOE_ASSIGN_OR_RETURN(int32_t str, New(Kind::kString, "(any)"));
    FMOE_ASSIGN_OR_RETURN(int32_t num, New(Kind::kNumber, "(any)"));
    FMOE_ASSIGN_OR_RETURN(int32_t lit, Literal({"true", "false", "null"}, "(any)"));
    alts.insert(alts.end(), {str, num, lit});
    g_.nodes[any_].alts = std::move(alts);
    return any_;
  }

 private:
  Status Error(const std::string& path, const std::string& what) {
    return InvalidArgument("schema " + (path.empty() ? std::string("/") : path) + ": " + what);
  }

  Result<int32_t> New(Kind kind, const std::string& path) {
    if (g_.nodes.size() >= kMaxGrammarNodes) {
      return Error(path, "the schema is too large (more than " + std::to_string(kMaxGrammarNodes) +
                             " grammar nodes)");
    }
    g_.nodes.push_back(JsonGrammar::Node{.kind = kind});
    paths_.push_back(path);
    return static_cast<int32_t>(g_.nodes.size() - 1);
  }

  int32_t NewTrieNode() {
    g_.tries.emplace_back();
    return static_cast<int32_t>(g_.tries.size() - 1);
  }

  // Inserts text into the trie at root; returns its last node.
  Result<int32_t> Insert(int32_t root, std::string_view text, const std::string& path) {
    literal_bytes_ += text.size();
    if (literal_bytes_ > kMaxLiteralBytes) {
      return Error(path, "enum, const and property names exceed " +
                             std::to_string(kMaxLiteralBytes) + " bytes");
    }
    return g_.AddPath(root, text);
  }

  Result<int32_t> Literal(const std::vector<std::string>& texts, const std::string& path) {
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kLiteral, path));
    const int32_t root = NewTrieNode();
    for (const std::string& t : texts) {
      FMOE_ASSIGN_OR_RETURN(int32_t end, Insert(root, t, path));
      g_.tries[end].terminal = 0;
    }
    g_.nodes[id].trie_root = root;
    return id;
  }

  static bool Has(const Json& s, std::string_view key) { return s.contains(std::string(key)); }

  Result<uint32_t> Count(const Json& s, const char* key, const std::string& path) {
    const Json& v = s.at(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > UINT32_MAX) {
      return Error(path, QuoteName(key) + " must be a non-negative integer");
    }
    return static_cast<uint32_t>(v.get<int64_t>());
  }

  Result<int32_t> Compile(const Json& s, const std::string& path, uint32_t depth) {
    if (depth > kMaxSchemaDepth) {
      return Error(path, "nested deeper than " + std::to_string(kMaxSchemaDepth));
    }
    if (s.is_boolean()) {
      if (s.get<bool>()) return Any();
      return Error(path, "the schema false accepts nothing");
    }
    if (!s.is_object()) return Error(path, "a schema must be an object or a boolean");
    for (std::string_view kw : kRefused) {
      if (Has(s, kw)) return Error(path, QuoteName(kw) + " is not supported");
    }
    auto structural_beside = [&](std::string_view self) -> std::optional<std::string_view> {
      for (std::string_view kw : kStructural) {
        if (kw != self && Has(s, kw)) return kw;
      }
      return std::nullopt;
    };
    if (Has(s, "$ref")) {
      if (auto other = structural_beside("$ref")) {
        return Error(path, "\"$ref\" beside " + QuoteName(*other) + " is not supported");
      }
      if (!s.at("$ref").is_string()) return Error(path, "\"$ref\" must be a string");
      return Ref(s.at("$ref").get<std::string>(), path, depth);
    }
    if (Has(s, "allOf")) {
      const Json& all = s.at("allOf");
      if (!all.is_array() || all.size() != 1) {
        return Error(path, "\"allOf\" is supported with exactly one schema");
      }
      if (auto other = structural_beside("allOf")) {
        return Error(path, "\"allOf\" beside " + QuoteName(*other) + " is not supported");
      }
      return Compile(all[0], path + "/allOf/0", depth + 1);
    }
    const bool nullable = Has(s, "nullable") && s.at("nullable") == true;
    FMOE_ASSIGN_OR_RETURN(int32_t node, CompileNotNull(s, path, depth));
    if (!nullable) return node;
    FMOE_ASSIGN_OR_RETURN(int32_t null, Literal({"null"}, path + "/nullable"));
    FMOE_ASSIGN_OR_RETURN(int32_t either, New(Kind::kAnyOf, path));
    g_.nodes[either].alts = {node, null};
    return either;
  }

  Result<int32_t> CompileNotNull(const Json& s, const std::string& path, uint32_t depth) {
    std::vector<std::string> types;
    if (Has(s, "type")) {
      const Json& t = s.at("type");
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const Json& e : t) {
          if (!e.is_string()) return Error(path, "\"type\" entries must be strings");
          types.push_back(e.get<std::string>());
        }
      } else {
        return Error(path, "\"type\" must be a string or a non-empty array of strings");
      }
    }
    for (const char* key : {"enum", "const"}) {
      if (!Has(s, key)) continue;
      std::vector<std::string> texts;
      const Json& v = s.at(key);
      if (std::string_view(key) == "enum") {
        if (!v.is_array() || v.empty()) return Error(path, "\"enum\" must be a non-empty array");
        for (const Json& e : v) {
          if (TypeAllows(types, e)) texts.push_back(e.dump());
        }
      } else if (TypeAllows(types, v)) {
        texts.push_back(v.dump());
      }
      if (texts.empty()) return Error(path, QuoteName(key) + " has no value of the given \"type\"");
      return Literal(texts, path + "/" + key);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!Has(s, key)) continue;
      const Json& alts = s.at(key);
      if (!alts.is_array() || alts.empty()) {
        return Error(path, QuoteName(key) + " must be a non-empty array");
      }
      for (std::string_view kw : kStructural) {
        if (kw != key && kw != "nullable" && Has(s, kw)) {
          return Error(path, QuoteName(key) + " beside " + QuoteName(kw) + " is not supported");
        }
      }
      std::vector<int32_t> ids;
      for (size_t i = 0; i < alts.size(); ++i) {
        FMOE_ASSIGN_OR_RETURN(
            int32_t id, Compile(alts[i], path + "/" + key + "/" + std::to_string(i), depth + 1));
        ids.push_back(id);
      }
      FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kAnyOf, path));
      g_.nodes[id].alts = std::move(ids);
      return id;
    }
    if (types.empty()) {
      if (Has(s, "properties") || Has(s, "required") || Has(s, "additionalProperties")) {
        types.push_back("object");
      } else if (Has(s, "items") || Has(s, "minItems") || Has(s, "maxItems")) {
        types.push_back("array");
      } else if (Has(s, "minLength") || Has(s, "maxLength")) {
        types.push_back("string");
      } else {
        return Any();
      }
    }
    std::vector<int32_t> ids;
    for (const std::string& type : types) {
      FMOE_ASSIGN_OR_RETURN(int32_t id, Typed(s, type, path, depth));
      ids.push_back(id);
    }
    if (ids.size() == 1) return ids[0];
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kAnyOf, path));
    g_.nodes[id].alts = std::move(ids);
    return id;
  }

  static bool TypeAllows(const std::vector<std::string>& types, const Json& v) {
    if (types.empty()) return true;
    for (const std::string& t : types) {
      if ((t == "object" && v.is_object()) || (t == "array" && v.is_array()) ||
          (t == "string" && v.is_string()) || (t == "number" && v.is_number()) ||
          (t == "integer" && v.is_number_integer()) || (t == "boolean" && v.is_boolean()) ||
          (t == "null" && v.is_null())) {
        return true;
      }
    }
    return false;
  }

  Result<int32_t> Typed(const Json& s, const std::string& type, const std::string& path,
                        uint32_t depth) {
    if (type == "object") return Object(s, path, depth);
    if (type == "array") return Array(s, path, depth);
    if (type == "string") {
      FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kString, path));
      uint32_t lo = 0, hi = UINT32_MAX;
      if (Has(s, "minLength")) {
        FMOE_ASSIGN_OR_RETURN(lo, Count(s, "minLength", path));
      }
      if (Has(s, "maxLength")) {
        FMOE_ASSIGN_OR_RETURN(hi, Count(s, "maxLength", path));
      }
      if (lo > hi) return Error(path, "\"minLength\" is more than \"maxLength\"");
      g_.nodes[id].min_len = lo;
      g_.nodes[id].max_len = hi;
      return id;
    }
    if (type == "number") return New(Kind::kNumber, path);
    if (type == "integer") return New(Kind::kInteger, path);
    if (type == "boolean") return Literal({"true", "false"}, path);
    if (type == "null") return Literal({"null"}, path);
    return Error(path, "unknown \"type\" " + QuoteName(type));
  }

  Result<int32_t> Object(const Json& s, const std::string& path, uint32_t depth) {
    std::vector<JsonGrammar::Property> props;
    if (Has(s, "properties")) {
      const Json& p = s.at("properties");
      if (!p.is_object()) return Error(path, "\"properties\" must be an object");
      if (p.size() > kMaxProperties) {
        return Error(path + "/properties",
                     "more than " + std::to_string(kMaxProperties) + " properties");
      }
      for (const auto& [name, sub] : p.items()) {
        for (char c : name) {
          if (c == '"' || c == '\\' || static_cast<uint8_t>(c) < 0x20) {
            return Error(path + "/properties",
                         "property name " + Json(name).dump() + " needs escaping in JSON");
          }
        }
        FMOE_ASSIGN_OR_RETURN(int32_t id, Compile(sub, path + "/properties/" + name, depth + 1));
        props.push_back({name, id});
      }
    }
    uint64_t required = 0;
    if (Has(s, "required")) {
      const Json& r = s.at("required");
      if (!r.is_array()) return Error(path, "\"required\" must be an array of strings");
      for (const Json& name : r) {
        if (!name.is_string()) return Error(path, "\"required\" must be an array of strings");
        auto it = std::find_if(props.begin(), props.end(),
                               [&](const auto& p) { return p.name == name.get<std::string>(); });
        if (it == props.end()) {
          return Error(path, "required property " + name.dump() + " is not in \"properties\"");
        }
        required |= uint64_t{1} << (it - props.begin());
      }
    }
    int32_t additional = props.empty() ? -2 : -1;  // -2: any value.
    if (Has(s, "additionalProperties")) {
      const Json& a = s.at("additionalProperties");
      if (a.is_boolean()) {
        additional = a.get<bool>() ? -2 : -1;
      } else {
        FMOE_ASSIGN_OR_RETURN(additional, Compile(a, path + "/additionalProperties", depth + 1));
      }
    }
    if (additional == -2) {
      FMOE_ASSIGN_OR_RETURN(additional, Any());
    }
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kObject, path));
    int32_t trie = -1;
    if (!props.empty()) {
      trie = NewTrieNode();
      for (size_t i = 0; i < props.size(); ++i) {
        const uint64_t bit = uint64_t{1} << i;
        g_.tries[trie].below |= bit;
        int32_t at = trie;
        FMOE_ASSIGN_OR_RETURN(int32_t end, Insert(trie, props[i].name, path));
        g_.tries[end].terminal = static_cast<int32_t>(i);
        for (char c : props[i].name) {  // Mark the path.
          at = g_.Child(at, static_cast<uint8_t>(c));
          g_.tries[at].below |= bit;
        }
      }
    }
    JsonGrammar::Node& n = g_.nodes[id];
    n.props = std::move(props);
    n.required_mask = required;
    n.additional = additional;
    n.key_trie = trie;
    return id;
  }

  Result<int32_t> Array(const Json& s, const std::string& path, uint32_t depth) {
    int32_t items = -1;
    if (Has(s, "items")) {
      if (s.at("items").is_array()) {
        return Error(path, "\"items\" as an array (tuples) is not supported");
      }
      FMOE_ASSIGN_OR_RETURN(items, Compile(s.at("items"), path + "/items", depth + 1));
    } else {
      FMOE_ASSIGN_OR_RETURN(items, Any());
    }
    uint32_t lo = 0, hi = UINT32_MAX;
    if (Has(s, "minItems")) {
      FMOE_ASSIGN_OR_RETURN(lo, Count(s, "minItems", path));
    }
    if (Has(s, "maxItems")) {
      FMOE_ASSIGN_OR_RETURN(hi, Count(s, "maxItems", path));
    }
    if (lo > hi) return Error(path, "\"minItems\" is more than \"maxItems\"");
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kArray, path));
    g_.nodes[id].items = items;
    g_.nodes[id].min_items = lo;
    g_.nodes[id].max_items = hi;
    return id;
  }

  Result<int32_t> Ref(const std::string& ref, const std::string& path, uint32_t depth) {
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    if (ref.empty() || ref[0] != '#' || (ref.size() > 1 && ref[1] != '/')) {
      return Error(path, "\"$ref\" " + QuoteName(ref) + " is not a local JSON pointer (#/...)");
    }
    const Json* at = &root_;
    size_t pos = 1;
    while (pos < ref.size()) {
      const size_t next = std::min(ref.find('/', pos + 1), ref.size());
      std::string token = ref.substr(pos + 1, next - pos - 1);
      std::string key;
      for (size_t i = 0; i < token.size(); ++i) {
        if (token[i] == '~' && i + 1 < token.size() &&
            (token[i + 1] == '0' || token[i + 1] == '1')) {
          key += token[i + 1] == '0' ? '~' : '/';
          ++i;
        } else {
          key += token[i];
        }
      }
      if (at->is_object() && at->contains(key)) {
        at = &at->at(key);
      } else if (at->is_array() && !key.empty() &&
                 key.find_first_not_of("0123456789") == std::string::npos && key.size() < 9 &&
                 std::stoul(key) < at->size()) {
        at = &at->at(std::stoul(key));
      } else {
        return Error(path, "\"$ref\" " + QuoteName(ref) + " points to nothing");
      }
      pos = next;
    }
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kRef, path));
    refs_.emplace(ref, id);
    FMOE_ASSIGN_OR_RETURN(int32_t target, Compile(*at, ref.substr(1), depth + 1));
    g_.nodes[id].target = target;
    return id;
  }

  // A cycle through kRef and kAnyOf edges consumes no input: the matcher would loop.
  Status CheckCycles() {
    std::vector<uint8_t> color(g_.nodes.size(), 0);  // 0 new, 1 on the path, 2 done.
    for (size_t start = 0; start < g_.nodes.size(); ++start) {
      if (color[start] != 0) continue;
      std::vector<std::pair<int32_t, size_t>> stack{{static_cast<int32_t>(start), 0}};
      color[start] = 1;
      while (!stack.empty()) {
        auto& [node, edge] = stack.back();
        const JsonGrammar::Node& n = g_.nodes[node];
        std::vector<int32_t> edges = n.kind == Kind::kRef     ? std::vector<int32_t>{n.target}
                                     : n.kind == Kind::kAnyOf ? n.alts
                                                              : std::vector<int32_t>{};
        if (edge == edges.size()) {
          color[node] = 2;
          stack.pop_back();
          continue;
        }
        const int32_t next = edges[edge++];
        if (next < 0) continue;
        if (color[next] == 1) return Error(paths_[next], "$ref cycle that consumes no input");
        if (color[next] == 0) {
          color[next] = 1;
          stack.push_back({next, 0});
        }
      }
    }
    return Status::Ok();
  }

  const Json& root_;
  JsonGrammar g_;
  std::vector<std::string> paths_;
  std::map<std::string, int32_t> refs_;
  int32_t any_ = -1;
  size_t literal_bytes_ = 0;
};

// How deep `root` nests, counted without recursion (enum and const values are serialised by
// recursive code, and a document of a megabyte could nest half a million deep).
size_t Depth(const Json& root) {
  size_t deepest = 0;
  std::vector<std::pair<const Json*, size_t>> stack{{&root, 0}};
  while (!stack.empty()) {
    const auto [v, depth] = stack.back();
    stack.pop_back();
    deepest = std::max(deepest, depth);
    if (v->is_structured()) {
      for (const Json& child : *v) stack.push_back({&child, depth + 1});
    }
  }
  return deepest;
}

}  // namespace

std::string TokenTerminalBytes(int32_t id) {
  std::string out(1, static_cast<char>(kTokenTerminalLead));
  auto bits = static_cast<uint32_t>(id);
  for (size_t i = 1; i < kTokenTerminalSize; ++i, bits >>= 6) {
    out += static_cast<char>(0x80 | (bits & 0x3F));
  }
  return out;
}

int32_t JsonGrammar::AddPath(int32_t root, std::string_view text) {
  int32_t at = root;
  for (char c : text) {
    const auto b = static_cast<uint8_t>(c);
    int32_t next = Child(at, b);
    if (next < 0) {
      tries.emplace_back();
      next = static_cast<int32_t>(tries.size() - 1);
      auto& edges = tries[at].next;
      edges.insert(std::lower_bound(edges.begin(), edges.end(), std::pair{b, int32_t{-1}}),
                   {b, next});
    }
    at = next;
  }
  return at;
}

int32_t JsonGrammar::Child(int32_t trie, uint8_t byte) const {
  for (const auto& [b, next] : tries[trie].next) {
    if (b == byte) return next;
    if (b > byte) break;
  }
  return -1;
}

Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchema(std::string_view schema_json) {
  if (schema_json.size() > kMaxSchemaBytes) {
    return InvalidArgument("schema: larger than " + std::to_string(kMaxSchemaBytes) + " bytes");
  }
  Json schema = Json::parse(schema_json, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return InvalidArgument("schema: not valid JSON");
  return CompileJsonSchemaValue(schema);
}

Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchemaValue(const Json& schema) {
  if (Depth(schema) > kMaxJsonDepth) {
    return InvalidArgument("schema: nested deeper than " + std::to_string(kMaxJsonDepth) +
                           " JSON levels");
  }
  try {
    return Compiler(schema).Run();
  } catch (const std::exception& e) {  // std::bad_alloc, a JSON type error missed above.
    return InvalidArgument(std::string("schema: ") + e.what());
  }
}

std::shared_ptr<const JsonGrammar> AnyJsonObjectGrammar() {
  static const std::shared_ptr<const JsonGrammar> grammar =
      *CompileJsonSchema(R"({"type": "object"})");
  return grammar;
}

}  // namespace fmoe
