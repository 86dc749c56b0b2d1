// Constrained decoding's automata (src/structured): the regex DFA against std::regex on ASCII patterns and by hand on
// UTF-8, the JSON-schema regexes on valid and invalid documents, and a regex constraint's token masks against a
// brute-force walk of every token.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>
#include <numeric>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "input_stack.h"
#include "structured/ebnf.h"
#include "structured/json_schema.h"
#include "structured/regex.h"
#include "structured/token_constraint.h"

using namespace mlaserve;
using namespace mlaserve::structured;
using mlaserve::test::on_input_stack;

namespace {

bool full_match(const std::string& pattern, const std::string& text) {
  Dfa d(compile_regex(pattern));
  return d.matches(text);
}

std::string utf8(uint32_t cp) {
  std::string s;
  append_utf8(s, cp);
  return s;
}

}  // namespace

// Whole-string matches of ASCII patterns equal std::regex_match's on random strings (and on each pattern's own
// samples, so that matches are not all misses).
TEST(Regex, AsciiPatternsMatchLikeStdRegex) {
  const std::vector<std::string> patterns = {
      "a+b*",          "(ab|cd)*e?",     "[a-c]{2,4}",         "x(y|z){0,3}",     "[^ab]+",
      "\\d{1,3}(\\.\\d+)?", "a|b|",       "(a*)*b",             "(?:ab){2}c{1,}",  "[a\\-c]+",
      "\\w+\\s?\\w*",  ".{3}",           "a{2,}b{,2}",         "(a|ab)(c|bcd)",   "a{x}b",
      "\\.\\*\\+",     "(a?){3}a{3}",    "[0-9a-fA-F]{2}x",    "ba*|ab*",         "(?P<n>ab)+",
  };
  std::mt19937 rng(7);
  const std::string alphabet = "abcdexyz0123. -*+]{},";
  for (const std::string& p : patterns) {
    SCOPED_TRACE(p);
    const std::regex re(p == "(?P<n>ab)+"   ? "(ab)+"        // std::regex's spellings of the same language
                        : p == "a{2,}b{,2}" ? "a{2,}b{0,2}"
                        : p == "a{x}b"      ? "a\\{x\\}b"
                                            : p);
    Dfa d(compile_regex(p));
    int hits = 0;
    for (int i = 0; i < 3000; ++i) {
      std::string s;
      const int n = static_cast<int>(rng() % 8);
      for (int k = 0; k < n; ++k) s += alphabet[rng() % alphabet.size()];
      if (i % 3 == 0) {  // mostly letters of the pattern itself
        s.clear();
        for (int k = 0; k < n; ++k) s += p[rng() % p.size()];
      }
      const bool want = std::regex_match(s, re);
      hits += want;
      ASSERT_EQ(d.matches(s), want) << "'" << s << "'";
    }
    if (p != "[a\\-c]+" && p != "\\.\\*\\+" && p != "(a|ab)(c|bcd)" && p != "(?:ab){2}c{1,}" &&
        p != "[0-9a-fA-F]{2}x" && p != "a{x}b") {
      EXPECT_GT(hits, 0);
    }
  }
  EXPECT_TRUE(full_match("\\.\\*\\+", ".*+"));
  EXPECT_TRUE(full_match("(a|ab)(c|bcd)", "abcd"));
  EXPECT_TRUE(full_match("(?:ab){2}c{1,}", "ababcc"));
  EXPECT_TRUE(full_match("^[0-9a-fA-F]{2}x$", "aFx"));
  EXPECT_TRUE(full_match("a{x}b", "a{x}b"));  // not a count: literal braces, as Python reads them
  EXPECT_TRUE(full_match("[]a]+", "]a]"));   // a leading ']' is a member
}

// Code points beyond ASCII: classes and '.' match whole UTF-8 characters of every length, never part of one.
TEST(Regex, AppendUtf8WritesTheEncodings) {
  EXPECT_EQ(utf8('A'), "A");
  EXPECT_EQ(utf8(0xE9), "\xC3\xA9");
  EXPECT_EQ(utf8(0x7FF), "\xDF\xBF");
  EXPECT_EQ(utf8(0x20AC), "\xE2\x82\xAC");
  EXPECT_EQ(utf8(0xFFFF), "\xEF\xBF\xBF");
  EXPECT_EQ(utf8(0x1F600), "\xF0\x9F\x98\x80");
  EXPECT_EQ(utf8(0x10FFFF), "\xF4\x8F\xBF\xBF");
}

TEST(Regex, Utf8ClassesMatchWholeCharacters) {
  EXPECT_TRUE(full_match("[α-ω]+", "αβγω"));
  EXPECT_FALSE(full_match("[α-ω]+", "abc"));
  EXPECT_FALSE(full_match("[α-ω]+", "Ω"));
  EXPECT_TRUE(full_match(".", "😀"));
  EXPECT_TRUE(full_match(".", "é"));
  EXPECT_FALSE(full_match(".", "\n"));
  EXPECT_FALSE(full_match(".", "\x80"));        // a lone continuation byte
  EXPECT_FALSE(full_match(".", "\xED\xA0\x80"));  // an encoded surrogate
  EXPECT_TRUE(full_match("[^a]", "é"));
  EXPECT_FALSE(full_match("[^a]", "a"));
  EXPECT_TRUE(full_match("\\u00e9\\x41", "éA"));
  EXPECT_FALSE(full_match("[^a-zc-d]", "m"));  // a negated class of overlapping ranges
  EXPECT_FALSE(full_match("[^\\w\\d]", "5"));
  EXPECT_TRUE(full_match("[^\\w\\d]", "-"));
  EXPECT_TRUE(full_match("a\\Cb", "a\xFF" "b"));  // \C: the raw byte 0xFF (special tokens' marker), nothing else
  EXPECT_FALSE(full_match("a\\Cb", "a\u00FFb"));
  EXPECT_FALSE(full_match(".", "\xFF"));
  // Ranges across encoded lengths: every sampled code point in [lo, hi] matches, its neighbours outside do not.
  for (auto [lo, hi] : std::vector<std::pair<uint32_t, uint32_t>>{{0x70, 0x7F0}, {0x7F0, 0x10FF0}, {0xFFF0, 0x10FFFF},
                                                                    {0x800, 0xFFFF}, {0x4E00, 0x9FFF}}) {
    const std::string p = "[" + utf8(lo) + "-" + utf8(hi) + "]";
    Dfa d(compile_regex(p));
    std::mt19937 rng(lo);
    for (int i = 0; i < 2000; ++i) {
      uint32_t cp = lo + rng() % (hi - lo + 1);
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      ASSERT_TRUE(d.matches(utf8(cp))) << std::hex << cp << " in " << lo << "-" << hi;
    }
    for (uint32_t cp : {lo - 1, hi + 1, lo + 0x40000})
      if (cp < lo || cp > hi)
        if (cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF)) {
          EXPECT_FALSE(d.matches(utf8(cp))) << std::hex << cp;
        }
  }
}

// What the subset leaves out is an error that names the pattern and the place, not a wrong automaton.
// The absent operator (?~...) of literals: any text (newlines, other scripts) holding none of them, a prefix of one
// at the end included; overlapping literals (Aho-Corasick's suffix links), escapes, multi-byte code points; inside a
// larger pattern it ends where the next part begins.
TEST(Regex, AbsentOperatorIsTextWithoutTheLiterals) {
  for (const char* ok : {"", "abc", "<functio", "a <b>\nc\u00e9 \u4e2d", "<<functio", "<function", "xx<tool"})
    EXPECT_TRUE(full_match("(?~<function=|<tool_call>)", ok)) << ok;
  for (const char* bad : {"<function=", "a<function=x", "<tool_call>", "x<tool_call><function=", "<<function="})
    EXPECT_FALSE(full_match("(?~<function=|<tool_call>)", bad)) << bad;
  for (const char* ok : {"ab", "aab", "ba", "baab", "a b a"}) EXPECT_TRUE(full_match("(?~aba|bb)", ok)) << ok;
  for (const char* bad : {"ababa", "aaba", "abb", "xbbx", "abba"}) EXPECT_FALSE(full_match("(?~aba|bb)", bad)) << bad;
  EXPECT_TRUE(full_match("(?~\\.\\x41|\u00e9t\u00e9)x", "a.Bx"));
  EXPECT_FALSE(full_match("(?~\\.\\x41|\u00e9t\u00e9)x", "a.Ax"));
  EXPECT_FALSE(full_match("(?~\\.\\x41|\u00e9t\u00e9)x", "l'\u00e9t\u00e9x"));
  EXPECT_TRUE(full_match("((?~END)END)*(?~END)", "aENDbENDc"));  // each free part ends at the next literal
  EXPECT_TRUE(full_match("(?~END)END", "abEND"));
  EXPECT_FALSE(full_match("(?~END)END", "aENDbEND"));
  for (const char* bad : {"(?~)", "(?~a||b)", "(?~a[b])", "(?~a.)", "(?~\\d)", "(?~ab", "(?~a*)"})
    EXPECT_THROW(compile_regex(bad), Error) << bad;
  EXPECT_NO_THROW(compile_regex("(?~" + std::string(1000, 'a') + ")"));
  EXPECT_THROW(compile_regex("(?~" + std::string(2000, 'a') + ")"), Error);  // a bound on what a request can build
}

TEST(Regex, UnsupportedOrBadPatternsAreErrors) {
  for (const char* p : {"(a", "a)", "*a", "a\\1", "(?=a)b", "a{3,2}", "[b-a]", "a^", "$a", "[abc", "\\bword",
                        "(?i)a", "\\xZZ", "a{0,4294967296}", "a{12345678}"}) {
    try {
      compile_regex(p);
      ADD_FAILURE() << p << " compiled";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(compile_regex("(a{1000}){1000}", 100000), Error);  // too many states
  // A '{' that starts no quantifier is a literal (as Python reads it).
  for (const char* p : {"a{", "a{,}", "a{x}", "{1}"}) EXPECT_TRUE(Dfa(compile_regex(p)).matches(p)) << p;
}

// compile_regex_shared: a pattern compiled lately is the same automaton (not compiled again), from several threads
// too; it is the pattern's (it matches what compile_regex's matches); the least recently used of more than
// kCompiledRegexes patterns is compiled anew; bad patterns throw every time and are not kept.
TEST(Regex, SharedCompilesKeepTheLatestPatterns) {
  const std::string first = "shared-0[a-c]+";
  const auto a = compile_regex_shared(first);
  EXPECT_EQ(compile_regex_shared(first), a);
  EXPECT_TRUE(Dfa(*a).matches("shared-0abc"));
  EXPECT_FALSE(Dfa(*a).matches("shared-0abd"));
  std::vector<std::shared_ptr<const Nfa>> got(4);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < got.size(); ++t) threads.emplace_back([&, t] { got[t] = compile_regex_shared(first); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) EXPECT_EQ(g, a);
  const auto b = compile_regex_shared("shared-1[a-c]+");
  EXPECT_NE(b, a);
  EXPECT_EQ(compile_regex_shared(first), a);  // now the most recently used: b is the oldest
  for (size_t i = 2; i < kCompiledRegexes + 1; ++i) {
    std::string p = "shared-";
    p += std::to_string(i);
    compile_regex_shared(p);
  }
  EXPECT_EQ(compile_regex_shared(first), a);   // used last before the kCompiledRegexes - 1 new ones: kept
  EXPECT_NE(compile_regex_shared("shared-1[a-c]+"), b);  // dropped, compiled again
  for (int i = 0; i < 2; ++i) EXPECT_THROW(compile_regex_shared("(shared"), Error);
  // Patterns of many states: the oldest go first once the states kept pass kCompiledRegexStates; the newest stays.
  const auto big1 = compile_regex_shared("(a{1000}){450}");  // ~900k states: two fit in kCompiledRegexStates
  const auto big2 = compile_regex_shared("(b{1000}){450}");
  ASSERT_GT(big1->states.size() + big2->states.size(), kCompiledRegexStates / 2);
  EXPECT_EQ(compile_regex_shared("(a{1000}){450}"), big1);
  const auto big3 = compile_regex_shared("(c{1000}){450}");
  EXPECT_EQ(compile_regex_shared("(c{1000}){450}"), big3);
  EXPECT_NE(compile_regex_shared("(b{1000}){450}"), big2);  // the least recently used of the three
  EXPECT_NE(compile_regex_shared(first), a);                 // older still
}

// (?%k:...): what the group matches whose digits (other characters skipped) make a multiple of k, against the
// arithmetic (brute force over 0-3000 and long numbers); bad moduli and unclosed groups are errors.
TEST(Regex, MultipleGroupsMatchMultiplesOfK) {
  auto mod = [](const std::string& digits, int64_t k) {
    int64_t r = 0;
    for (char c : digits)
      if (c >= '0' && c <= '9') r = (r * 10 + (c - '0')) % k;
    return r;
  };
  for (int64_t k : {1, 2, 3, 7, 12, 25, 1000, 65536}) {
    Dfa d(compile_regex("(?%" + std::to_string(k) + ":0|[1-9][0-9]*)"));
    for (int64_t n = 0; n <= 3000; ++n) EXPECT_EQ(d.matches(std::to_string(n)), n % k == 0) << k << " " << n;
    for (const char* big : {"123456789012345678901234567890", "98765432109876543210", "65536000", "1000000000000"})
      EXPECT_EQ(d.matches(big), mod(big, k) == 0) << k << " " << big;
    for (const char* bad : {"", "00", "07", "-7", "7a"}) EXPECT_FALSE(d.matches(bad)) << k << " " << bad;
  }
  EXPECT_TRUE(full_match("(?%3:[0-9]+\\.[0-9]+)", "1.2"));   // 12
  EXPECT_FALSE(full_match("(?%3:[0-9]+\\.[0-9]+)", "1.3"));
  EXPECT_TRUE(full_match("(?%3:[0-9]+\\.[0-9]+)", "0.03"));
  EXPECT_TRUE(full_match("x(?%4:[0-9]*)y", "xy"));  // no digits: 0
  EXPECT_TRUE(full_match("x(?%4:[0-9]*)y", "x0012y"));
  EXPECT_FALSE(full_match("x(?%4:[0-9]*)y", "x10y"));
  EXPECT_TRUE(full_match("-?(?%7:[0-9]+)(,(?%7:[0-9]+))*", "-14,21,0,70"));
  EXPECT_FALSE(full_match("-?(?%7:[0-9]+)(,(?%7:[0-9]+))*", "14,22"));
  for (const char* p : {"(?%0:1)", "(?%:1)", "(?%5", "(?%5:1", "(?%99999999:1)", "(?%a:1)", "(?%07:1)"})
    EXPECT_THROW(compile_regex(p), Error) << p;
}

namespace {

bool schema_match(const std::string& schema, const std::string& doc) {
  return full_match(json_schema_regex(nlohmann::ordered_json::parse(schema)), doc);
}

}  // namespace

// JSON Schema's regexes: documents the schema allows match (whitespace anywhere between tokens), documents it
// does not (wrong types, missing or reordered properties, bad counts) do not.
TEST(JsonSchema, RegexMatchesTheSchemasDocuments) {
  const std::string person = R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
      "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
      "score": {"type": ["number", "null"]}, "ok": {"type": "boolean"}}, "required": ["name"]})";
  EXPECT_TRUE(schema_match(person, R"({"name": "Ann", "age": 31, "tags": ["a", 3], "score": -1.5e3, "ok": true})"));
  EXPECT_TRUE(schema_match(person, "{\n  \"name\":\"\\u00e9\\n\",\n  \"age\": -0,\"tags\":[],\"score\":null,"
                                   "\"ok\":false\n}"));
  EXPECT_FALSE(schema_match(person, R"({"age": 31, "name": "Ann", "tags": [], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Annabel", "age": 31, "tags": [], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Ann", "age": 3.5, "tags": [], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Ann", "age": 01, "tags": [], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Ann", "age": 1, "tags": ["c"], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Ann", "age": 1, "tags": ["a","a","a"], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "A"n", "age": 1, "tags": [], "score": 1, "ok": true})"));
  EXPECT_FALSE(schema_match(person, R"({"name": "Ann", "age": 1, "tags": [], "score": 1, "ok": true,})"));

  const std::string refs = R"({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}}},
      "type": "array", "items": {"anyOf": [{"$ref": "#/$defs/pt"}, {"const": "none"}]}, "minItems": 1})";
  EXPECT_TRUE(schema_match(refs, R"([{"x": 1}, "none", {"x": 2.5}])"));
  EXPECT_FALSE(schema_match(refs, "[]"));
  EXPECT_FALSE(schema_match(refs, R"([{"y": 1}])"));
  EXPECT_TRUE(schema_match(R"({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"})", R"("ab-12")"));
  EXPECT_FALSE(schema_match(R"({"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"})", R"("ab-1")"));
  EXPECT_TRUE(schema_match(R"({"type": "string", "minLength": 2})", R"("ab")"));
  EXPECT_FALSE(schema_match(R"({"type": "string", "minLength": 2})", R"("a")"));

  // Properties not in `required` may be left out (in order still); the required ones may not; no stray commas.
  for (const char* ok :
       {R"({"name": "Ann"})", R"({"name": "Ann", "ok": true})", R"({"name": "", "tags": [], "ok": false})"})
    EXPECT_TRUE(schema_match(person, ok)) << ok;
  for (const char* bad :
       {R"({"age": 3})", "{}", R"({"name": "A",})", R"({"ok": true, "name": "A"})", R"({, "name": "A"})"})
    EXPECT_FALSE(schema_match(person, bad)) << bad;
  const std::string optional = R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"},
      "c": {"type": "boolean"}}, "required": ["c"]})";
  for (const char* ok :
       {R"({"c": true})", R"({"a": 1, "c": true})", R"({"b": null, "c": false})", R"({"a": 1, "b": null, "c": true})"})
    EXPECT_TRUE(schema_match(optional, ok)) << ok;
  for (const char* bad : {"{}", R"({"a": 1})", R"({"c": true, "a": 1})", R"({"a": 1 "c": true})"})
    EXPECT_FALSE(schema_match(optional, bad)) << bad;
  const std::string none = R"({"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})";
  for (const char* ok : {"{}", "{ }", R"({"b": 2})", R"({"a": 1, "b": 2})"}) EXPECT_TRUE(schema_match(none, ok)) << ok;
  for (const char* bad : {R"({"b": 2, "a": 1})", R"({,})", R"({"a": 1,})"})
    EXPECT_FALSE(schema_match(none, bad)) << bad;

  // Any JSON object (json_object; an object schema without properties).
  const std::string any = json_object_regex();
  for (const char* ok :
       {"{}", R"({"a": [1, {"b": null}, "x"], "c": {"d": [true, false, -2e-3]}})", "{ \"k\" : \"v\" }"})
    EXPECT_TRUE(full_match(any, ok)) << ok;
  for (const char* bad : {"[]", "{", R"({"a": })", R"({a: 1})", R"({"a": 1,})", "\"str\"", R"({"a": tru})"})
    EXPECT_FALSE(full_match(any, bad)) << bad;
  EXPECT_TRUE(schema_match(R"({"type": "object"})", R"({"any": [1, 2]})"));
}

// String formats (Pydantic writes them for datetime, date, time, timedelta, EmailStr, UUID, IP addresses, ...):
// valid values match, invalid ones do not; an unknown format is an annotation (any string); `pattern` wins.
TEST(JsonSchema, StringFormatsAreEnforced) {
  struct Case {
    const char* format;
    std::vector<const char*> ok, bad;
  };
  const std::vector<Case> cases = {
      {"date", {"2024-02-29", "1999-12-31"}, {"2024-13-01", "2024-1-01", "24-01-01", "2024-01-32", "2024-01-01T"}},
      {"time", {"23:59:60Z", "08:30:00.123+05:30", "00:00:00z"}, {"24:00:00Z", "12:00:00", "12:60:00Z", "1:00:00Z"}},
      {"date-time",
       {"2024-05-01T12:34:56Z", "2024-05-01t00:00:00.5-08:00"},
       {"2024-05-01 12:34:56Z", "2024-05-01T12:34:56", "2024-05-01"}},
      {"duration", {"P1D", "PT1H30M", "P1Y2M3DT4H5M6S", "P3W", "PT0S"}, {"P", "PT", "1D", "P1H", "PT1D", "P1W2D"}},
      {"email",
       {"ann@example.com", "a.b+c@mail.co.uk", "x_y@a-b.io"},
       {"ann", "@x.com", "a@b", "a..b@c.de", "a@-b.de"}},
      {"uuid",
       {"123e4567-e89b-12d3-a456-426614174000", "ABCDEF01-2345-6789-ABCD-EF0123456789"},
       {"123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"}},
      {"ipv4", {"192.168.0.1", "0.0.0.0", "255.255.255.255"}, {"256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5"}},
      {"ipv6", {"2001:db8::1", "::1", "::", "fe80::", "1:2:3:4:5:6:7:8"}, {"1:2:3:4:5:6:7:8:9", "12345::", ":::"}},
      {"hostname", {"localhost", "api.example.com", "a-1.b2"}, {"-a.com", "a-.com", "a..b", "a_b.com"}},
      {"uri",
       {"https://example.com/a?b=1#c", "mailto:ann@example.com", "urn:isbn:0451450523"},
       {"example.com", "1a:b"}},
  };
  for (const Case& c : cases) {
    const std::string schema = std::string(R"({"type": "string", "format": ")") + c.format + "\"}";
    for (const char* v : c.ok) EXPECT_TRUE(schema_match(schema, '"' + std::string(v) + '"')) << c.format << " " << v;
    for (const char* v : c.bad) EXPECT_FALSE(schema_match(schema, '"' + std::string(v) + '"')) << c.format << " " << v;
  }
  EXPECT_TRUE(schema_match(R"({"type": "string", "format": "color"})", R"("anything")"));
  EXPECT_TRUE(schema_match(R"({"type": "string", "format": "email", "pattern": "^[a-z]+$"})", R"("abc")"));
  EXPECT_TRUE(schema_match(R"({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}})",
                           R"({"when": "2024-05-01"})"));
  EXPECT_FALSE(schema_match(R"({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}})",
                            R"({"when": "May 1st"})"));
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "string", "format": 3})")), Error);
}

// Bounded integers: every integer in [-1200, 1200] (and a few far ones) matches exactly when it is within the bounds,
// for bounds on either side of zero, one-sided, exclusive (a bound of its own, or draft 4's flag), fractional
// (rounded inwards); leading zeros, "-0", fractions and exponents never match.
TEST(JsonSchema, IntegerBoundsAreExact) {
  struct Case {
    const char* bounds;
    int64_t lo, hi;  // INT64_MIN / INT64_MAX: unbounded
  };
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(), kMax = std::numeric_limits<int64_t>::max();
  const Case cases[] = {
      {R"("minimum": 0)", 0, kMax},
      {R"("minimum": 1, "maximum": 100)", 1, 100},
      {R"("minimum": -37, "maximum": 1021)", -37, 1021},
      {R"("maximum": -5)", kMin, -5},
      {R"("minimum": -999, "maximum": -10)", -999, -10},
      {R"("minimum": 7)", 7, kMax},
      {R"("minimum": 190, "maximum": 1109)", 190, 1109},
      {R"("exclusiveMinimum": 0, "exclusiveMaximum": 10)", 1, 9},
      {R"("minimum": 3, "exclusiveMinimum": true, "maximum": 99, "exclusiveMaximum": true)", 4, 98},
      {R"("minimum": 2.5, "maximum": 8.5)", 3, 8},
      {R"("minimum": -0.5)", 0, kMax},
      {R"("minimum": 555, "maximum": 555)", 555, 555},
      {R"("maximum": 0)", kMin, 0},
  };
  for (const Case& c : cases) {
    const std::string schema = std::string(R"({"type": "integer", )") + c.bounds + "}";
    Dfa d(compile_regex(json_schema_regex(nlohmann::ordered_json::parse(schema))));
    std::vector<int64_t> values;
    for (int64_t v = -1200; v <= 1200; ++v) values.push_back(v);
    for (int64_t v : {-123456789LL, -10000LL, 10000LL, 99999LL, 100000LL, 123456789012LL}) values.push_back(v);
    for (int64_t v : values) {
      const bool in = v >= c.lo && v <= c.hi;
      EXPECT_EQ(d.matches(std::to_string(v)), in) << schema << " " << v;
    }
    for (const char* bad : {"01", "007", "-0", "5.0", "1e2", "+5", "", "-"})
      EXPECT_FALSE(d.matches(bad)) << schema << bad;
  }
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "integer", "minimum": 5, "maximum": 4})")),
               Error);
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "integer", "minimum": "1"})")), Error);
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "integer", "maximum": 1e300})")), Error);
}

// Bounded numbers (whole, inclusive bounds): values with or without a fraction match exactly when within the bounds
// (a negative zero may not); exponents are not written; fractional or exclusive number bounds are an error.
TEST(JsonSchema, NumberBoundsAreExact) {
  auto rx = [](const std::string& bounds) {
    return Dfa(compile_regex(
        json_schema_regex(nlohmann::ordered_json::parse(std::string(R"({"type": "number", )") + bounds + "}"))));
  };
  struct Case {
    const char* bounds;
    double lo, hi;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const Case cases[] = {{R"("minimum": 0, "maximum": 1)", 0, 1},     {R"("minimum": -3, "maximum": 12)", -3, 12},
                        {R"("minimum": 5)", 5, inf},                 {R"("maximum": -2)", -inf, -2},
                        {R"("minimum": -20, "maximum": -10)", -20, -10}, {R"("maximum": 0)", -inf, 0}};
  for (const Case& c : cases) {
    Dfa d = rx(c.bounds);
    for (int i = -250; i <= 250; ++i)
      for (const char* f : {"", ".0", ".00", ".5", ".25", ".999", ".01"}) {
        for (const std::string& sign : {std::string(), std::string("-")}) {
          const std::string mag = std::to_string(i < 0 ? -i : i) + f;
          if (i < 0 && sign.empty()) continue;
          const std::string text = (i < 0 ? "-" : sign) + mag;
          const double v = std::stod(text);
          const bool in = v >= c.lo && v <= c.hi;
          if (text[0] == '-' && v == 0.0)  // a negative zero may be left out (0 is written without the sign)
            EXPECT_TRUE(!d.matches(text) || in) << c.bounds << " " << text;
          else
            EXPECT_EQ(d.matches(text), in) << c.bounds << " " << text;
        }
      }
    for (const char* bad : {"1e0", "01.5", "1.", ".5", "- 1"}) EXPECT_FALSE(d.matches(bad)) << c.bounds << bad;
  }
  for (const char* bad : {R"("minimum": 0.5)", R"("exclusiveMinimum": 0)", R"("maximum": 1, "exclusiveMaximum": true)",
                          R"("minimum": 3, "maximum": 2)"})
    EXPECT_THROW(rx(bad), Error) << bad;
}

// Recursive schemas: a tree ($ref "#") nests children kRefDepth levels below the root, the deepest with no children;
// a linked list through $defs ends in null; a recursion that cannot end (a required self-reference) is an error.
TEST(JsonSchema, RecursionIsFollowedToItsBound) {
  static_assert(kRefDepth == 3, "the documents below nest 3 levels");
  const std::string tree = R"({"type": "object", "properties": {"v": {"type": "integer"},
      "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["v", "kids"]})";
  auto node = [](int v, const std::string& kids) {
    return "{\"v\": " + std::to_string(v) + ", \"kids\": [" + kids + "]}";
  };
  EXPECT_TRUE(schema_match(tree, node(1, "")));
  EXPECT_TRUE(schema_match(tree, node(1, node(2, "") + ", " + node(3, node(4, "")))));
  EXPECT_TRUE(schema_match(tree, node(1, node(2, node(3, node(4, ""))))));
  EXPECT_FALSE(schema_match(tree, node(1, node(2, node(3, node(4, node(5, "")))))));  // past the bound
  EXPECT_FALSE(schema_match(tree, R"({"v": 1, "kids": [{"v": 2}]})"));
  const std::string list = R"({"$defs": {"node": {"type": "object", "properties": {"val": {"type": "integer"},
      "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["val", "next"]}},
      "$ref": "#/$defs/node"})";
  EXPECT_TRUE(schema_match(list, R"({"val": 1, "next": null})"));
  EXPECT_TRUE(schema_match(list, R"({"val": 1, "next": {"val": 2, "next": {"val": 3, "next": null}}})"));
  EXPECT_FALSE(schema_match(list, R"({"val": 1, "next": {"val": 2}})"));
  // Many optional references to the root at each level: the regex would grow as their count to the third power,
  // so it is refused once it passes kMaxRegexBytes (quickly, without building it).
  nlohmann::ordered_json wide = {{"type", "object"}, {"properties", nlohmann::ordered_json::object()}};
  for (int i = 0; i < 60; ++i) wide["properties"][fmt::format("p{}", i)] = {{"$ref", "#"}};
  EXPECT_THROW(json_schema_regex(wide), Error);
  for (const char* endless : {R"({"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                 "required": ["x"]}}, "$ref": "#/$defs/a"})",
                              R"({"type": "array", "items": {"$ref": "#"}, "minItems": 1})"})
    EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(endless)), Error) << endless;
}

// EBNF grammars (GBNF / xgrammar notation): rules inlined into one regex, strings with escapes, classes, groups,
// repeats, comments and rules over several lines; a recursive rule followed kRefDepth deep (balanced parentheses
// nest 3 levels); errors name the line.
// ebnf_regex's error message for a grammar it must reject ("" when it accepts it).
std::string grammar_error(const std::string& grammar) {
  try {
    ebnf_regex(grammar);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << grammar;
  return "";
}

TEST(Ebnf, GrammarsMatchTheirTexts) {
  auto matches = [](const std::string& grammar, const std::string& text) {
    return full_match(ebnf_regex(grammar), text);
  };
  const std::string yes_no = R"(root ::= "yes" | "no"  # a comment)";
  EXPECT_TRUE(matches(yes_no, "yes"));
  EXPECT_TRUE(matches(yes_no, "no"));
  EXPECT_FALSE(matches(yes_no, "yesno"));
  const std::string list = R"(
root ::= "[" ( item ( ", " item )* )? "]"
item ::= [a-z]+ | num
num  ::= "-"? [1-9] [0-9]{0,2}   # at most 3 digits
     | "0"
)";
  for (const char* ok : {"[]", "[ab]", "[a, 12, -305, 0]", "[zz, 999]"}) EXPECT_TRUE(matches(list, ok)) << ok;
  for (const char* bad : {"[", "[a,b]", "[1000]", "[01]", "[A]", "[a, ]"}) EXPECT_FALSE(matches(list, bad)) << bad;
  const std::string esc = "root ::= \"say \\\"hi\\\"\\n\" 'x\\u00e9' [^\\]\"]";
  EXPECT_TRUE(matches(esc, "say \"hi\"\nx\u00e9z")) << ebnf_regex(esc);
  const std::string parens = R"g(root ::= "(" root ")" | "x" | "")g";
  for (const char* ok : {"x", "()", "(x)", "((x))", "(((x)))", "((()))"}) EXPECT_TRUE(matches(parens, ok)) << ok;
  EXPECT_FALSE(matches(parens, "((((x))))"));  // past the bound
  EXPECT_FALSE(matches(parens, "(x"));
  for (const char* bad : {"item ::= \"a\"", "root ::= missing", "root ::= \"a", "root ::= [a-z", "root ::= (\"a\"",
                          "root ::= \"a\"{3,1}", "root ::= \"a\" @", "root ::= \"a\"\nroot ::= \"b\"",
                          "root ::= \"(\" root \")\""})
    EXPECT_THROW(ebnf_regex(bad), Error) << bad;
  EXPECT_NE(grammar_error("root ::= a\na ::= \"x\"\nb ::= \"y\" ! ").find("ebnf, line 3"), std::string::npos);
}

// Lark's notation (vLLM's guided_grammar takes it; its documentation's SQL example first): `rule:` and `?rule:`,
// "strings" ("..."i any case, "a".."z" ranges), /regexes/, [optional] items, `~ n..m`, `-> alias`, // comments,
// alternatives on continuation lines, `%import common.NAME` (and `-> ALIAS`, and the list form), the rule `start`.
TEST(Ebnf, LarkGrammarsMatchTheirTexts) {
  auto matches = [](const std::string& grammar, const std::string& text) {
    return full_match(ebnf_regex(grammar), text);
  };
  const std::string sql = R"(
    ?start: select_statement
    ?select_statement: "SELECT " column_list " FROM " table_name
    ?column_list: column_name ("," column_name)*
    ?table_name: identifier
    ?column_name: identifier
    ?identifier: /[a-zA-Z_][a-zA-Z0-9_]*/
)";
  for (const char* ok : {"SELECT a FROM t", "SELECT a,b_2,_c FROM users"}) EXPECT_TRUE(matches(sql, ok)) << ok;
  for (const char* bad : {"SELECT FROM t", "SELECT a FROM 1t", "select a FROM t", "SELECT a, b FROM t"})
    EXPECT_FALSE(matches(sql, bad)) << bad;
  const std::string json_like = R"(
// a list of numbers or strings
start: "[" [value ("," value)*] "]"
value: SIGNED_NUMBER -> number
     | ESCAPED_STRING
     | "null"i
     | letters
letters.2: ("a".."f") ~ 2..3
%import common.SIGNED_NUMBER
%import common.ESCAPED_STRING
)";
  for (const char* ok : {"[]", "[1,-2.5e3,\"a\\\"b\"]", "[NULL,Null]", "[abc,fe]"})
    EXPECT_TRUE(matches(json_like, ok)) << ok;
  for (const char* bad : {"[", "[1,]", "[\"a]", "[nul]", "[a]", "[abcd]", "[ag]"})
    EXPECT_FALSE(matches(json_like, bad)) << bad;
  const std::string imports =
      "start: NUM \" \" W\n%import common.NUMBER -> NUM\n%import common (WORD, WS)\nW: WORD";
  EXPECT_TRUE(matches(imports, "3.5 hello"));
  EXPECT_FALSE(matches(imports, "3.5  hello"));
  for (const char* bad : {"start: \"a\"\n%ignore", "start: x", "start: /a/i", "start: \"a\"{2}",
                          "%import other.X\nstart: X", "%import common.NOPE\nstart: NOPE", "start: \"ab\"..\"c\"",
                          "rule: \"a\"", "start: [\"a\"", "start: /(/"})
    EXPECT_THROW(ebnf_regex(bad), Error) << bad;
  EXPECT_NE(grammar_error("start: a\na: \"x\"\nb: \"y\" @ ").find("lark grammar, line 3"), std::string::npos);
  EXPECT_NE(grammar_error("start: a\na: \"x\" B").find("lark grammar, line 2: the rule 'B' is not defined"),
            std::string::npos);
}

// Lark's %ignore: what it matches may lead, trail and stand between any two elements of the rules (repeats and
// nested rules too), never inside a terminal (an upper-case name, a string or a regex); several %ignore add up.
TEST(Ebnf, LarkIgnoreStandsBetweenTokens) {
  auto matches = [](const std::string& grammar, const std::string& text) {
    return full_match(ebnf_regex(grammar), text);
  };
  const std::string calc = R"g(
start: expr
expr: term (OP term)*
term: NUMBER | "(" expr ")" | NAME "(" [args] ")"
args: expr ("," expr)*
OP: "+" | "-" | "*"
NAME: /[a-z]+/
%import common.NUMBER
%import common.WS
%ignore WS
)g";
  for (const char* ok : {"1+2", " 1 + 2 ", "(1+2)*3", "( 1 +\n 2 ) * 3\t", "max(1, 2 ,3)", "f( )", "12.5-x(4)"})
    EXPECT_TRUE(matches(calc, ok)) << ok;
  // not inside terminals: a number, a name or a two-letter operator split by blanks; nor unbalanced text
  for (const char* bad : {"1 2", "1 + ", "m ax(1)", "1.  5", "(1+2", "1 ++ 2", "max(1,)"})
    EXPECT_FALSE(matches(calc, bad)) << bad;
  // Two %ignore items (blanks and // comments), a string ignored, repeats with bounds.
  const std::string list = R"(
start: "[" item ~ 1..3 "]"
item: LETTER
LETTER: "a".."z"
COMMENT: /#[^\n]*\n/
%ignore " "
%ignore COMMENT
)";
  for (const char* ok : {"[a]", "[ a b ]", "[a #note\n b c]", "[abc]"}) EXPECT_TRUE(matches(list, ok)) << ok;
  for (const char* bad : {"[]", "[a b c d]", "[a\tb]", "[a #note b]"}) EXPECT_FALSE(matches(list, bad)) << bad;
  // Without %ignore the same rules take no blanks.
  EXPECT_FALSE(matches("start: \"a\" \"b\"", "a b"));
  // An empty string ignored adds nothing; %ignore with nothing after it is an error.
  EXPECT_TRUE(matches("start: \"a\" \"b\"\n%ignore \"\"", "ab"));
  EXPECT_FALSE(matches("start: \"a\" \"b\"\n%ignore \"\"", "a b"));
  EXPECT_NE(grammar_error("start: \"a\"\n%ignore\n").find("'%ignore' must name what it ignores"), std::string::npos);
}

// Input nested past the parsers' bounds is an error, not a stack overflow: regex groups, EBNF groups, JSON schemas.
TEST(Structured, DeepNestingIsAnError) {
  on_input_stack([] {
    const std::string deep_regex = std::string(100000, '(') + "a" + std::string(100000, ')');
    EXPECT_THROW(compile_regex(deep_regex), Error);
    EXPECT_NO_THROW(compile_regex(std::string(200, '(') + "a" + std::string(200, ')')));
    EXPECT_THROW(ebnf_regex("root ::= " + std::string(100000, '(') + "\"a\"" + std::string(100000, ')')), Error);
    nlohmann::ordered_json deep = {{"type", "string"}};
    for (int i = 0; i < 2000; ++i) deep = {{"type", "array"}, {"items", deep}};
    EXPECT_THROW(json_schema_regex(deep), Error);
  });
}

// multipleOf: an integer's values are exactly the multiples within its bounds (brute force); a fractional multipleOf
// of an integer is its numerator's share (2.5: multiples of 5); a number's fractional multipleOf allows exactly the
// multiples written with up to its places of fraction digits, a whole one the integers that are multiples; what it
// cannot express (fractional with bounds, too many places, too large, no multiple in the bounds, not above 0) is an
// error.
TEST(JsonSchema, MultipleOfIsEnforced) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(), kMax = std::numeric_limits<int64_t>::max();
  struct Case {
    const char* rest;
    int64_t k, lo, hi;
  };
  const Case cases[] = {
      {R"("multipleOf": 3)", 3, kMin, kMax},
      {R"("multipleOf": 7, "minimum": 0)", 7, 0, kMax},
      {R"("multipleOf": 25, "minimum": 1, "maximum": 100)", 25, 1, 100},
      {R"("multipleOf": 12, "minimum": -37, "maximum": 1021)", 12, -37, 1021},
      {R"("multipleOf": 2, "maximum": -5)", 2, kMin, -5},
      {R"("multipleOf": 5, "exclusiveMinimum": 0)", 5, 1, kMax},
      {R"("multipleOf": 2.5)", 5, kMin, kMax},
      {R"("multipleOf": 0.5, "minimum": -3, "maximum": 3)", 1, -3, 3},
      {R"("multipleOf": 1000)", 1000, kMin, kMax},
  };
  for (const char* type : {"integer", "number"}) {
    for (const Case& c : cases) {
      if (std::string(type) == "number" && std::string(c.rest).find('.') != std::string::npos) continue;
      const std::string schema = fmt::format(R"({{"type": "{}", {}}})", type, c.rest);
      Dfa d(compile_regex(json_schema_regex(nlohmann::ordered_json::parse(schema))));
      std::vector<int64_t> values;
      for (int64_t v = -1200; v <= 1200; ++v) values.push_back(v);
      for (int64_t v : {-123456789000LL, -10000LL, 10000LL, 99999LL, 100000LL, 123456789012LL}) values.push_back(v);
      for (int64_t v : values)
        EXPECT_EQ(d.matches(std::to_string(v)), v >= c.lo && v <= c.hi && v % c.k == 0) << schema << " " << v;
      for (const char* bad : {"01", "0100", "5.5", "+5", "", "-"}) EXPECT_FALSE(d.matches(bad)) << schema << bad;
    }
  }
  // A number's fractional multipleOf: i / 100 written with two, one or no fraction digits.
  Dfa q(compile_regex(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "number", "multipleOf": 0.25})"))));
  for (int i = -500; i <= 500; ++i) {
    const double v = i / 100.0;
    EXPECT_EQ(q.matches(fmt::format("{:.2f}", v)), i % 25 == 0) << v;
    if (i % 10 == 0) {
      EXPECT_EQ(q.matches(fmt::format("{:.1f}", v)), i % 50 == 0) << v;
    }
    if (i % 100 == 0) {
      EXPECT_TRUE(q.matches(std::to_string(i / 100))) << v;
    }
  }
  for (const char* bad : {"0.125", "1.1", "1e2", ".25", "1.", "00.25"}) EXPECT_FALSE(q.matches(bad)) << bad;
  Dfa cents(
      compile_regex(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "number", "multipleOf": 0.01})"))));
  for (const char* good : {"19.99", "0.5", "-3", "1000.10"}) EXPECT_TRUE(cents.matches(good)) << good;
  EXPECT_FALSE(cents.matches("19.999"));
  for (const char* s :
       {R"({"type": "number", "multipleOf": 0.1, "minimum": 0})", R"({"type": "integer", "multipleOf": 0})",
        R"({"type": "integer", "multipleOf": -3})", R"({"type": "integer", "multipleOf": "2"})",
        R"({"type": "number", "multipleOf": 1e-12})", R"({"type": "integer", "multipleOf": 1e9})",
        R"({"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 6})"}) {
    EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(s)), Error) << s;
  }
}

// Tuple arrays (prefixItems, as Pydantic writes tuple[str, int]; drafts 4-7's items array with additionalItems):
// element i of its schema, the rest of items / additionalItems (absent: any value; false: none), within minItems /
// maxItems; a tuple no array fits is an error.
TEST(JsonSchema, TupleArraysFollowTheirElementSchemas) {
  const std::string pair = R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
      "minItems": 2, "maxItems": 2})";
  for (const char* good : {R"(["a", 1])", R"([ "a" , -7 ])"}) EXPECT_TRUE(schema_match(pair, good)) << good;
  for (const char* bad : {R"(["a"])", R"(["a", 1, 2])", R"([1, "a"])", "[]", R"(["a", 1.5])"})
    EXPECT_FALSE(schema_match(pair, bad)) << bad;
  const std::string open = R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]})";
  for (const char* good : {"[]", R"(["a"])", R"(["a", 1])", R"(["a", 1, true, null, {"x": [2]}])"})
    EXPECT_TRUE(schema_match(open, good)) << good;
  for (const char* bad : {"[1]", R"(["a", "b"])", R"(["a",])"}) EXPECT_FALSE(schema_match(open, bad)) << bad;
  const std::string rest = R"({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "boolean"},
      "minItems": 2, "maxItems": 3})";
  for (const char* good : {R"(["a", true])", R"(["a", true, false])"}) EXPECT_TRUE(schema_match(rest, good)) << good;
  for (const char* bad : {R"(["a"])", R"(["a", 1])", R"(["a", true, false, true])", R"([true, true])"})
    EXPECT_FALSE(schema_match(rest, bad)) << bad;
  const std::string closed = R"({"prefixItems": [{"type": "string"}, {"type": "integer"}], "items": false})";
  for (const char* good : {"[]", R"(["a"])", R"(["a", 1])"}) EXPECT_TRUE(schema_match(closed, good)) << good;
  EXPECT_FALSE(schema_match(closed, R"(["a", 1, 2])"));
  const std::string draft7 = R"({"type": "array", "items": [{"type": "integer"}, {"enum": ["x"]}],
      "additionalItems": false, "minItems": 1})";
  for (const char* good : {"[1]", R"([1, "x"])"}) EXPECT_TRUE(schema_match(draft7, good)) << good;
  for (const char* bad : {"[]", R"([1, "y"])", R"([1, "x", 2])"}) EXPECT_FALSE(schema_match(draft7, bad)) << bad;
  const std::string short_max = R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
      "maxItems": 1})";
  EXPECT_TRUE(schema_match(short_max, R"(["a"])"));
  EXPECT_FALSE(schema_match(short_max, R"(["a", 1])"));
  for (const char* s : {R"({"type": "array", "prefixItems": {"type": "string"}})",
                        R"({"type": "array", "prefixItems": [{"type": "string"}], "items": false, "minItems": 2})"})
    EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(s)), Error) << s;
}

// Maps (an object without properties, as Pydantic writes dict[str, int]): any keys, the values of
// additionalProperties (false: none), minProperties to maxProperties of them.
TEST(JsonSchema, ItemsFalseAllowsOnlyTheEmptyArray) {
  const std::string none = R"({"type": "array", "items": false})";
  EXPECT_TRUE(schema_match(none, "[]"));
  EXPECT_TRUE(schema_match(none, "[ ]"));
  EXPECT_FALSE(schema_match(none, "[1]"));
  EXPECT_TRUE(schema_match(R"({"type": "array", "items": true})", R"([1, "a", null])"));
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(R"({"type": "array", "items": false, "minItems": 1})")),
               Error);
}

TEST(JsonSchema, MapsFollowAdditionalProperties) {
  const std::string ints = R"({"type": "object", "additionalProperties": {"type": "integer"}})";
  for (const char* good : {"{}", R"({"a": 1, "b": -2})", R"({ "x y" : 3 })"})
    EXPECT_TRUE(schema_match(ints, good)) << good;
  for (const char* bad : {R"({"a": "x"})", R"({"a": 1, "b": null})", R"({"a": 1,})"})
    EXPECT_FALSE(schema_match(ints, bad)) << bad;
  const std::string none = R"({"type": "object", "additionalProperties": false})";
  EXPECT_TRUE(schema_match(none, "{}"));
  EXPECT_FALSE(schema_match(none, R"({"a": 1})"));
  const std::string counted = R"({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1,
      "maxProperties": 2})";
  for (const char* good : {R"({"a": 1})", R"({"a": 1, "b": 2})"}) EXPECT_TRUE(schema_match(counted, good)) << good;
  for (const char* bad : {"{}", R"({"a": 1, "b": 2, "c": 3})"}) EXPECT_FALSE(schema_match(counted, bad)) << bad;
  EXPECT_TRUE(schema_match(R"({"type": "object"})", R"({"a": [1, {"b": null}], "c": "d"})"));
  EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(
                   R"({"type": "object", "minProperties": 3, "maxProperties": 2})")),
               Error);
}

// Objects with many properties: required ones after the first required property add no nesting, optional ones
// before it nest one group each (up to the regex parser's bound of 1024 groups); regexes that deep compile.
TEST(JsonSchema, ObjectsWithManyPropertiesCompile) {
  on_input_stack([] {
    auto object = [](int n, int first_required, bool all_required_after) {
      nlohmann::ordered_json s = {{"type", "object"}, {"properties", nlohmann::ordered_json::object()}};
      nlohmann::ordered_json req = nlohmann::ordered_json::array();
      for (int i = 0; i < n; ++i) {
        const std::string name = fmt::format("p{}", i);
        s["properties"][name] = {{"type", "integer"}};
        if (i == first_required || (all_required_after && i > first_required)) req.push_back(name);
      }
      s["required"] = req;
      return s.dump();
    };
    auto doc = [](const std::vector<int>& present) {
      std::string d = "{";
      for (int i : present) d += fmt::format("{}\"p{}\": {}", d.size() > 1 ? ", " : "", i, i);
      return d + "}";
    };
    std::vector<int> all(1500);
    std::iota(all.begin(), all.end(), 0);
    const std::string required = object(1500, 0, true);  // every property required: flat
    EXPECT_TRUE(schema_match(required, doc(all)));
    std::vector<int> missing = all;
    missing.erase(missing.begin() + 700);
    EXPECT_FALSE(schema_match(required, doc(missing)));
    const std::string optional = object(600, 500, false);  // 500 optional ones, then one required, then optional
    EXPECT_TRUE(schema_match(optional, doc({3, 499, 500, 599})));
    EXPECT_TRUE(schema_match(optional, doc({500})));
    EXPECT_FALSE(schema_match(optional, doc({3, 499, 599})));
    EXPECT_FALSE(schema_match(optional, doc({499, 3, 500})));  // out of order

    std::string deep = "a";
    for (int i = 0; i < 1000; ++i) deep = "(" + deep + "|b)";
    EXPECT_TRUE(Dfa(compile_regex(deep)).matches("a"));
    // Too deep: an error whose message quotes the start of the pattern, not all of it.
    const std::string too_deep = std::string(1100, '(') + "a" + std::string(1100, ')');
    try {
      compile_regex(too_deep);
      ADD_FAILURE() << "a pattern nesting 1100 groups compiled";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("groups nest more than 1024 deep"), std::string::npos) << m;
      EXPECT_NE(m.find("(2201 bytes)"), std::string::npos) << m;
      EXPECT_LT(m.size(), 400u) << m;
    }
  });
}

TEST(JsonSchema, WhatItCannotExpressIsAnError) {
  for (const char* s : {R"({"$ref": "#"})", R"({"$ref": "#/$defs/missing"})", R"({"type": "tuple"})",
                        R"({"properties": {"a": {}}, "required": ["b"]})",
                        R"({"properties": {"a": {}}, "required": "a"})",
                        R"({"allOf": [{"type": "string"}, {"minLength": 2}]})", R"({"enum": []})", "false",
                        R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})"}) {
    EXPECT_THROW(json_schema_regex(nlohmann::ordered_json::parse(s)), Error) << s;
  }
}

// A regex constraint's allowed tokens are exactly the tokens whose bytes keep the automaton alive (brute force over
// the vocabulary), next() walks a token's bytes, and special tokens (no bytes) are never allowed.
TEST(TokenConstraint, MasksAreTheTokensThatKeepTheRegexAlive) {
  std::vector<std::string> bytes = {"",   "{",   "}",  "\"", "a",  "ab", "b",  "\"a", "1",  "12", "23", ":",
                                    " ",  ", ",  "\n", "x",  "é",  "\xC3", "\xA9", "\": ", "}\n", "true", "tr", "ue"};
  auto vocab = std::make_shared<const TokenVocab>(bytes);
  const std::string re = R"(\{"a+b?": ([0-9]{1,3}|true)\})";
  RegexConstraint c(vocab, re);
  Dfa ref(compile_regex(re));
  // Walk a few texts token by token, comparing the mask with brute force at every state on the way.
  using Path = std::vector<int32_t>;
  for (const Path& path : {Path{1, 7, 19, 9, 2}, Path{1, 3, 5, 19, 21, 2}, Path{1, 7, 4, 6, 19, 22, 23, 2}}) {
    int32_t s = 0, rs = 0;
    for (size_t k = 0; k <= path.size(); ++k) {
      const auto& m = *c.allowed(s);
      for (int32_t t = 0; t < vocab->size(); ++t) {
        const bool want = !bytes[static_cast<size_t>(t)].empty() && ref.walk(rs, bytes[static_cast<size_t>(t)]) >= 0;
        ASSERT_EQ((m[static_cast<size_t>(t) / 32] >> (t % 32) & 1u) != 0, want) << "token " << t << " at step " << k;
      }
      if (k == path.size()) break;
      const int32_t t = path[k];
      ASSERT_TRUE(m[static_cast<size_t>(t) / 32] >> (t % 32) & 1u) << "step " << k;
      s = c.next(s, t);
      rs = ref.walk(rs, bytes[static_cast<size_t>(t)]);
      ASSERT_GE(s, 0);
    }
    EXPECT_TRUE(c.accepting(s));
    EXPECT_TRUE(std::all_of(c.allowed(s)->begin(), c.allowed(s)->end(), [](uint32_t w) { return w == 0; }));
  }
  EXPECT_EQ(c.next(0, 2), TokenConstraint::kDead);  // "}" first
  // Built from the pattern's compile already made (the server's path for a client's regex): the same masks and steps.
  RegexConstraint from_nfa(vocab, compile_regex(re));
  for (int32_t s = 0, k = 0; k < 5 && s >= 0; ++k) {
    EXPECT_EQ(*from_nfa.allowed(s), *c.allowed(s)) << "state " << s;
    const int32_t t = Path{1, 7, 19, 9, 2}[static_cast<size_t>(k)];
    EXPECT_EQ(from_nfa.next(s, t), c.next(s, t));
    s = c.next(s, t);
  }
  EXPECT_EQ(c.next(0, 0), TokenConstraint::kDead);  // a special token
  EXPECT_FALSE(c.accepting(0));
}

// One constraint shared by requests on several engine threads (the server caches one per regex): concurrent walks
// see the masks and states a constraint of their own gives.
TEST(TokenConstraint, SharedAcrossThreadsGivesTheSameMasks) {
  std::vector<std::string> bytes;
  for (char c : std::string("{}\":, abcxyz0123456789.-etrufalsn")) {
    bytes.emplace_back(1, c);
    bytes.emplace_back(2, c);
  }
  bytes.push_back("true");
  bytes.push_back("\": ");
  auto vocab = std::make_shared<const TokenVocab>(bytes);
  const std::string re = json_schema_regex(nlohmann::ordered_json::parse(
      R"({"type": "object", "properties": {"k": {"type": "array", "items": {"type": "number"}},
          "b": {"type": "boolean"}}})"));
  auto shared = std::make_shared<RegexConstraint>(vocab, re);
  auto walk = [&](TokenConstraint& c, uint64_t seed) {  // a random walk through allowed tokens; the masks on the way
    std::mt19937_64 rng(seed);
    std::vector<std::vector<uint32_t>> seen;
    int32_t s = 0;
    for (int step = 0; step < 60; ++step) {
      const auto m = c.allowed(s);
      seen.push_back(*m);
      std::vector<int32_t> ok;
      for (int32_t t = 0; t < vocab->size(); ++t)
        if ((*m)[static_cast<size_t>(t) / 32] >> (t % 32) & 1u) ok.push_back(t);
      if (ok.empty()) break;
      s = c.next(s, ok[rng() % ok.size()]);
      EXPECT_GE(s, 0);
    }
    return seen;
  };
  std::vector<std::vector<std::vector<uint32_t>>> got(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { got[static_cast<size_t>(i)] = walk(*shared, 50 + i); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    RegexConstraint own(vocab, re);
    EXPECT_EQ(got[static_cast<size_t>(i)], walk(own, 50 + i)) << "walk " << i;
  }
}
