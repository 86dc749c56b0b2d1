#include "tokenizer/normalizers.h"

#include <vector>

#include "core/error.h"
#include "tokenizer/json_util.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

class SequenceNormalizer : public Normalizer {
 public:
  std::vector<std::unique_ptr<Normalizer>> parts;
  void normalize(std::string& t) const override {
    for (const auto& p : parts) p->normalize(t);
  }
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormForm f) : form_(f) {}
  void normalize(std::string& t) const override { t = tok::normalize(t, form_); }

 private:
  NormForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  void normalize(std::string& t) const override { t = lowercase(t); }
};

class StripAccentsNormalizer : public Normalizer {
 public:
  void normalize(std::string& t) const override {
    std::string out;
    out.reserve(t.size());
    size_t i = 0;
    while (i < t.size()) {
      size_t b = i;
      char32_t c = next_code_point(t, i);
      if (!is_combining_mark(c)) out.append(t, b, i - b);
    }
    t = std::move(out);
  }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& t) const override {
    size_t b = 0, e = t.size();
    if (left_) {
      size_t i = 0;
      while (i < e) {
        size_t k = i;
        if (!is_whitespace(next_code_point(t, k))) break;
        i = k;
      }
      b = i;
    }
    if (right_) {
      size_t i = e;
      while (i > b) {
        size_t k = i;
        if (!is_whitespace(prev_code_point(t, k))) break;
        i = k;
      }
      e = i;
    }
    t = t.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string p) : prefix_(std::move(p)) {}
  void normalize(std::string& t) const override {
    if (!t.empty()) t.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

// Replace: every non-overlapping match of a literal or regex pattern becomes `content`.
class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void normalize(std::string& t) const override {
    std::string out;
    size_t prev = 0;
    bool any = false;
    re_->for_each_match(t, [&](size_t s, size_t e) {
      if (s == e) return;  // an empty match replaces nothing
      any = true;
      out.append(t, prev, s - prev);
      out += content_;
      prev = e;
    });
    if (!any) return;
    out.append(t, prev, std::string::npos);
    t = std::move(out);
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

}  // namespace

std::unique_ptr<Regex> make_pattern(const nlohmann::json& spec, const std::string& where) {
  MLA_CHECK(spec.is_object() && spec.size() == 1, "{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}",
            where);
  if (spec.contains("String")) return std::make_unique<Regex>(Regex::escape(get_string(spec, "String", where)), where);
  if (spec.contains("Regex")) return std::make_unique<Regex>(get_string(spec, "Regex", where), where);
  fail("{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, got {}", where, spec.dump());
}

std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  std::string type = get_string(spec, "type", where);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceNormalizer>();
    const auto& list = get_field(spec, "normalizers", where);
    MLA_CHECK(list.is_array(), "{}.normalizers: expected an array", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto n = make_normalizer(list[i], fmt::format("{}.normalizers[{}]", where, i));
      if (n) seq->parts.push_back(std::move(n));
    }
    return seq;
  }
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(NormForm::NFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(NormForm::NFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(NormForm::NFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(NormForm::NFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (type == "Strip")
    return std::make_unique<StripNormalizer>(get_bool(spec, "strip_left", where, true),
                                             get_bool(spec, "strip_right", where, true));
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(get_string(spec, "prepend", where));
  if (type == "Replace")
    return std::make_unique<ReplaceNormalizer>(make_pattern(get_field(spec, "pattern", where), where + ".pattern"),
                                               get_string(spec, "content", where));
  fail("{}: unsupported normalizer type '{}' (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Strip, "
       "Prepend, StripAccents)",
       where, type);
}

}  // namespace mlaserve::tok
