// SGLang's sessions: /open_session makes a session, and a native /generate request naming it in `session_params`
// continues an earlier request of it (its prompt and output, cut at `offset`) with the request's own tokens, so a
// multi-turn client sends each turn's new tokens only (the radix cache keeps the earlier ones computed). A session is
// a tree of requests: a request continues its parent (`session_params.rid`) or starts a new root; `replace` drops
// what continued from that parent before (or, without a parent, the whole tree). A session opened with a timeout
// closes once that long passes with no request of it running or named (SGLang's `timeout`). Pure bookkeeping,
// thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace mlaserve::server {

// A native request's `session_params` (SGLang's SessionParams).
struct SessionParams {
  std::string id;                  // the session (from /open_session)
  std::optional<std::string> rid;  // the request continued; none: a new root
  int64_t offset = 0;              // non-zero: the parent's tokens cut as Python's ids[:offset] before the new ones
  bool replace = false;            // drop the parent's earlier continuations (none named: the whole session)
  bool drop_previous_output = false;  // continue from the parent's prompt alone, not its output
};

class SessionStore {
 public:
  static constexpr size_t kMaxSessions = 65536;
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  explicit SessionStore(Clock now = std::chrono::steady_clock::now) : now_(std::move(now)) {}
  // Opens a session: `id` (ApiError 400 if already open), or a new random one when empty; returns its id.
  // capacity_of_str_len is SGLang's field, kept for the session but not enforced. timeout_s (> 0; none: never):
  // the session closes once it has been idle that many seconds (no request of it running, none naming it).
  std::string open(std::string id, int64_t capacity_of_str_len, std::optional<double> timeout_s = std::nullopt);
  // Closes a session (its running requests run on, unrecorded); false if none is open by that id.
  bool close(const std::string& id);
  // The prompt a session request runs: its parent's prompt and output (or prompt alone with drop_previous_output),
  // cut at offset, then `ids` without a leading `bos`; `ids` alone for a new root. ApiError 400 naming
  // session_params.* for an unknown session or request, or a parent that has not finished.
  std::vector<int32_t> prompt(const SessionParams& p, const std::vector<int32_t>& ids,
                              std::optional<int32_t> bos) const;
  // Records request `rid` (running; `prompt` what prompt() gave, or its first tokens) under its parent. With replace,
  // the nodes it drops go first; returns the rids among them still running (for the caller to abort). ApiError 400 as
  // prompt() (the tree may have changed since), or for a rid the session already has.
  std::vector<std::string> add(const SessionParams& p, const std::string& rid, const std::vector<int32_t>& prompt);
  // Request `rid` of session `id` ended with these output tokens (nothing if the session or node is gone).
  void finish(const std::string& id, const std::string& rid, std::vector<int32_t> output_ids);
  // Removes request `rid` (and what continued it) from session `id`: its request never ran.
  void forget(const std::string& id, const std::string& rid);
  size_t num_sessions() const;
  // The requests session `id` holds (0 if none), and the tokens they hold.
  size_t num_requests(const std::string& id) const;
  size_t num_tokens(const std::string& id) const;

 private:
  // A request's prompt is the first `keep` tokens of its parent's prompt and output, then `own` (a root: own alone):
  // each node holds only its new tokens, so a long conversation's turns do not each hold a copy of the earlier ones.
  struct Node {
    std::optional<std::string> parent;
    std::vector<std::string> children;
    size_t keep = 0;
    std::vector<int32_t> own, output;
    bool finished = false;
  };
  struct Session {
    int64_t capacity_of_str_len = 0;
    std::unordered_map<std::string, Node> nodes;
    std::optional<std::chrono::steady_clock::duration> timeout;
    std::chrono::steady_clock::time_point used;  // opened, or a request of it named, run or finished
    bool expired(std::chrono::steady_clock::time_point now) const;
  };
  // Closes the sessions that have expired (a scan of them all: at most once a second unless now_or_never).
  void reap(bool now_or_never = false);
  // The session p names (not expired at `now`), and p's parent in it (finished); ApiError 400 otherwise. (Map:
  // sessions_, const or not.)
  template <typename Map>
  static auto& session(Map& sessions, const SessionParams& p, std::chrono::steady_clock::time_point now);
  static const Node& parent(const Session& s, const SessionParams& p);
  // How many tokens of the parent's prompt and output a request continuing it keeps (drop_previous_output, offset).
  static size_t kept(const Node& parent, const SessionParams& p);
  // Appends the first `n` tokens of `node`'s prompt and output to `out`.
  static void append(const Session& s, const Node& node, size_t n, std::vector<int32_t>& out);
  static size_t prompt_len(const Node& node) { return node.keep + node.own.size(); }
  // Drops `rid` and its descendants, collecting those still running.
  static void drop(Session& s, const std::string& rid, std::vector<std::string>& running);

  Clock now_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Session> sessions_;
  std::chrono::steady_clock::time_point reaped_{};
};

}  // namespace mlaserve::server
