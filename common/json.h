// The project's one way to include nlohmann::json. Beside the library it declares, when the
// target links fmoe_json (which defines FMOE_JSON_EXTERN), that nlohmann::json and
// nlohmann::ordered_json, their parsers over strings and character buffers and their serializer
// are instantiated once, in common/json_*.cc, instead of in every file that parses or dumps.
// Under the sanitizer build that instantiation cost about 20 s per file that parses (bench/
// RESULTS.md, "Build and test time"). Targets that do not link fmoe_json (the fuzzers' own
// libraries) instantiate implicitly, as the library does by default; both are the same code.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#if defined(FMOE_JSON_EXTERN) || defined(FMOE_JSON_INSTANTIATE)
namespace nlohmann::detail {
// The input adapters json::parse builds from a std::string and from a char buffer, a
// std::string_view or a C string.
using FmoeJsonStringInput = iterator_input_adapter<std::string::const_iterator>;
using FmoeJsonBufferInput = iterator_input_adapter<const char*>;
}  // namespace nlohmann::detail
#endif

// Each common/json_*.cc defines FMOE_JSON_INSTANTIATE to one of these parts: that part's
// declarations below become definitions there, the others stay declarations.
#define FMOE_JSON_PART_JSON 1
#define FMOE_JSON_PART_ORDERED 2
#define FMOE_JSON_PART_PARSE 3

#if defined(FMOE_JSON_INSTANTIATE) && FMOE_JSON_INSTANTIATE == FMOE_JSON_PART_JSON
#define FMOE_JSON_TEMPLATE_JSON template
#else
#define FMOE_JSON_TEMPLATE_JSON extern template
#endif
#if defined(FMOE_JSON_INSTANTIATE) && FMOE_JSON_INSTANTIATE == FMOE_JSON_PART_ORDERED
#define FMOE_JSON_TEMPLATE_ORDERED template
#else
#define FMOE_JSON_TEMPLATE_ORDERED extern template
#endif
#if defined(FMOE_JSON_INSTANTIATE) && FMOE_JSON_INSTANTIATE == FMOE_JSON_PART_PARSE
#define FMOE_JSON_TEMPLATE_PARSE template
#else
#define FMOE_JSON_TEMPLATE_PARSE extern template
#endif

#if defined(FMOE_JSON_EXTERN) || defined(FMOE_JSON_INSTANTIATE)
FMOE_JSON_TEMPLATE_JSON class nlohmann::basic_json<>;
FMOE_JSON_TEMPLATE_JSON class nlohmann::detail::serializer<nlohmann::json>;
FMOE_JSON_TEMPLATE_ORDERED class nlohmann::basic_json<nlohmann::ordered_map>;
FMOE_JSON_TEMPLATE_ORDERED class nlohmann::detail::serializer<nlohmann::ordered_json>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::lexer<nlohmann::json,
                                                       nlohmann::detail::FmoeJsonStringInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::lexer<nlohmann::json,
                                                       nlohmann::detail::FmoeJsonBufferInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::parser<nlohmann::json,
                                                        nlohmann::detail::FmoeJsonStringInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::parser<nlohmann::json,
                                                        nlohmann::detail::FmoeJsonBufferInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::json_sax_dom_parser<nlohmann::json>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::json_sax_dom_callback_parser<nlohmann::json>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::lexer<nlohmann::ordered_json,
                                                       nlohmann::detail::FmoeJsonStringInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::lexer<nlohmann::ordered_json,
                                                       nlohmann::detail::FmoeJsonBufferInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::parser<nlohmann::ordered_json,
                                                        nlohmann::detail::FmoeJsonStringInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::parser<nlohmann::ordered_json,
                                                        nlohmann::detail::FmoeJsonBufferInput>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::json_sax_dom_parser<nlohmann::ordered_json>;
FMOE_JSON_TEMPLATE_PARSE class nlohmann::detail::json_sax_dom_callback_parser<
    nlohmann::ordered_json>;
#endif

#undef FMOE_JSON_TEMPLATE_JSON
#undef FMOE_JSON_TEMPLATE_ORDERED
#undef FMOE_JSON_TEMPLATE_PARSE
