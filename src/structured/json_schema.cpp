#include "structured/json_schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "structured/regex_build.h"

namespace mlaserve::structured {

namespace {

const std::string kFreeWs = "[ \\t\\n\\r]*", kCompactWs = " ?";
const std::string kString = "\"([^\"\\\\\\x00-\\x1F]|\\\\([\"\\\\/bfnrt]|u[0-9a-fA-F]{4}))*\"";
const std::string kStringChar = "([^\"\\\\\\x00-\\x1F]|\\\\([\"\\\\/bfnrt]|u[0-9a-fA-F]{4}))";
const std::string kInteger = "-?(0|[1-9][0-9]*)";
const std::string kNumber = "-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?";
const std::string kBoolean = "(true|false)";
const std::string kNull = "null";

using build::group;
using build::join;
using build::Rx;

// The content (between the quotes) of a string of JSON Schema `format` name, as xgrammar enforces them: RFC 3339's
// date, time (an offset required) and date-time, ISO 8601 durations, RFC 5321 email addresses (dot-atom local parts),
// RFC 4122 UUIDs, IPv4 / IPv6 addresses (IPv6 without an embedded IPv4 part or a zone), RFC 1123 host names and URIs
// (a scheme, then URI characters). Empty for other names (an annotation then, as JSON Schema has it).
std::string format_regex(const std::string& name) {
  const std::string date = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])";
  const std::string time =
      "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
  const std::string octet = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
  const std::string label = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
  if (name == "date") return date;
  if (name == "time") return time;
  if (name == "date-time") return date + "[Tt]" + time;
  if (name == "duration") {
    const std::string dtime = "T([0-9]+H([0-9]+M)?([0-9]+S)?|[0-9]+M([0-9]+S)?|[0-9]+S)";
    const std::string ddate = "([0-9]+Y([0-9]+M)?([0-9]+D)?|[0-9]+M([0-9]+D)?|[0-9]+D)";
    return "P(" + ddate + "(" + dtime + ")?|" + dtime + "|[0-9]+W)";
  }
  if (name == "email") {
    const std::string atom = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+";
    return atom + "(\\." + atom + ")*@" + label + "(\\." + label + ")+";
  }
  if (name == "uuid") return "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
  if (name == "ipv4") return "(" + octet + "\\.){3}" + octet;
  if (name == "ipv6") {
    const std::string h = "[0-9a-fA-F]{1,4}";
    return "((" + h + ":){7}" + h + "|(" + h + ":){1,7}:|(" + h + ":){1,6}:" + h + "|(" + h + ":){1,5}(:" + h +
           "){1,2}|(" + h + ":){1,4}(:" + h + "){1,3}|(" + h + ":){1,3}(:" + h + "){1,4}|(" + h + ":){1,2}(:" + h +
           "){1,5}|" + h + ":(:" + h + "){1,6}|:((:" + h + "){1,7}|:))";
  }
  if (name == "hostname") return label + "(\\." + label + ")*";
  if (name == "uri") return "[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\\-._~:/?#\\[\\]@!$&'()*+,;=%]*";
  return "";
}

// `item` repeated as a JSON list between `open` and `close` (escaped), [lo, hi] times (hi < 0: unbounded).
std::string list(const std::string& ws, const std::string& open, const std::string& item, const std::string& close,
                 int64_t lo, int64_t hi) {
  const std::string more = group(ws + "," + ws + item);
  std::string body;
  if (hi == 0) {
    body = "";
  } else {
    const int64_t first = lo > 0 ? lo - 1 : 0;
    const std::string rest = hi < 0 ? fmt::format("{{{},}}", first) : fmt::format("{{{},{}}}", first, hi - 1);
    body = item + more + rest;
    if (lo == 0) body = group(body) + "?";
  }
  return open + ws + body + ws + close;
}

// "-" and the group of r (appended, not prepended: GCC 12 warns falsely on "-" + a temporary string).
std::string negative(const std::string& r) {
  std::string out = "-(";
  out += r;
  out += ')';
  return out;
}

// The numbers of exactly lo.size() decimal digits from lo to hi (lo <= hi, equal lengths).
std::string same_length(const std::string& lo, const std::string& hi) {
  if (lo == hi) return lo;
  const size_t n = lo.size();
  if (n == 1) return fmt::format("[{}-{}]", lo[0], hi[0]);
  const std::string lo_rest = lo.substr(1), hi_rest = hi.substr(1);
  if (lo[0] == hi[0]) return lo.substr(0, 1) + group(same_length(lo_rest, hi_rest));
  const std::string zeros(n - 1, '0'), nines(n - 1, '9');
  std::vector<std::string> alts;
  char a = lo[0], b = hi[0];
  if (lo_rest != zeros) {  // lo's first digit: only from lo's rest up
    alts.push_back(lo.substr(0, 1) + group(same_length(lo_rest, nines)));
    ++a;
  }
  if (hi_rest != nines) --b;  // hi's first digit: only up to hi's rest (below)
  if (a <= b)
    alts.push_back((a == b ? std::string(1, a) : fmt::format("[{}-{}]", a, b)) + fmt::format("[0-9]{{{}}}", n - 1));
  if (hi_rest != nines) alts.push_back(hi.substr(0, 1) + group(same_length(zeros, hi_rest)));
  return join(alts);
}

// The non-negative integers from lo to hi (none: unbounded) written as JSON writes them; "" when there are none.
std::string uint_range(uint64_t lo, std::optional<uint64_t> hi) {
  if (hi && *hi < lo) return "";
  const std::string los = std::to_string(lo);
  const size_t first_len = los.size(), last_len = hi ? std::to_string(*hi).size() : first_len;
  std::vector<std::string> alts;
  uint64_t p = 1;  // 10^(len - 1)
  for (size_t len = 1; len < first_len; ++len) p *= 10;
  for (size_t len = first_len; len <= last_len; ++len, p *= 10) {
    const uint64_t a = std::max(lo, len == 1 ? 0 : p), b = hi ? std::min(*hi, p * 10 - 1) : p * 10 - 1;
    alts.push_back(same_length(std::to_string(a), std::to_string(b)));
  }
  if (!hi) alts.push_back(fmt::format("[1-9][0-9]{{{},}}", first_len));  // more digits than lo's
  return join(alts);
}

// What r matches whose digits make a multiple of k (regex.h's (?%k:...)); r itself, grouped, when k is 1.
std::string multiples_of(int64_t k, const std::string& r) {
  return k > 1 ? fmt::format("(?%{}:{})", k, r) : group(r);
}

// The integers from lo to hi (none: unbounded), as JSON writes them; "" when there are none. k > 1: only its
// multiples (each magnitude's digits in (?%k:...); the regex may then match nothing).
std::string int_range(std::optional<int64_t> lo, std::optional<int64_t> hi, int64_t k = 1) {
  auto multiples = [&](const std::string& r) { return k > 1 ? multiples_of(k, r) : r; };
  std::vector<std::string> alts;
  if (!lo || *lo < 0) {  // negative values: their magnitudes
    const int64_t top = hi ? std::min<int64_t>(*hi, -1) : -1;
    if (!lo || *lo <= top)
      alts.push_back(negative(multiples(uint_range(
          static_cast<uint64_t>(-top), lo ? std::optional<uint64_t>(static_cast<uint64_t>(-*lo)) : std::nullopt))));
  }
  if (!hi || *hi >= 0) {
    const std::string r = uint_range(static_cast<uint64_t>(lo ? std::max<int64_t>(*lo, 0) : 0),
                                     hi ? std::optional<uint64_t>(static_cast<uint64_t>(*hi)) : std::nullopt);
    if (!r.empty()) alts.push_back(multiples(r));
  }
  return join(alts);
}

// multipleOf as p / 10^places (places <= 9, p <= kMaxMultipleOf).
struct MultipleOf {
  int64_t p = 1;
  int places = 0;
};

int64_t pow10(int n) {
  int64_t r = 1;
  while (n-- > 0) r *= 10;
  return r;
}

// The numbers that are multiples of p / 10^places, without bounds and written without an exponent: an integer part
// and 0 to `places` fraction digits, the digits (the point skipped) a multiple of p / gcd(p, 10^(places - j)) for
// j fraction digits.
std::string number_multiples(const MultipleOf& mo) {
  std::vector<std::string> alts;
  for (int j = 0; j <= mo.places; ++j) {
    const int64_t k = mo.p / std::gcd(mo.p, pow10(mo.places - j));
    const std::string digits = j == 0 ? "0|[1-9][0-9]*" : fmt::format("(0|[1-9][0-9]*)\\.[0-9]{{{}}}", j);
    alts.push_back(multiples_of(k, digits));
  }
  return "-?" + group(join(alts));
}

// The numbers from lo to hi (whole numbers; none: unbounded) with an optional fraction and no exponent; "" when none.
// A value is at least lo >= 0 when its integer part is; at most hi when its integer part is below hi, or is hi with
// a zero fraction (negative values alike, on their magnitudes).
std::string number_range(std::optional<int64_t> lo, std::optional<int64_t> hi) {
  const std::string frac = "(\\.[0-9]+)?", zero_frac = "(\\.0+)?";
  auto upto = [&](uint64_t from, std::optional<uint64_t> bound) {  // magnitudes in [from, bound]
    std::vector<std::string> alts;
    if (!bound) return group(uint_range(from, std::nullopt)) + frac;
    if (*bound > from) alts.push_back(group(uint_range(from, *bound - 1)) + frac);
    if (*bound >= from) alts.push_back(std::to_string(*bound) + zero_frac);
    return join(alts);
  };
  std::vector<std::string> alts;
  if (!hi || *hi >= 0) {  // non-negative values
    const uint64_t from = lo ? static_cast<uint64_t>(std::max<int64_t>(*lo, 0)) : 0;
    const std::string r = upto(from, hi ? std::optional<uint64_t>(static_cast<uint64_t>(*hi)) : std::nullopt);
    if (!r.empty()) alts.push_back(r);
  }
  if (!lo || *lo < 0) {  // negative values (-0 too where 0 is allowed)
    const uint64_t from = hi && *hi < 0 ? static_cast<uint64_t>(-*hi) : 0;
    const std::string r = upto(from, lo ? std::optional<uint64_t>(static_cast<uint64_t>(-*lo)) : std::nullopt);
    if (!r.empty()) alts.push_back(negative(r));
  }
  return join(alts);
}

std::string any_value(const std::string& ws, int depth) {
  std::string r = kString + "|" + kNumber + "|" + kBoolean + "|" + kNull;
  if (depth > 0) {
    const std::string inner = group(any_value(ws, depth - 1));
    r += "|" + list(ws, "\\{", kString + ws + ":" + ws + inner, "\\}", 0, -1);
    r += "|" + list(ws, "\\[", inner, "\\]", 0, -1);
  }
  return r;
}

class Converter {
 public:
  Converter(const nlohmann::ordered_json& root, bool compact) : root_(root), ws(compact ? kCompactWs : kFreeWs) {}

  // The regex of the values schema s allows; none when it allows none within the recursion bound.
  Rx value(const nlohmann::ordered_json& s, const std::string& path) {
    // The conversion recurses once per nested schema (and per $ref followed): bounded, whatever the schema's text.
    if (++depth_ > 512) fail("json_schema at {}: the schema nests more than 512 levels", path);
    Rx r = value_of(s, path);
    --depth_;
    if (r) check_size(r->size(), path);
    return r;
  }

 private:
  static void check_size(size_t bytes, const std::string& path) {
    if (bytes > kMaxRegexBytes)
      fail("json_schema at {}: the schema's regex would exceed {} bytes (e.g. many references to recursive parts)",
           path, kMaxRegexBytes);
  }

  Rx value_of(const nlohmann::ordered_json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail("json_schema at {}: the schema false allows nothing", path);
      return any_value(ws, kAnyDepth);
    }
    if (!s.is_object()) fail("json_schema at {}: a schema must be an object or a boolean", path);
    if (auto it = s.find("$ref"); it != s.end()) {
      // A schema reached through kRefDepth references to itself already (recursion) allows no further value here,
      // so the recursion ends where the containing schema can do without it (an empty array, an optional property,
      // another alternative).
      const nlohmann::ordered_json& target = resolve(*it, path);
      return refs_.follow(&target, [&] { return value(target, path + "/$ref"); }, "json_schema at " + path);
    }
    if (auto it = s.find("const"); it != s.end()) return regex_escape(it->dump());
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) fail("json_schema at {}/enum: must be a non-empty array", path);
      std::string r;
      for (const auto& v : *it) {
        r += (r.empty() ? "" : "|") + regex_escape(v.dump());
        check_size(r.size(), path);
      }
      return group(r);
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (auto it = s.find(key); it != s.end()) {
        if (!it->is_array() || it->empty()) fail("json_schema at {}/{}: must be a non-empty array", path, key);
        std::vector<std::string> alts;
        size_t bytes = 0;
        for (size_t i = 0; i < it->size(); ++i)
          if (Rx r = value((*it)[i], fmt::format("{}/{}/{}", path, key, i))) {
            check_size(bytes += r->size(), path);
            alts.push_back(*r);
          }
        return alts.empty() ? Rx() : group(join(alts));
      }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1)
        fail("json_schema at {}/allOf: only allOf of one schema is supported", path);
      return value((*it)[0], path + "/allOf/0");
    }
    auto t = s.find("type");
    if (t == s.end()) {  // the type from the keywords present, else any value
      if (s.contains("properties")) return typed(s, "object", path);
      if (s.contains("items") || s.contains("prefixItems")) return typed(s, "array", path);
      return group(any_value(ws, kAnyDepth));
    }
    if (t->is_string()) return typed(s, t->get<std::string>(), path);
    if (t->is_array() && !t->empty()) {
      std::vector<std::string> alts;
      for (const auto& one : *t) {
        if (!one.is_string()) fail("json_schema at {}/type: must name types", path);
        if (Rx r = typed(s, one.get<std::string>(), path)) alts.push_back(*r);
      }
      return alts.empty() ? Rx() : group(join(alts));
    }
    fail("json_schema at {}/type: must be a type name or a list of them", path);
  }

  const nlohmann::ordered_json& resolve(const nlohmann::ordered_json& ref, const std::string& path) const {
    if (!ref.is_string()) fail("json_schema at {}/$ref: must be a string", path);
    const std::string r = ref.get<std::string>();
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (r.rfind(p, 0) == 0) {
        const std::string section = p.substr(2, p.size() - 3), name = r.substr(p.size());
        auto sec = root_.find(section);
        if (sec != root_.end() && sec->is_object())
          if (auto it = sec->find(name); it != sec->end()) return *it;
        fail("json_schema at {}/$ref: '{}' is not defined", path, r);
      }
    }
    if (r == "#") return root_;
    fail("json_schema at {}/$ref: only references to #/$defs/... or #/definitions/... are supported, got '{}'", path,
         r);
  }

  static int64_t count(const nlohmann::ordered_json& s, const char* key, int64_t dflt, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      fail("json_schema at {}/{}: must be a non-negative integer", path, key);
    if (it->get<int64_t>() > 4096) fail("json_schema at {}/{}: at most 4096 is supported", path, key);
    return it->get<int64_t>();
  }

  // minimum / maximum and their exclusive forms (a bound of their own, or draft 4's flags on minimum / maximum) as
  // whole-number bounds: an integer's rounded inwards; a number's must be whole and inclusive.
  static std::pair<std::optional<int64_t>, std::optional<int64_t>> bounds(const nlohmann::ordered_json& s,
                                                                          bool integer, const std::string& path) {
    auto num = [&](const char* key) -> std::optional<double> {
      auto it = s.find(key);
      if (it == s.end() || it->is_boolean()) return std::nullopt;
      if (!it->is_number()) fail("json_schema at {}/{}: must be a number", path, key);
      const double v = it->get<double>();
      if (!(std::fabs(v) <= 1e15)) fail("json_schema at {}/{}: bounds beyond 1e15 are not supported", path, key);
      return v;
    };
    auto flag = [&](const char* key) {
      auto it = s.find(key);
      return it != s.end() && it->is_boolean() && it->get<bool>();
    };
    std::optional<double> mn = num("minimum"), mx = num("maximum");
    bool mn_ex = mn && flag("exclusiveMinimum"), mx_ex = mx && flag("exclusiveMaximum");
    if (auto v = num("exclusiveMinimum"); v && (!mn || *v >= *mn)) mn = v, mn_ex = true;
    if (auto v = num("exclusiveMaximum"); v && (!mx || *v <= *mx)) mx = v, mx_ex = true;
    if (!integer && ((mn && (mn_ex || *mn != std::floor(*mn))) || (mx && (mx_ex || *mx != std::floor(*mx)))))
      fail("json_schema at {}: number bounds must be whole numbers and inclusive (minimum / maximum)", path);
    std::optional<int64_t> lo, hi;
    if (mn) lo = static_cast<int64_t>(mn_ex ? std::floor(*mn) + 1 : std::ceil(*mn));
    if (mx) hi = static_cast<int64_t>(mx_ex ? std::ceil(*mx) - 1 : std::floor(*mx));
    return {lo, hi};
  }

  // multipleOf's value as p / 10^places; p 1 and places 0 when there is none.
  static MultipleOf multiple_of(const nlohmann::ordered_json& s, const std::string& path) {
    MultipleOf mo;
    auto it = s.find("multipleOf");
    if (it == s.end()) return mo;
    if (!it->is_number() || !(it->get<double>() > 0) || !std::isfinite(it->get<double>()))
      fail("json_schema at {}/multipleOf: must be a number above 0", path);
    const double v = it->get<double>();
    for (int m = 0; m <= 9; ++m) {
      const double x = v * static_cast<double>(pow10(m));
      if (x > static_cast<double>(kMaxMultipleOf)) break;
      if (std::round(x) >= 1 && std::fabs(x - std::round(x)) <= 1e-9 * x) {
        mo.p = std::llround(x);
        mo.places = m;
        return mo;
      }
    }
    fail("json_schema at {}/multipleOf: {} is not supported (a whole number up to {} or a decimal of at most 9 places "
         "with at most as many digits)", path, v, kMaxMultipleOf);
  }

  // The values the schema at key allows (an array's rest items, a map's values): absent or true any value, false
  // none.
  Rx element_schema(const nlohmann::ordered_json& s, const char* key, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end() || (it->is_boolean() && it->get<bool>())) return any_value(ws, kAnyDepth - 1);
    if (it->is_boolean()) return Rx();
    return value(*it, fmt::format("{}/{}", path, key));
  }

  // A tuple array: element i of the schemas at prefix_key (prefixItems, or drafts 4-7's items array), the elements
  // after them of the schema at rest_key (items / additionalItems: absent or true any value, false none), lo to hi
  // elements in all (hi < 0: unbounded). An element schema with no value within the recursion bound ends the array
  // before it.
  Rx tuple(const nlohmann::ordered_json& s, const nlohmann::ordered_json& prefix, const char* prefix_key,
           const char* rest_key, int64_t lo, int64_t hi, const std::string& path) {
    if (!prefix.is_array()) fail("json_schema at {}/{}: must be an array of schemas", path, prefix_key);
    std::vector<std::string> elems;
    int64_t cap = hi;  // the most elements an array can hold
    auto limit = [&](int64_t n) { cap = cap < 0 ? n : std::min(cap, n); };
    for (size_t i = 0; i < prefix.size(); ++i) {
      Rx e = value(prefix[i], fmt::format("{}/{}/{}", path, prefix_key, i));
      if (!e) {
        limit(static_cast<int64_t>(i));
        break;
      }
      elems.push_back(group(*e));
    }
    const int64_t P = static_cast<int64_t>(elems.size());
    const Rx rest = element_schema(s, rest_key, path);
    if (!rest) limit(P);
    if (cap >= 0 && lo > cap) return Rx();  // no array of minItems elements
    if (cap == 0) return "\\[" + ws + "\\]";
    const std::string sep = ws + "," + ws;
    // tail: the elements after the first k, each after a comma, built from the end
    std::string tail;
    if (rest && (cap < 0 || cap > P)) {
      const int64_t a = std::max<int64_t>(0, lo - std::max<int64_t>(P, 1)), first = std::max<int64_t>(P, 1);
      tail = group(sep + group(*rest)) +
             (cap < 0 ? fmt::format("{{{},}}", a) : fmt::format("{{{},{}}}", a, cap - first));
    }
    for (int64_t k = P - 1; k >= 1; --k) {
      if (cap >= 0 && k + 1 > cap) continue;  // element k would make too many
      const std::string piece = sep + elems[static_cast<size_t>(k)] + tail;
      tail = k < lo ? piece : group(piece) + "?";
    }
    const std::string body = (P > 0 ? elems[0] : group(*rest)) + tail;
    return "\\[" + ws + (lo > 0 ? body : group(body) + "?") + ws + "\\]";
  }

  Rx typed(const nlohmann::ordered_json& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      if (auto p = s.find("pattern"); p != s.end()) {
        if (!p->is_string()) fail("json_schema at {}/pattern: must be a string", path);
        std::string body = p->get<std::string>();
        if (!body.empty() && body.front() == '^') body.erase(0, 1);
        if (!body.empty() && body.back() == '$' && (body.size() < 2 || body[body.size() - 2] != '\\')) body.pop_back();
        return "\"" + group(body) + "\"";
      }
      if (auto f = s.find("format"); f != s.end()) {
        if (!f->is_string()) fail("json_schema at {}/format: must be a string", path);
        if (const std::string r = format_regex(f->get<std::string>()); !r.empty()) return "\"" + group(r) + "\"";
      }
      const int64_t lo = count(s, "minLength", 0, path), hi = count(s, "maxLength", -1, path);
      if (lo == 0 && hi < 0) return kString;
      if (hi >= 0 && hi < lo) fail("json_schema at {}: maxLength is below minLength", path);
      return "\"" + kStringChar + (hi < 0 ? fmt::format("{{{},}}", lo) : fmt::format("{{{},{}}}", lo, hi)) + "\"";
    }
    if (type == "integer" || type == "number") {
      const bool integer = type == "integer";
      const MultipleOf mo = multiple_of(s, path);
      // a number with a whole multipleOf is written as an integer: its bounds are an integer's
      const auto [lo, hi] = bounds(s, integer || (mo.places == 0 && mo.p > 1), path);
      if (!integer && mo.places > 0) {
        if (lo || hi) fail("json_schema at {}: multipleOf a fraction with minimum / maximum is not supported", path);
        return number_multiples(mo);
      }
      // integers (a number with a whole multipleOf is written as one): the multiples of k in [lo, hi]
      if (const int64_t k = mo.p / std::gcd(mo.p, pow10(mo.places)); k > 1) {
        if (lo && hi && *lo + (k - *lo % k) % k > *hi)
          fail("json_schema at {}: no multiple of {} lies within its bounds", path, k);
        return group(int_range(lo, hi, k));
      }
      if (!lo && !hi) return integer ? kInteger : kNumber;
      const std::string r = integer ? int_range(lo, hi) : number_range(lo, hi);
      if (r.empty()) fail("json_schema at {}: no {} lies within its bounds", path, type);
      return group(r);
    }
    if (type == "boolean") return kBoolean;
    if (type == "null") return kNull;
    if (type == "array") {
      const int64_t lo = count(s, "minItems", 0, path), hi = count(s, "maxItems", -1, path);
      if (hi >= 0 && hi < lo) fail("json_schema at {}: maxItems is below minItems", path);
      if (auto p = s.find("prefixItems"); p != s.end()) return tuple(s, *p, "prefixItems", "items", lo, hi, path);
      if (auto p = s.find("items"); p != s.end() && p->is_array())
        return tuple(s, *p, "items", "additionalItems", lo, hi, path);
      const Rx item = element_schema(s, "items", path);  // absent or true: any value; false: none
      if (!item) return lo == 0 ? Rx("\\[" + ws + "\\]") : Rx();  // no item value: only the empty array
      return list(ws, "\\[", group(*item), "\\]", lo, hi);
    }
    if (type == "object") {
      auto props = s.find("properties");
      if (props == s.end() || !props->is_object() || props->empty()) {
        // a map: any keys, the values of additionalProperties (absent or true: any value; false: none),
        // minProperties to maxProperties of them
        const int64_t lo = count(s, "minProperties", 0, path), hi = count(s, "maxProperties", -1, path);
        if (hi >= 0 && hi < lo) fail("json_schema at {}: maxProperties is below minProperties", path);
        const Rx val = element_schema(s, "additionalProperties", path);
        if (!val) return lo == 0 ? Rx("\\{" + ws + "\\}") : Rx();
        return list(ws, "\\{", kString + ws + ":" + ws + group(*val), "\\}", lo, hi);
      }
      // Properties in the schema's order, those not in `required` optional. g: the lists of properties 0..k in order
      // that hold every required one, at least one property: g(k) = g(k - 1) followed by ", P_k" (optionally when
      // P_k is optional), or P_k alone when no required property comes before it: linear in the properties. Once a
      // required property has come, g is one alternative and grows flat (no group around it), so only the
      // properties up to the first required one nest.
      std::set<std::string> required;
      if (auto req = s.find("required"); req != s.end()) {
        if (!req->is_array()) fail("json_schema at {}/required: must be an array of names", path);
        for (const auto& n : *req) {
          if (!n.is_string()) fail("json_schema at {}/required: must be an array of names", path);
          if (!props->contains(n.get<std::string>()))
            fail("json_schema at {}/required: '{}' is not one of the properties", path, n.get<std::string>());
          required.insert(n.get<std::string>());
        }
      }
      std::string g;
      bool any_required = false, g_alternatives = false;  // g_alternatives: g is several alternatives (a top-level |)
      for (auto it = props->begin(); it != props->end(); ++it) {
        const Rx v = value(it.value(), path + "/properties/" + it.key());
        const bool optional = !required.count(it.key());
        if (!v) {  // no value for it: an optional property is left out, a required one leaves no object
          if (optional) continue;
          return std::nullopt;
        }
        const std::string p = regex_escape(nlohmann::ordered_json(it.key()).dump()) + ws + ":" + ws + group(*v);
        std::vector<std::string> alts;
        if (!g.empty())
          alts.push_back((g_alternatives ? group(g) : g) + group(ws + "," + ws + p) + (optional ? "?" : ""));
        if (!any_required) alts.push_back(p);
        g_alternatives = alts.size() > 1;
        g = g_alternatives ? join(alts) : alts[0];
        any_required |= !optional;
        check_size(g.size(), path);
      }
      if (g.empty()) return "\\{" + ws + "\\}";
      return "\\{" + ws + group(g) + (any_required ? "" : "?") + ws + "\\}";
    }
    fail("json_schema at {}/type: unknown type '{}'", path, type);
  }

  const nlohmann::ordered_json& root_;
  const std::string& ws;  // whitespace between tokens
  build::RefStack refs_;  // the $ref targets being expanded
  int depth_ = 0;
};

}  // namespace

std::string regex_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (std::string_view("\\^$.|?*+()[]{}-/").find(c) != std::string_view::npos) out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\x{:02X}", static_cast<unsigned>(static_cast<unsigned char>(c)));
      continue;
    }
    out += c;
  }
  return out;
}

std::string json_schema_regex(const nlohmann::ordered_json& schema, bool compact) {
  Converter c(schema, compact);
  Rx r = c.value(schema, "#");
  if (!r) fail("json_schema: the schema allows no value (its references recurse with no way to end)");
  return *r;
}

const std::string& json_object_regex() {
  static const std::string r =
      list(kFreeWs, "\\{", kString + kFreeWs + ":" + kFreeWs + group(any_value(kFreeWs, kAnyDepth - 1)), "\\}", 0, -1);
  return r;
}

}  // namespace mlaserve::structured
