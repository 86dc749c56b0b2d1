#include "tokenizer/decoders.h"

#include "core/error.h"
#include "tokenizer/json_util.h"
#include "tokenizer/pre_tokenizers.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

class SequenceDecoder : public Decoder {
 public:
  std::vector<std::unique_ptr<Decoder>> parts;
  void decode_chain(std::vector<std::string>& t) const override {
    for (const auto& p : parts) p->decode_chain(t);
  }
  void decode_chain_raw(std::vector<std::string>& t) const override {
    for (const auto& p : parts) p->decode_chain_raw(t);
  }
};

// ByteLevel: each token's characters map back to bytes (a token with any other character keeps its UTF-8 bytes,
// e.g. added tokens); all bytes are then read as UTF-8 with U+FFFD for ill-formed parts. One output string.
class ByteLevelDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    decode_chain_raw(tokens);
    tokens[0] = utf8_lossy(tokens[0]);
  }
  void decode_chain_raw(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& t : tokens) {
      size_t start = bytes.size();
      size_t i = 0;
      bool ok = true;
      while (i < t.size()) {
        int b = char_byte(next_code_point(t, i));
        if (b < 0) {
          ok = false;
          break;
        }
        bytes += static_cast<char>(b);
      }
      if (!ok) {
        bytes.resize(start);
        bytes += t;
      }
    }
    tokens.assign(1, std::move(bytes));
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string rep, bool prepend) : rep_(std::move(rep)), prepend_(prepend) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& t = tokens[i];
      size_t p = 0;
      while (p < t.size()) {
        if (t.compare(p, rep_.size(), rep_) == 0) {
          // In the first token the replacement character is dropped rather than turned into a space (HF).
          if (!(i == 0 && prepend_)) out += ' ';
          p += rep_.size();
        } else {
          out += t[p++];
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string rep_;
  bool prepend_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> re, std::string content) : re_(std::move(re)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      std::string out;
      size_t prev = 0;
      re_->for_each_match(t, [&](size_t s, size_t e) {
        if (s == e) return;
        out.append(t, prev, s - prev);
        out += content_;
        prev = e;
      });
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  std::unique_ptr<Regex> re_;
  std::string content_;
};

// ByteFallback: runs of <0xXX> tokens become the text of their bytes, or one U+FFFD per byte when not UTF-8.
class ByteFallbackDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string bytes;
    size_t nbytes = 0;
    auto flush = [&] {
      if (!nbytes) return;
      if (find_invalid_utf8(bytes) == std::string::npos) {
        out.push_back(bytes);
      } else {
        for (size_t k = 0; k < nbytes; ++k) out.push_back("\xEF\xBF\xBD");
      }
      bytes.clear();
      nbytes = 0;
    };
    for (auto& t : tokens) {
      int b = byte_token(t);
      if (b >= 0) {
        bytes += static_cast<char>(b);
        ++nbytes;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }
  static int byte_token(const std::string& t) {
    if (t.size() != 6 || t[0] != '<' || t[1] != '0' || t[2] != 'x' || t[5] != '>') return -1;
    int h = hexval(t[3]), l = hexval(t[4]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class FuseDecoder : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

// Strip: removes up to `start` leading and `stop` trailing occurrences of one character from each token.
class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop) : c_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      size_t b = 0, e = t.size();
      for (size_t k = 0; k < start_ && e - b >= c_.size() && t.compare(b, c_.size(), c_) == 0; ++k) b += c_.size();
      for (size_t k = 0; k < stop_ && e - b >= c_.size() && t.compare(e - c_.size(), c_.size(), c_) == 0; ++k)
        e -= c_.size();
      t = t.substr(b, e - b);
    }
  }

 private:
  std::string c_;
  size_t start_, stop_;
};

// BPEDecoder: the end-of-word suffix becomes a space (none after the last token).
class BpeDecoder : public Decoder {
 public:
  explicit BpeDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string& t = tokens[i];
      std::string rep = i + 1 == tokens.size() ? "" : " ";
      std::string out;
      size_t p = 0;
      while (!suffix_.empty() && p < t.size()) {
        size_t f = t.find(suffix_, p);
        if (f == std::string::npos) break;
        out.append(t, p, f - p);
        out += rep;
        p = f + suffix_.size();
      }
      out.append(t, p, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const nlohmann::json& spec, const std::string& where) {
  if (spec.is_null()) return nullptr;
  std::string type = get_string(spec, "type", where);
  if (type == "Sequence") {
    auto seq = std::make_unique<SequenceDecoder>();
    const auto& list = get_field(spec, "decoders", where);
    MLA_CHECK(list.is_array(), "{}.decoders: expected an array", where);
    for (size_t i = 0; i < list.size(); ++i) {
      auto d = make_decoder(list[i], fmt::format("{}.decoders[{}]", where, i));
      if (d) seq->parts.push_back(std::move(d));
    }
    return seq;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    std::string rep = spec.contains("replacement") ? get_string(spec, "replacement", where) : "\xE2\x96\x81";
    bool prepend = true;
    if (spec.contains("prepend_scheme"))
      prepend = get_string(spec, "prepend_scheme", where) != "never";
    else
      prepend = get_bool(spec, "add_prefix_space", where, true);
    return std::make_unique<MetaspaceDecoder>(rep, prepend);
  }
  if (type == "Replace")
    return std::make_unique<ReplaceDecoder>(make_pattern(get_field(spec, "pattern", where), where + ".pattern"),
                                            get_string(spec, "content", where));
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    auto n = [&](const char* k) {
      const auto& v = get_field(spec, k, where);
      MLA_CHECK(v.is_number_unsigned(), "{}.{}: expected a non-negative integer", where, k);
      return v.get<size_t>();
    };
    return std::make_unique<StripDecoder>(get_string(spec, "content", where), n("start"), n("stop"));
  }
  if (type == "BPEDecoder") return std::make_unique<BpeDecoder>(opt_string(spec, "suffix", where).value_or("</w>"));
  fail("{}: unsupported decoder type '{}' (supported: ByteLevel, Sequence, Metaspace, Replace, ByteFallback, Fuse, "
       "Strip, BPEDecoder)",
       where, type);
}

}  // namespace mlaserve::tok
