#include "server/sessions.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>

#include "server/api_error.h"

namespace mlaserve::server {

bool SessionStore::Session::expired(std::chrono::steady_clock::time_point now) const {
  if (!timeout || now - used <= *timeout) return false;
  for (const auto& [rid, node] : nodes)
    if (!node.finished) return false;  // (a request running: in use)
  return true;
}

void SessionStore::reap(bool now_or_never) {
  const auto now = now_();
  if (!now_or_never && now - reaped_ < std::chrono::seconds(1)) return;
  reaped_ = now;
  std::erase_if(sessions_, [now](const auto& kv) { return kv.second.expired(now); });
}

std::string SessionStore::open(std::string id, int64_t capacity_of_str_len, std::optional<double> timeout_s) {
  if (capacity_of_str_len < 0)
    bad_request("capacity_of_str_len", "invalid_value", "'capacity_of_str_len' must not be negative, got {}",
                capacity_of_str_len);
  if (timeout_s && !(*timeout_s > 0 && *timeout_s < 1e9))
    bad_request("timeout", "invalid_value", "'timeout' must be a number of seconds above 0, got {}", *timeout_s);
  std::lock_guard lk(mu_);
  reap(sessions_.size() >= kMaxSessions);
  if (sessions_.size() >= kMaxSessions)
    throw ApiError(400, fmt::format("{} sessions are open, the most this server keeps; close some first",
                                    sessions_.size()),
                   "session_id", "too_many_sessions");
  if (id.empty()) {
    thread_local std::mt19937_64 rng{std::random_device{}()};
    do id = fmt::format("{:016x}{:016x}", rng(), rng());
    while (sessions_.count(id));
  } else if (const auto it = sessions_.find(id); it != sessions_.end()) {
    if (!it->second.expired(now_())) bad_request("session_id", "invalid_value", "session '{}' is already open", id);
    sessions_.erase(it);
  }
  Session& s = sessions_[id];
  s.capacity_of_str_len = capacity_of_str_len;
  using std::chrono::duration_cast, std::chrono::steady_clock;
  if (timeout_s) s.timeout = duration_cast<steady_clock::duration>(std::chrono::duration<double>(*timeout_s));
  s.used = now_();
  return id;
}

bool SessionStore::close(const std::string& id) {
  std::lock_guard lk(mu_);
  const auto it = sessions_.find(id);
  if (it == sessions_.end()) return false;
  const bool open = !it->second.expired(now_());
  sessions_.erase(it);
  return open;
}

template <typename Map>
auto& SessionStore::session(Map& sessions, const SessionParams& p, std::chrono::steady_clock::time_point now) {
  const auto it = sessions.find(p.id);
  if (it == sessions.end() || it->second.expired(now))
    bad_request("session_params.id", "invalid_value", "session '{}' is not open (open it with /open_session)", p.id);
  return it->second;
}

const SessionStore::Node& SessionStore::parent(const Session& s, const SessionParams& p) {
  const auto it = s.nodes.find(*p.rid);
  if (it == s.nodes.end())
    bad_request("session_params.rid", "invalid_value", "session '{}' has no request '{}'", p.id, *p.rid);
  if (!it->second.finished)
    bad_request("session_params.rid", "invalid_value",
                "request '{}' of session '{}' has not finished; a request continues a finished one", *p.rid, p.id);
  return it->second;
}

void SessionStore::append(const Session& s, const Node& node, size_t n, std::vector<int32_t>& out) {
  // The chain up to the root, each node with the tokens of it wanted (a loop: a conversation may be long).
  std::vector<std::pair<const Node*, size_t>> chain{{&node, n}};
  while (chain.back().first->parent) {
    const auto [at, want] = chain.back();
    chain.emplace_back(&s.nodes.at(*at->parent), std::min(want, at->keep));
  }
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {  // root first: its tokens, then each child's own ones
    size_t rest = it->second - (it->first->parent ? std::min(it->second, it->first->keep) : 0);
    for (const std::vector<int32_t>* part : {&it->first->own, &it->first->output}) {
      const size_t k = std::min(rest, part->size());
      out.insert(out.end(), part->begin(), part->begin() + static_cast<ptrdiff_t>(k));
      rest -= k;
    }
  }
}

size_t SessionStore::kept(const Node& parent, const SessionParams& p) {
  const auto n = static_cast<int64_t>(prompt_len(parent) + (p.drop_previous_output ? 0 : parent.output.size()));
  if (p.offset == 0) return static_cast<size_t>(n);
  return static_cast<size_t>(p.offset > 0 ? std::min(p.offset, n) : std::max<int64_t>(n + p.offset, 0));  // [:offset]
}

std::vector<int32_t> SessionStore::prompt(const SessionParams& p, const std::vector<int32_t>& ids,
                                          std::optional<int32_t> bos) const {
  std::lock_guard lk(mu_);
  const Session& s = session(sessions_, p, now_());
  if (!p.rid) return ids;
  const Node& last = parent(s, p);
  std::vector<int32_t> out;
  append(s, last, kept(last, p), out);
  const bool skip = bos && !ids.empty() && ids.front() == *bos;  // the new turn's BOS: not in mid-prompt
  out.insert(out.end(), ids.begin() + (skip ? 1 : 0), ids.end());
  return out;
}

void SessionStore::drop(Session& s, const std::string& rid, std::vector<std::string>& running) {
  std::vector<std::string> pending{rid};  // (a loop: a conversation may be long)
  while (!pending.empty()) {
    const std::string at = std::move(pending.back());
    pending.pop_back();
    const auto it = s.nodes.find(at);
    if (it == s.nodes.end()) continue;
    if (!it->second.finished) running.push_back(at);
    for (std::string& c : it->second.children) pending.push_back(std::move(c));
    s.nodes.erase(it);
  }
}

std::vector<std::string> SessionStore::add(const SessionParams& p, const std::string& rid,
                                           const std::vector<int32_t>& prompt) {
  std::lock_guard lk(mu_);
  reap();
  const auto now = now_();
  Session& s = session(sessions_, p, now);
  s.used = now;
  if (p.rid) parent(s, p);  // still there and finished
  if (s.nodes.count(rid))
    bad_request("rid", "invalid_value", "session '{}' already has a request '{}'; give each request its own rid",
                p.id, rid);
  std::vector<std::string> running;
  if (p.replace) {
    if (p.rid) {
      Node& last = s.nodes.at(*p.rid);
      const std::vector<std::string> children = std::move(last.children);
      last.children.clear();
      for (const std::string& c : children) drop(s, c, running);
    } else {
      for (const auto& [id, node] : s.nodes)  // every request of the session dropped
        if (!node.finished) running.push_back(id);
      s.nodes.clear();
    }
  }
  Node node;
  node.parent = p.rid;
  if (p.rid) {
    Node& last = s.nodes.at(*p.rid);
    node.keep = std::min(kept(last, p), prompt.size());
    last.children.push_back(rid);
  }
  node.own.assign(prompt.begin() + static_cast<ptrdiff_t>(node.keep), prompt.end());
  s.nodes.emplace(rid, std::move(node));
  return running;
}

void SessionStore::finish(const std::string& id, const std::string& rid, std::vector<int32_t> output_ids) {
  std::lock_guard lk(mu_);
  const auto s = sessions_.find(id);
  if (s == sessions_.end()) return;
  const auto n = s->second.nodes.find(rid);
  if (n == s->second.nodes.end()) return;
  n->second.output = std::move(output_ids);
  n->second.finished = true;
  s->second.used = now_();  // (idle from here)
}

void SessionStore::forget(const std::string& id, const std::string& rid) {
  std::lock_guard lk(mu_);
  const auto s = sessions_.find(id);
  if (s == sessions_.end()) return;
  const auto n = s->second.nodes.find(rid);
  if (n == s->second.nodes.end()) return;
  if (n->second.parent)
    if (const auto p = s->second.nodes.find(*n->second.parent); p != s->second.nodes.end())
      std::erase(p->second.children, rid);
  std::vector<std::string> running;
  drop(s->second, rid, running);
}

size_t SessionStore::num_sessions() const {
  std::lock_guard lk(mu_);
  const auto now = now_();
  return static_cast<size_t>(
      std::count_if(sessions_.begin(), sessions_.end(), [now](const auto& kv) { return !kv.second.expired(now); }));
}

size_t SessionStore::num_requests(const std::string& id) const {
  std::lock_guard lk(mu_);
  const auto s = sessions_.find(id);
  return s == sessions_.end() ? 0 : s->second.nodes.size();
}

size_t SessionStore::num_tokens(const std::string& id) const {
  std::lock_guard lk(mu_);
  const auto s = sessions_.find(id);
  size_t n = 0;
  if (s != sessions_.end())
    for (const auto& [rid, node] : s->second.nodes) n += node.own.size() + node.output.size();
  return n;
}

}  // namespace mlaserve::server
