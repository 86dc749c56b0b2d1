// Normalizers of tokenizer.json ("normalizer"): Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Replace, Strip,
// Prepend, StripAccents. They rewrite a text segment in place (offsets are not tracked: mlaserve needs ids only).
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace mlaserve::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& text) const = 0;
};

// Builds the normalizer described by `spec` (a tokenizer.json "normalizer" object); nullptr for JSON null.
// `where` is the JSON path used in error messages.
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& spec, const std::string& where);

}  // namespace mlaserve::tok
