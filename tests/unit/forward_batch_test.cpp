// ForwardBatch helpers that CUDA graphs rely on: which steps may replay a graph, how a batch is padded to a graph's
// size, and the recorded sizes.
#include <gtest/gtest.h>

#include "engine/rank_set.h"
#include "model/forward_batch.h"

namespace mlaserve {
namespace {

ForwardBatch decode_batch() {
  ForwardBatchBuilder bb(4);
  bb.add(std::vector<int32_t>{11}, 5, std::vector<int32_t>{3, 7}, false);         // position 5: page 7
  bb.add(std::vector<int32_t>{12}, 0, std::vector<int32_t>{9}, false);            // a one-token prompt
  bb.add(std::vector<int32_t>{13}, 9, std::vector<int32_t>{1, 2, 4}, false);      // three pages
  return bb.finish();
}

TEST(ForwardBatch, GraphBatches) {
  EXPECT_TRUE(is_graph_batch(decode_batch()));
  ForwardBatchBuilder bb(4);
  bb.add(std::vector<int32_t>{1, 2}, 0, std::vector<int32_t>{0}, false);
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // a two-token prefill
  bb.add(std::vector<int32_t>{1}, 0, std::vector<int32_t>{0}, ForwardBatchBuilder::Logits::None);
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // no logits asked
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // empty
  // A decode token with its drafts (absorbed, every token's logits) next to a decode token: a graph batch.
  bb.add(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4}, true);
  bb.absorb_last();
  bb.add(std::vector<int32_t>{8}, 4, std::vector<int32_t>{3, 5}, false);
  EXPECT_TRUE(is_graph_batch(bb.finish()));
  bb.add(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4}, true);
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // the same tokens as a prefill chunk (expanded form)
  bb.add(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4}, false);
  bb.absorb_last();
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // only the last token's logits
  bb.add(std::vector<int32_t>{8}, 4, std::vector<int32_t>{3, 5}, false);
  bb.add(std::vector<int32_t>{1, 2}, 0, std::vector<int32_t>{0}, false);
  EXPECT_FALSE(is_graph_batch(bb.finish()));  // a prompt next to a decode token
}

// A decode token with its drafts is marked to attend in the absorbed form; the mark travels with the batch to other
// nodes; batches without marks carry none.
TEST(ForwardBatch, AbsorbedSequencesAreMarkedAndSerialized) {
  ForwardBatchBuilder bb(4);
  bb.add(std::vector<int32_t>{1, 2, 3}, 0, std::vector<int32_t>{0}, false);      // a prompt: expanded
  bb.add(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4}, true);  // a decode token and two drafts
  bb.absorb_last();
  bb.hidden_of_last();
  bb.add(std::vector<int32_t>{8}, 4, std::vector<int32_t>{3, 5}, false);         // a decode token
  bb.hidden_of_last();
  ForwardBatch b = bb.finish();
  b.kv_saves = {7, 0, 9, 1};  // the hierarchical cache's copies travel too
  b.kv_loads = {1, 11};
  b.hidden_states = false;  // (the rows' routed experts only)
  EXPECT_EQ(b.hidden_rows, (std::vector<int32_t>{3, 4, 5, 6}));  // the second and third sequences' tokens
  EXPECT_EQ(b.seq_absorbed, (std::vector<int32_t>{0, 1, 0}));
  EXPECT_FALSE(b.absorbed_under_auto(0));
  EXPECT_TRUE(b.absorbed_under_auto(1));
  EXPECT_TRUE(b.absorbed_under_auto(2));  // one new token
  std::string wire;
  serialize(b, wire);
  const char* p = wire.data();
  const ForwardBatch back = deserialize_forward_batch(p, wire.data() + wire.size());
  EXPECT_EQ(p, wire.data() + wire.size());
  EXPECT_EQ(back.seq_absorbed, b.seq_absorbed);
  EXPECT_EQ(back.input_ids, b.input_ids);
  EXPECT_EQ(back.logit_rows, b.logit_rows);
  EXPECT_EQ(back.hidden_rows, b.hidden_rows);
  EXPECT_FALSE(back.hidden_states);
  EXPECT_EQ(back.kv_saves, b.kv_saves);
  EXPECT_EQ(back.kv_loads, b.kv_loads);
  EXPECT_TRUE(decode_batch().seq_absorbed.empty());
  bb.add(std::vector<int32_t>{1, 2}, 0, std::vector<int32_t>{0}, false);
  EXPECT_FALSE(bb.finish().absorbed_under_auto(0));  // the builder starts afresh
}

// Chained MTP drafts: a sequence's page table keeps the pages it has for `room` positions after its new tokens (not
// past an unset one), its drafts are counted, and both travel to other nodes and through padding.
TEST(ForwardBatch, ChainRoomAndDraftCounts) {
  ForwardBatchBuilder bb(4);
  bb.add_logits_from(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4, 6}, 0, 2);  // 12 + 2 > 12
  bb.absorb_last(2);
  bb.add_logits_from(std::vector<int32_t>{8}, 4, std::vector<int32_t>{3, 5, -1}, 0, 5);  // no page 3 to keep
  bb.add_logits_from(std::vector<int32_t>{9}, 1, std::vector<int32_t>{7, 8, 9}, 0, 2);    // 2 + 2 fit in page 0
  ForwardBatch b = bb.finish();
  b.mtp_chain = 3;
  ASSERT_EQ(b.max_pages, 4);
  EXPECT_EQ(b.page_table, (std::vector<int32_t>{1, 2, 4, 6, 3, 5, -1, -1, 7, -1, -1, -1}));
  EXPECT_EQ(b.seq_drafts, (std::vector<int32_t>{2, 0, 0}));
  EXPECT_EQ(b.seq_lens, (std::vector<int32_t>{12, 5, 2}));
  std::string wire;
  serialize(b, wire);
  const char* p = wire.data();
  const ForwardBatch back = deserialize_forward_batch(p, wire.data() + wire.size());
  EXPECT_EQ(p, wire.data() + wire.size());
  EXPECT_EQ(back.mtp_chain, 3);
  EXPECT_EQ(back.seq_drafts, b.seq_drafts);
  EXPECT_EQ(back.page_table, b.page_table);
  const ForwardBatch padded = pad_decode_batch(b, 7, 20, 4);
  EXPECT_EQ(padded.mtp_chain, 3);
  EXPECT_EQ(padded.seq_drafts, (std::vector<int32_t>{2, 0, 0, 0, 0}));
  EXPECT_THROW(bb.absorb_last(1), std::exception);  // no sequence
  bb.add(std::vector<int32_t>{1, 2}, 0, std::vector<int32_t>{0}, true);
  EXPECT_THROW(bb.absorb_last(2), std::exception);  // drafts are after a decode token
}

TEST(ForwardBatch, PadDecodeBatchKeepsRealRowsFirst) {
  const ForwardBatch b = decode_batch();
  const ForwardBatch p = pad_decode_batch(b, 8, 20, 4);
  ASSERT_EQ(p.num_tokens(), 8);
  ASSERT_EQ(p.num_seqs(), 8);
  EXPECT_EQ(p.mode, ForwardMode::Decode);
  EXPECT_EQ(p.max_pages, b.max_pages);
  for (int32_t t = 0; t < 3; ++t) {
    EXPECT_EQ(p.input_ids[t], b.input_ids[t]);
    EXPECT_EQ(p.positions[t], b.positions[t]);
    EXPECT_EQ(p.out_slots[t], b.out_slots[t]);
    EXPECT_EQ(p.seq_lens[t], b.seq_lens[t]);
    for (int32_t k = 0; k < b.max_pages; ++k)
      EXPECT_EQ(p.page_table[t * p.max_pages + k], b.page_table[t * b.max_pages + k]);
  }
  for (int32_t t = 3; t < 8; ++t) {
    EXPECT_EQ(p.input_ids[t], 0);
    EXPECT_EQ(p.positions[t], 0);
    EXPECT_EQ(p.out_slots[t], 20 * 4);       // only the dummy page is written
    EXPECT_EQ(p.page_table[t * p.max_pages], 20);
    EXPECT_EQ(p.page_table[t * p.max_pages + 1], -1);
    EXPECT_EQ(p.seq_lens[t], 1);
    EXPECT_EQ(p.seq_q_start[t + 1], t + 1);
  }
  for (int32_t t = 0; t < 8; ++t) EXPECT_EQ(p.logit_rows[t], t);
  EXPECT_TRUE(is_graph_batch(p));
}

// A decode token with two drafts, then a decode token, padded to 7 tokens: the real sequences keep their tokens,
// pages and absorbed marks; three one-token sequences on the dummy page follow.
TEST(ForwardBatch, PadKeepsDraftSequences) {
  ForwardBatchBuilder bb(4);
  bb.add(std::vector<int32_t>{5, 6, 7}, 9, std::vector<int32_t>{1, 2, 4}, true);
  bb.absorb_last();
  bb.add(std::vector<int32_t>{8}, 4, std::vector<int32_t>{3, 5}, false);
  const ForwardBatch b = bb.finish();
  const ForwardBatch p = pad_decode_batch(b, 7, 20, 4);
  ASSERT_EQ(p.num_tokens(), 7);
  ASSERT_EQ(p.num_seqs(), 5);
  EXPECT_EQ(p.seq_q_start, (std::vector<int32_t>{0, 3, 4, 5, 6, 7}));
  EXPECT_EQ(p.token_seq, (std::vector<int32_t>{0, 0, 0, 1, 2, 3, 4}));
  EXPECT_EQ(p.positions, (std::vector<int32_t>{9, 10, 11, 4, 0, 0, 0}));
  EXPECT_EQ(p.seq_prefix_lens, (std::vector<int32_t>{9, 4, 0, 0, 0}));
  EXPECT_EQ(p.seq_lens, (std::vector<int32_t>{12, 5, 1, 1, 1}));
  EXPECT_EQ(p.seq_absorbed, (std::vector<int32_t>{1, 0, 0, 0, 0}));
  EXPECT_EQ(p.logit_rows, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6}));
  ASSERT_EQ(p.max_pages, 3);
  EXPECT_EQ(p.page_table, (std::vector<int32_t>{1, 2, 4, 3, 5, -1, 20, -1, -1, 20, -1, -1, 20, -1, -1}));
  for (int32_t t = 4; t < 7; ++t) EXPECT_EQ(p.out_slots[t], 80);
  for (int32_t t = 0; t < 4; ++t) EXPECT_EQ(p.out_slots[t], b.out_slots[t]);
  EXPECT_TRUE(is_graph_batch(p));
}

TEST(ForwardBatch, PadIdleGroup) {
  ForwardBatch idle;
  idle.page_size = 1;
  idle.seq_q_start = {0};
  const ForwardBatch p = pad_decode_batch(idle, 4, 6, 16);
  EXPECT_EQ(p.num_tokens(), 4);
  EXPECT_EQ(p.page_size, 16);
  EXPECT_EQ(p.max_pages, 1);
  EXPECT_EQ(p.page_table, (std::vector<int32_t>{6, 6, 6, 6}));
  EXPECT_EQ(p.out_slots, (std::vector<int32_t>{96, 96, 96, 96}));
}

TEST(ForwardBatch, PadRejectsPrefillAndShrinking) {
  ForwardBatchBuilder bb(4);
  bb.add(std::vector<int32_t>{1, 2}, 0, std::vector<int32_t>{0}, false);
  EXPECT_THROW(pad_decode_batch(bb.finish(), 8, 1, 4), Error);
  EXPECT_THROW(pad_decode_batch(decode_batch(), 2, 1, 4), Error);
}

TEST(ForwardBatch, GraphBatchSizes) {
  EXPECT_EQ(cuda_graph_batch_sizes(0), std::vector<int32_t>{});
  EXPECT_EQ(cuda_graph_batch_sizes(1), std::vector<int32_t>{1});
  EXPECT_EQ(cuda_graph_batch_sizes(6), (std::vector<int32_t>{1, 2, 4, 6}));
  EXPECT_EQ(cuda_graph_batch_sizes(24), (std::vector<int32_t>{1, 2, 4, 8, 16, 24}));
  const auto big = cuda_graph_batch_sizes(320);
  EXPECT_EQ(big.back(), 320);
  EXPECT_EQ(big[big.size() - 2], 288);
  EXPECT_EQ(big[big.size() - 3], 256);
  for (size_t i = 1; i < big.size(); ++i) EXPECT_LT(big[i - 1], big[i]);
}

}  // namespace
}  // namespace mlaserve
