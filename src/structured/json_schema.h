// JSON Schema to a regular expression (structured/regex.h) of the JSON texts it allows, for constrained decoding
// (SGLang's `json_schema`, OpenAI's response_format json_schema / json_object). Supported: type (one or a list), enum,
// const, properties (in the schema's order; those not in `required` may be left out), items (false: only []), tuples
// (prefixItems with items for the rest, or drafts 4-7's items array with additionalItems; false: no more elements),
// minItems / maxItems, minLength / maxLength, pattern (the string's unescaped content), anyOf / oneOf, allOf of one
// schema, $ref to #/$defs/... or #/definitions/... or # (recursion followed kRefDepth deep), and the empty schema. An
// object without properties is a map: any keys, the values of additionalProperties, minProperties to maxProperties of
// them. Values nested under no schema (a map without additionalProperties, an array without items, {}) are any JSON
// value nested at most kAnyDepth deep. Whitespace between tokens: any run of spaces, tabs and newlines. minimum /
// maximum / exclusiveMinimum / exclusiveMaximum bound integers (rounded inwards) and numbers (whole, inclusive bounds
// only; a bounded number is written without an exponent). String formats: date, time, date-time, duration, email, uuid,
// ipv4, ipv6, hostname and uri (others are annotations; a pattern wins over a format). multipleOf (whole, up to
// kMaxMultipleOf, or a decimal of at most 9 places: p / 10^m): an integer's multiples within its bounds; a number's,
// without bounds, as an integer part and at most m fraction digits (a whole multipleOf: integers only); a number's
// fractional multipleOf with bounds is an error. Other keywords (uniqueItems, patternProperties, not, ...) are not
// enforced.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

namespace mlaserve::structured {

constexpr int kAnyDepth = 4;
// A recursive schema ($ref to "#" or to a definition that refers back to itself) is followed this many times along
// one path; past that the recursion takes what allows it to end (an empty array, an optional property left out,
// another alternative).
constexpr int kRefDepth = 3;
// A schema whose regex would be longer is an error (a bound on what one request can make the server build).
constexpr size_t kMaxRegexBytes = size_t{1} << 22;
// The largest multipleOf (or its digits, for a decimal) a schema may give: its automaton has up to that many states
// per digit position.
constexpr int64_t kMaxMultipleOf = int64_t{1} << 16;

// Throws mlaserve::Error naming the schema path for what it cannot express (recursion, allOf of several, ...).
// compact: at most one space between tokens (tool-call arguments) instead of any whitespace.
std::string json_schema_regex(const nlohmann::ordered_json& schema, bool compact = false);
// Any JSON object (OpenAI's json_object response format); made once.
const std::string& json_object_regex();
// `text` as a regex matching exactly it.
std::string regex_escape(std::string_view text);

}  // namespace mlaserve::structured
