// SessionStore (server/sessions.h): the prompts session requests run and the tree they make.
#include <gtest/gtest.h>

#include <chrono>

#include "server/api_error.h"
#include "server/sessions.h"

namespace mlaserve::server {
namespace {

using Ids = std::vector<int32_t>;

SessionParams params(const std::string& id, std::optional<std::string> rid = std::nullopt) {
  SessionParams p;
  p.id = id;
  p.rid = std::move(rid);
  return p;
}

// The ApiError's param (empty if `fn` did not throw one).
template <typename Fn>
std::string error_param(Fn&& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    return e.param;
  }
  return {};
}

TEST(Sessions, PromptsFollowTheTree) {
  SessionStore st;
  const std::string s = st.open("", 100);
  EXPECT_EQ(s.size(), 32u);
  EXPECT_EQ(st.open("named", 0), "named");
  EXPECT_EQ(error_param([&] { st.open("named", 0); }), "session_id");
  EXPECT_EQ(error_param([&] { st.open("neg", -1); }), "capacity_of_str_len");
  EXPECT_EQ(st.num_sessions(), 2u);

  // A root runs its own ids, BOS and all.
  EXPECT_EQ(st.prompt(params(s), {7, 1, 2}, 7), (Ids{7, 1, 2}));
  EXPECT_TRUE(st.add(params(s), "a", {7, 1, 2}).empty());
  // A running parent cannot be continued.
  EXPECT_EQ(error_param([&] { st.prompt(params(s, "a"), {3}, 7); }), "session_params.rid");
  EXPECT_EQ(error_param([&] { st.add(params(s, "a"), "b", {3}); }), "session_params.rid");
  st.finish(s, "a", {4, 5});
  EXPECT_EQ(st.prompt(params(s, "a"), {7, 3}, 7), (Ids{7, 1, 2, 4, 5, 3}));  // the new turn's BOS dropped
  EXPECT_EQ(st.prompt(params(s, "a"), {3, 7}, 7), (Ids{7, 1, 2, 4, 5, 3, 7}));  // only a leading one
  EXPECT_EQ(st.prompt(params(s, "a"), {7, 3}, std::nullopt), (Ids{7, 1, 2, 4, 5, 7, 3}));  // no BOS known
  SessionParams p = params(s, "a");
  for (auto [offset, want] : std::vector<std::pair<int64_t, Ids>>{
           {1, {7, 3}}, {4, {7, 1, 2, 4, 3}}, {9, {7, 1, 2, 4, 5, 3}}, {-1, {7, 1, 2, 4, 3}}, {-5, {3}}, {-9, {3}}}) {
    p.offset = offset;
    EXPECT_EQ(st.prompt(p, {3}, 7), want) << offset;
  }
  p.offset = -1;
  p.drop_previous_output = true;
  EXPECT_EQ(st.prompt(p, {3}, 7), (Ids{7, 1, 3}));
  EXPECT_EQ(error_param([&] { st.prompt(params(s, "zz"), {3}, 7); }), "session_params.rid");
  EXPECT_EQ(error_param([&] { st.prompt(params("nope"), {3}, 7); }), "session_params.id");
  EXPECT_EQ(error_param([&] { st.add(params(s), "a", {1}); }), "rid");  // a rid the session has

  // b and c continue a; d continues b (running); replace under a drops b, c, d and names d.
  EXPECT_TRUE(st.add(params(s, "a"), "b", {1}).empty());
  EXPECT_TRUE(st.add(params(s, "a"), "c", {1}).empty());
  st.finish(s, "b", {});
  st.finish(s, "c", {});
  EXPECT_TRUE(st.add(params(s, "b"), "d", {1}).empty());
  EXPECT_EQ(st.num_requests(s), 4u);
  SessionParams rep = params(s, "a");
  rep.replace = true;
  EXPECT_EQ(st.add(rep, "e", {1}), (std::vector<std::string>{"d"}));
  EXPECT_EQ(st.num_requests(s), 2u);  // a and e
  EXPECT_EQ(error_param([&] { st.prompt(params(s, "b"), {3}, 7); }), "session_params.rid");
  st.finish(s, "d", {9});  // a dropped request's end: nothing to record
  EXPECT_EQ(st.num_requests(s), 2u);

  // forget: a request that never ran goes, with what continued it, and leaves its parent's children.
  st.finish(s, "e", {});
  EXPECT_TRUE(st.add(params(s, "e"), "f", {1}).empty());
  st.forget(s, "e");
  EXPECT_EQ(st.num_requests(s), 1u);
  EXPECT_TRUE(st.add(rep, "g", {1}).empty());  // a's children list no longer names e or f
  EXPECT_EQ(st.num_requests(s), 2u);

  // replace without a parent: the whole session, running requests named.
  SessionParams all = params(s);
  all.replace = true;
  EXPECT_EQ(st.add(all, "h", {1}), (std::vector<std::string>{"g"}));
  EXPECT_EQ(st.num_requests(s), 1u);

  EXPECT_TRUE(st.close(s));
  EXPECT_FALSE(st.close(s));
  st.finish(s, "h", {1});  // its session closed: nothing
  EXPECT_EQ(st.num_requests(s), 0u);
  EXPECT_EQ(st.num_sessions(), 1u);
}

// A long conversation: each turn holds its own tokens only, and the prompts are whole.
TEST(Sessions, LongConversationsHoldEachTokenOnce) {
  SessionStore st;
  const std::string s = st.open("", 0);
  Ids whole{1, 2};
  ASSERT_TRUE(st.add(params(s), "t0", whole).empty());
  st.finish(s, "t0", {3});
  whole.push_back(3);
  const int kTurns = 3000;
  for (int t = 1; t <= kTurns; ++t) {
    const std::string parent = "t" + std::to_string(t - 1), rid = "t" + std::to_string(t);
    const Ids turn{100 + t % 50, 7};
    Ids want = whole;
    want.push_back(100 + t % 50);  // (7: a BOS only at the start)
    want.push_back(7);
    const Ids got = st.prompt(params(s, parent), turn, 7);
    ASSERT_EQ(got, want) << t;
    ASSERT_TRUE(st.add(params(s, parent), rid, got).empty());
    st.finish(s, rid, {t});
    whole = want;
    whole.push_back(t);
  }
  EXPECT_EQ(st.num_requests(s), static_cast<size_t>(kTurns) + 1);
  EXPECT_EQ(st.num_tokens(s), whole.size());
  // Cut deep in the conversation (offset), and a prompt given shorter than prompt() made it (its first tokens).
  SessionParams cut = params(s, "t" + std::to_string(kTurns));
  cut.offset = 5;
  EXPECT_EQ(st.prompt(cut, {9}, 7), (Ids{1, 2, 3, 101, 7, 9}));
  ASSERT_TRUE(st.add(cut, "short", {1, 2, 3}).empty());
  st.finish(s, "short", {8});
  EXPECT_EQ(st.prompt(params(s, "short"), {9}, 7), (Ids{1, 2, 3, 8, 9}));
  EXPECT_EQ(st.num_tokens(s), whole.size() + 1);
  // Replacing what continued the first turn drops the whole long chain.
  SessionParams rep = params(s, "t0");
  rep.replace = true;
  EXPECT_TRUE(st.add(rep, "branch", st.prompt(rep, {5}, 7)).empty());
  EXPECT_EQ(st.num_requests(s), 2u);
  EXPECT_EQ(st.num_tokens(s), 4u);  // t0's 1, 2, 3 and the branch's 5
}

// A session opened with a timeout closes once it has been idle that long (no request running or named); one
// without never does. The clock is the test's.
TEST(Sessions, IdleSessionsWithATimeoutClose) {
  auto t = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  SessionStore st([&t] { return t; });
  using std::chrono::seconds;
  EXPECT_EQ(error_param([&] { st.open("z", 0, 0.0); }), "timeout");
  EXPECT_EQ(error_param([&] { st.open("z", 0, -2.0); }), "timeout");
  st.open("a", 0, 10.0);
  st.open("forever", 0);
  t += seconds(6);
  EXPECT_EQ(st.prompt(params("a"), {5, 6}, std::nullopt), (Ids{5, 6}));
  st.add(params("a"), "r1", {5, 6});  // named: idle from here, but running
  t += seconds(60);
  EXPECT_EQ(st.num_sessions(), 2u);  // a request of it runs: in use
  st.finish("a", "r1", {7});
  t += seconds(9);
  EXPECT_EQ(st.prompt(params("a", "r1"), {8}, std::nullopt), (Ids{5, 6, 7, 8}));
  t += seconds(2);  // 11 s idle
  EXPECT_EQ(error_param([&] { st.prompt(params("a", "r1"), {8}, std::nullopt); }), "session_params.id");
  EXPECT_EQ(error_param([&] { st.add(params("a", "r1"), "r2", {5, 6, 7, 8}); }), "session_params.id");
  EXPECT_EQ(st.num_sessions(), 1u);
  EXPECT_FALSE(st.close("a"));
  EXPECT_EQ(st.open("a", 0, 10.0), "a");  // the id is free again, its tree gone
  EXPECT_EQ(st.num_requests("a"), 0u);
  t += seconds(1000000);
  EXPECT_EQ(st.prompt(params("forever"), {1}, std::nullopt), (Ids{1}));
  EXPECT_EQ(st.num_sessions(), 1u);
  // Expired sessions are dropped from the store (their tokens with them) as later calls come.
  for (int i = 0; i < 100; ++i) st.open("e" + std::to_string(i), 0, 1.0);
  st.add(params("e0"), "x", Ids(1000, 3));
  st.finish("e0", "x", {4});
  st.add(params("e1"), "y", {3});
  t += seconds(5);
  EXPECT_EQ(st.num_tokens("e0"), 1001u);  // (expired, not dropped yet)
  EXPECT_EQ(st.open("new", 0), "new");
  EXPECT_EQ(st.num_tokens("e0"), 0u);
  EXPECT_EQ(st.num_requests("e1"), 1u);  // (running: kept)
  EXPECT_EQ(st.num_sessions(), 3u);      // forever, new, e1
}

}  // namespace
}  // namespace mlaserve::server
