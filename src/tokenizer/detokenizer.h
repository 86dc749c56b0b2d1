// Incremental detokenization for streaming: feed generated ids one at a time, get the text they complete.
// Never emits part of a UTF-8 character (a byte-level token can end mid-character: that text is held until the
// character completes), and the concatenation of all pieces plus finish() equals tokenizer.decode(all ids).
//
// Method: decode a small window of ids twice, with and without the newest ids; the difference is new text once
// it no longer ends in U+FFFD (an incomplete character). The window then moves to the last emitted boundary,
// which is a character boundary, so decoding restarts cleanly there (works for every decoder, including
// Metaspace's first-token rule, because both decodes share the window's first token).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace mlaserve::tok {

class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok, bool skip_special_tokens = false)
      : tok_(tok), skip_special_(skip_special_tokens) {}

  // Adds one id; returns the newly completed text ("" while a character is incomplete).
  std::string push(int32_t id);
  // Ends the stream: returns what is still held back (e.g. U+FFFD for bytes that never completed a character).
  std::string finish();

 private:
  std::string decode_range(size_t b, size_t e) const;
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;  // ids from the window start on
  size_t read_ = 0;           // ids_[0, read_) have been emitted as text
};

}  // namespace mlaserve::tok
