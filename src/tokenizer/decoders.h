// Decoders of tokenizer.json ("decoder"): ByteLevel, Sequence, Metaspace, Replace, ByteFallback, Fuse, Strip,
// BPEDecoder. A decoder turns the list of token strings into a list of strings that are then concatenated
// (Hugging Face's decode_chain).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::tok {

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
  // As decode_chain, but bytes that are not well-formed UTF-8 are kept as they are (ByteLevel: no U+FFFD), for a
  // token's raw bytes. Decoders without such bytes decode as decode_chain does.
  virtual void decode_chain_raw(std::vector<std::string>& tokens) const { decode_chain(tokens); }
};

std::unique_ptr<Decoder> make_decoder(const nlohmann::json& spec, const std::string& where);

}  // namespace mlaserve::tok
