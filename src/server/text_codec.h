// TextCodec: the seam between the server and a tokenizer. The server needs token ids <-> text and the model's
// chat template; everything else text-level (incremental detokenizing, stop strings) is built on top of these
// calls in text_stream.h, so any tokenizer library plugs in by implementing this interface.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace mlaserve::server {

// Ids -> text a piece at a time: push() returns only text later ids cannot change (never half a UTF-8
// character); flush() returns what is held back at the end.
class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;
  virtual std::string push(const std::vector<int32_t>& ids) = 0;
  virtual std::string flush() = 0;
};

class TextCodec {
 public:
  virtual ~TextCodec() = default;
  // Text -> ids; add_special_tokens adds the tokenizer's BOS (as Hugging Face's encode does).
  virtual std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const = 0;
  // Ids -> text. Bytes of an incomplete UTF-8 sequence at the end decode to U+FFFD (as Hugging Face does).
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const = 0;
  // OpenAI `messages` (role + string content) rendered with the model's chat template. The result already holds
  // the template's special tokens (BOS), so it is encoded with add_special_tokens = false. `extra`: more template
  // variables (chat_template_kwargs).
  virtual std::string apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt,
                                          const nlohmann::json& extra) const = 0;
  // The same with the Jinja template `source` in place of the model's (a request's own: vLLM's chat_template, taken
  // with --trust-request-chat-template); throws when it does not parse or fails. By default a codec takes none.
  virtual std::string apply_chat_template_source(const std::string& source, const nlohmann::json& messages,
                                                 bool add_generation_prompt, const nlohmann::json& extra) const;
  // The text of one token for logprob listings (special tokens included).
  virtual std::string token_text(int32_t id) const { return decode({id}, false); }
  // The vocabulary's string for an id (Hugging Face's convert_ids_to_tokens: byte-level symbols such as "Ġworld"),
  // or nullopt for an id it lacks; by default the token's text.
  virtual std::optional<std::string> token_piece(int32_t id) const { return token_text(id); }
  virtual std::string name_or_path() const = 0;
  // One more than the largest token id (the bench client draws random ids below it).
  virtual size_t vocab_size() const = 0;
  // Every id's bytes in generated text (constrained decoding): special and added tokens as the byte 0xFF and their
  // text (no UTF-8 text holds 0xFF, so a constraint allows them only by naming them, regex `\C`); empty for unused ids
  // and for tokens whose bytes hold 0xFF (never part of UTF-8 text). The default: decode() of each id (a token
  // holding part of a UTF-8 character then reads as U+FFFD).
  virtual std::vector<std::string> token_bytes() const;
  // A streaming decoder; the default (text_stream.h) works over decode() for any tokenizer.
  virtual std::unique_ptr<StreamDecoder> stream_decoder(bool skip_special_tokens) const;
};

// vLLM's bad_words as token sequences: each word without its leading blanks, and once more after a space where that
// gives a different first token and as many tokens (the word inside a text, as most BPE vocabularies spell it).
std::vector<std::vector<int32_t>> bad_words_token_ids(const TextCodec& codec, const std::vector<std::string>& words);

// The tokenizer found at `path` (a directory with tokenizer.json / tokenizer_config.json), or nullptr when this
// build has no tokenizer library. Throws mlaserve::Error when the files are missing or malformed.
// `chat_template`: a Jinja file that replaces the tokenizer's chat templates (serve --chat-template), or empty.
std::unique_ptr<TextCodec> load_text_codec(const std::string& path, const std::string& chat_template = "");

}  // namespace mlaserve::server
