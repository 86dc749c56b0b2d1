// Regular expressions over UTF-8 text as byte automata, for constrained decoding: a pattern (the common syntax of
// Python's re / JSON Schema's "pattern": literals, escapes, classes, groups, alternation, greedy or lazy
// quantifiers; ^ / $ only at the ends) is parsed into code-point sets and compiled into a byte-level NFA (each set
// as the UTF-8 byte sequences of its code points), which a lazy DFA runs: states are made on first use, one byte at
// a time. A whole-string match: the text must be in the language, not just contain a match. Two extensions: \C is
// the byte 0xFF, which no UTF-8 text holds (token_constraint.h spells special tokens with it), Onigmo's absent
// operator of literals, (?~ab|c): any text that holds none of them (the free text of a structural tag), and
// (?%k:...) (1 <= k <= 2^24): what the group matches whose decimal digits, read in order with every other character
// skipped, make a multiple of k (JSON Schema's multipleOf; its automaton holds up to k states per state of the
// group's).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace mlaserve::structured {

// A byte-level NFA (Thompson): state 0 .. size-1; edges on byte ranges, epsilon moves.
struct Nfa {
  struct Edge {
    uint8_t lo, hi;
    int32_t to;
  };
  struct State {
    std::vector<Edge> edges;
    std::vector<int32_t> eps;
  };
  std::vector<State> states;
  int32_t start = 0, accept = 0;
};

// Appends code point cp (<= 0x10FFFF) to out as UTF-8.
void append_utf8(std::string& out, uint32_t cp);
// The code points of UTF-8 text; false (out partial) where it is not valid UTF-8, *bad_at its byte offset.
bool decode_utf8(std::string_view text, std::vector<uint32_t>& out, size_t* bad_at = nullptr);

// Parses and compiles `pattern`; throws mlaserve::Error naming the pattern and the position for a syntax error, a
// feature outside the subset (backreferences, lookaround, anchors inside), or a pattern over max_states states.
Nfa compile_regex(std::string_view pattern, size_t max_states = 1 << 20);

// compile_regex(pattern) shared: the patterns compiled last are kept, at most kCompiledRegexes of them and (beside
// the newest) kCompiledRegexStates NFA states in all, the least recently used dropped first, so a client that sends
// the same regex or grammar with every request pays its compile once (a recursive grammar's regex can take ~100 ms).
// Thread-safe; errors are thrown as compile_regex throws them and not kept.
constexpr size_t kCompiledRegexes = 32, kCompiledRegexStates = size_t{1} << 21;
std::shared_ptr<const Nfa> compile_regex_shared(const std::string& pattern);

// The NFA's DFA, built as it is walked. State 0 is the start; kDead: no string from here matches. A step that would
// make more than max_states states throws mlaserve::Error (a pattern whose DFA explodes, e.g. (a|b)*a(a|b){30}).
class Dfa {
 public:
  static constexpr int32_t kDead = -1;
  static constexpr size_t kMaxStates = 1 << 16;
  explicit Dfa(Nfa nfa, size_t max_states = kMaxStates);
  int32_t step(int32_t state, uint8_t byte);
  bool accepting(int32_t state) const { return state >= 0 && accepting_[static_cast<size_t>(state)]; }
  int32_t walk(int32_t state, std::string_view bytes);  // kDead once dead
  bool matches(std::string_view text) { return accepting(walk(0, text)); }
  size_t num_states() const { return sets_.size(); }

 private:
  int32_t intern(std::vector<int32_t> set);  // an epsilon-closed, sorted NFA state set
  std::vector<int32_t> closure(std::vector<int32_t> seeds) const;

  Nfa nfa_;
  size_t max_states_;
  std::vector<std::vector<int32_t>> sets_;
  std::vector<std::array<int32_t, 256>> next_;  // kUnknown until made
  std::vector<bool> accepting_;
  std::map<std::vector<int32_t>, int32_t> ids_;
};

}  // namespace mlaserve::structured
