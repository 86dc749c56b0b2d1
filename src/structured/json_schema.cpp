#include "structured/json_schema.h"

#include <fmt/format.h>

#include "core/error.h"

namespace mlaserve::structured {

namespace {

const std::string kFreeWs = "[ \\t\\n\\r]*", kCompactWs = " ?";
const std::string kString = "\"([^\"\\\\\\x00-\\x1F]|\\\\([\"\\\\/bfnrt]|u[0-9a-fA-F]{4}))*\"";
const std::string kStringChar = "([^\"\\\\\\x00-\\x1F]|\\\\([\"\\\\/bfnrt]|u[0-9a-fA-F]{4}))";
const std::string kInteger = "-?(0|[1-9][0-9]*)";
const std::string kNumber = "-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?";
const std::string kBoolean = "(true|false)";
const std::string kNull = "null";

std::string group(const std::string& r) { return "(" + r + ")"; }

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

  std::string value(const nlohmann::ordered_json& s, const std::string& path, int refs) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) fail("json_schema at {}: the schema false allows nothing", path);
      return any_value(ws, kAnyDepth);
    }
    if (!s.is_object()) fail("json_schema at {}: a schema must be an object or a boolean", path);
    if (auto it = s.find("$ref"); it != s.end()) {
      if (refs > 16)
        fail("json_schema at {}: $ref nests more than 16 deep (recursive schemas are not supported)", path);
      return value(resolve(*it, path), path + "/$ref", refs + 1);
    }
    if (auto it = s.find("const"); it != s.end()) return regex_escape(it->dump());
    if (auto it = s.find("enum"); it != s.end()) {
      if (!it->is_array() || it->empty()) fail("json_schema at {}/enum: must be a non-empty array", path);
      std::string r;
      for (const auto& v : *it) r += (r.empty() ? "" : "|") + regex_escape(v.dump());
      return group(r);
    }
    for (const char* key : {"anyOf", "oneOf"})
      if (auto it = s.find(key); it != s.end()) {
        if (!it->is_array() || it->empty()) fail("json_schema at {}/{}: must be a non-empty array", path, key);
        std::string r;
        for (size_t i = 0; i < it->size(); ++i)
          r += (i ? "|" : "") + group(value((*it)[i], fmt::format("{}/{}/{}", path, key, i), refs));
        return group(r);
      }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1)
        fail("json_schema at {}/allOf: only allOf of one schema is supported", path);
      return value((*it)[0], path + "/allOf/0", refs);
    }
    auto t = s.find("type");
    if (t == s.end()) {  // the type from the keywords present, else any value
      if (s.contains("properties")) return typed(s, "object", path, refs);
      if (s.contains("items")) return typed(s, "array", path, refs);
      return group(any_value(ws, kAnyDepth));
    }
    if (t->is_string()) return typed(s, t->get<std::string>(), path, refs);
    if (t->is_array() && !t->empty()) {
      std::string r;
      for (const auto& one : *t) {
        if (!one.is_string()) fail("json_schema at {}/type: must name types", path);
        r += (r.empty() ? "" : "|") + group(typed(s, one.get<std::string>(), path, refs));
      }
      return group(r);
    }
    fail("json_schema at {}/type: must be a type name or a list of them", path);
  }

 private:
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
    if (r == "#") fail("json_schema at {}/$ref: recursive schemas are not supported", path);
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

  std::string typed(const nlohmann::ordered_json& s, const std::string& type, const std::string& path, int refs) {
    if (type == "string") {
      if (auto p = s.find("pattern"); p != s.end()) {
        if (!p->is_string()) fail("json_schema at {}/pattern: must be a string", path);
        std::string body = p->get<std::string>();
        if (!body.empty() && body.front() == '^') body.erase(0, 1);
        if (!body.empty() && body.back() == '$' && (body.size() < 2 || body[body.size() - 2] != '\\')) body.pop_back();
        return "\"" + group(body) + "\"";
      }
      const int64_t lo = count(s, "minLength", 0, path), hi = count(s, "maxLength", -1, path);
      if (lo == 0 && hi < 0) return kString;
      if (hi >= 0 && hi < lo) fail("json_schema at {}: maxLength is below minLength", path);
      return "\"" + kStringChar + (hi < 0 ? fmt::format("{{{},}}", lo) : fmt::format("{{{},{}}}", lo, hi)) + "\"";
    }
    if (type == "integer") return kInteger;
    if (type == "number") return kNumber;
    if (type == "boolean") return kBoolean;
    if (type == "null") return kNull;
    if (type == "array") {
      const int64_t lo = count(s, "minItems", 0, path), hi = count(s, "maxItems", -1, path);
      if (hi >= 0 && hi < lo) fail("json_schema at {}: maxItems is below minItems", path);
      auto it = s.find("items");
      const std::string item = it == s.end() ? group(any_value(ws, kAnyDepth - 1))
                                             : group(value(*it, path + "/items", refs));
      return list(ws, "\\[", item, "\\]", lo, hi);
    }
    if (type == "object") {
      auto props = s.find("properties");
      if (props == s.end() || !props->is_object() || props->empty())
        return list(ws, "\\{", kString + ws + ":" + ws + group(any_value(ws, kAnyDepth - 1)), "\\}", 0, -1);
      std::string r = "\\{" + ws;
      bool first = true;
      for (auto it = props->begin(); it != props->end(); ++it) {
        if (!first) r += ws + "," + ws;
        first = false;
        r += regex_escape(nlohmann::ordered_json(it.key()).dump()) + ws + ":" + ws +
             group(value(it.value(), path + "/properties/" + it.key(), refs));
      }
      return r + ws + "\\}";
    }
    fail("json_schema at {}/type: unknown type '{}'", path, type);
  }

  const nlohmann::ordered_json& root_;
  const std::string& ws;  // whitespace between tokens
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
  return c.value(schema, "#", 0);
}

const std::string& json_object_regex() {
  static const std::string r =
      list(kFreeWs, "\\{", kString + kFreeWs + ":" + kFreeWs + group(any_value(kFreeWs, kAnyDepth - 1)), "\\}", 0, -1);
  return r;
}

}  // namespace mlaserve::structured
