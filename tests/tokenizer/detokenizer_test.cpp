// Streaming detokenization: pieces are whole UTF-8 characters and concatenate to the full decode, for the DeepSeek
// corpus (with and without skip_special_tokens), random id sequences (byte tokens that split characters) and the
// other tokenizer families (Metaspace / byte-fallback decoders).
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "test_data.h"
#include "tokenizer/detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace mlaserve::tok {
namespace {

// Streams `ids`; checks every piece is valid UTF-8 and returns their concatenation.
std::string stream(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip, int* bad_pieces) {
  IncrementalDetokenizer d(tok, skip);
  std::string all;
  auto take = [&](const std::string& p) {
    if (find_invalid_utf8(p) != std::string::npos) ++*bad_pieces;
    all += p;
  };
  for (int32_t id : ids) take(d.push(id));
  take(d.finish());
  return all;
}

TEST(Detokenizer, DeepSeekCorpusStreamsToFullDecode) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  int bad_pieces = 0, mismatches = 0;
  for (const auto& text : testing::corpus_texts()) {
    std::vector<int32_t> ids = tok->encode(text);
    for (bool skip : {false, true}) {
      std::string s = stream(*tok, ids, skip, &bad_pieces);
      std::string full = tok->decode(ids, skip);
      if (s != full && ++mismatches <= 5) ADD_FAILURE() << testing::show(text) << " skip=" << skip;
    }
  }
  EXPECT_EQ(bad_pieces, 0);
  EXPECT_EQ(mismatches, 0);
}

TEST(Detokenizer, HoldsPartialCharacters) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  // A 4-byte emoji split over byte-level tokens: nothing is emitted until it is complete.
  std::vector<int32_t> ids = tok->encode("a😀😀😀b");
  IncrementalDetokenizer d(*tok);
  std::vector<std::string> pieces;
  for (int32_t id : ids) pieces.push_back(d.push(id));
  pieces.push_back(d.finish());
  std::string all;
  for (const auto& p : pieces) {
    EXPECT_EQ(find_invalid_utf8(p), std::string::npos);
    all += p;
  }
  EXPECT_EQ(all, "a😀😀😀b");
  // Bytes that never complete a character come out once, at finish(), as U+FFFD.
  auto lead = tok->token_to_id("ð");  // byte 0xF0 alone
  ASSERT_TRUE(lead.has_value());
  IncrementalDetokenizer d2(*tok);
  EXPECT_EQ(d2.push(*lead), "");
  EXPECT_EQ(d2.finish(), "\xEF\xBF\xBD");
}

TEST(Detokenizer, RandomIdsStreamToFullDecode) {
  auto tok = Tokenizer::from_file(testing::deepseek_dir() + "/tokenizer.json");
  std::mt19937 rng(8);
  // Mostly single-byte tokens (ids < 256 are byte-level bytes), some words and special tokens.
  std::uniform_int_distribution<int32_t> byte_tok(3, 258), any_tok(0, static_cast<int32_t>(tok->vocab_size()) - 1);
  int bad_pieces = 0, mismatches = 0;
  for (int n = 0; n < 2000; ++n) {
    std::vector<int32_t> ids(rng() % 24);
    for (auto& id : ids) id = rng() % 3 ? byte_tok(rng) : any_tok(rng);
    for (bool skip : {false, true}) {
      if (stream(*tok, ids, skip, &bad_pieces) != tok->decode(ids, skip)) ++mismatches;
    }
  }
  EXPECT_EQ(bad_pieces, 0);
  EXPECT_EQ(mismatches, 0);
}

TEST(Detokenizer, OtherFamiliesStreamToFullDecode) {
  auto texts = testing::corpus_texts();
  for (const char* name : {"metaspace_bytefallback", "metaspace_unk_always", "llama_legacy", "bytelevel_nfkc_lower",
                           "suffix_prefix_whitespace"}) {
    auto tok = Tokenizer::from_file(std::string(MLASERVE_TOKENIZER_FAMILIES) + "/" + name + ".tokenizer.json");
    int bad_pieces = 0, mismatches = 0;
    for (size_t i = 0; i < 600 && i < texts.size(); ++i) {
      std::vector<int32_t> ids = tok->encode(texts[i]);
      if (stream(*tok, ids, false, &bad_pieces) != tok->decode(ids) && ++mismatches <= 3)
        ADD_FAILURE() << name << ": " << testing::show(texts[i]);
    }
    EXPECT_EQ(bad_pieces, 0) << name;
    EXPECT_EQ(mismatches, 0) << name;
  }
}

}  // namespace
}  // namespace mlaserve::tok
