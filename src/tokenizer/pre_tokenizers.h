// Pre-tokenizers of tokenizer.json ("pre_tokenizer"): Sequence, Split (regex or literal pattern, every
// SplitDelimiterBehavior, invert), ByteLevel (with and without its GPT-2 regex), Digits, Metaspace, Whitespace,
// WhitespaceSplit. Each one splits every piece into smaller pieces (and may rewrite them, as ByteLevel maps
// bytes to printable characters). Empty pieces are dropped, as Hugging Face does.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::tok {

struct Piece {
  std::string text;
  bool at_origin = false;  // starts at byte 0 of the original input (Metaspace prepend_scheme "first")
};
using Pieces = std::vector<Piece>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their splits. `scratch` is reused storage to avoid allocations.
  virtual void apply(Pieces& pieces, Pieces& scratch) const = 0;
};

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& spec, const std::string& where);

// Not a tokenizer.json type: the cuts the tiktoken wrappers of Kimi / Llama 3 make before encoding. Each piece is cut
// into chunks of `max_chars` code points, and a chunk again wherever a run of whitespace or of non-whitespace
// (Python's str.isspace) would pass `max_run` code points (tiktoken's _split_whitespaces_or_nonwhitespaces).
std::unique_ptr<PreTokenizer> make_long_run_split(size_t max_chars, size_t max_run);
// The parts applied in order (a Sequence); null parts are skipped.
std::unique_ptr<PreTokenizer> make_pre_tokenizer_sequence(std::vector<std::unique_ptr<PreTokenizer>> parts);

// GPT-2's byte to printable-character table (bytes_to_unicode): byte b is written as code point byte_char(b).
char32_t byte_char(unsigned char b);
// UTF-8 of byte_char(b), for all 256 bytes.
const std::string& byte_char_utf8(unsigned char b);
// Inverse: the byte a character stands for, or -1 when it is not one of the 256.
int char_byte(char32_t c);

}  // namespace mlaserve::tok
