// SuffixAutomaton: the lookup ("n-gram") drafter's index over a growing token sequence.
//
// Header-only, no torch: csrc/bindings.cpp exposes it to Python as specdec_ext._C.SuffixAutomaton;
// cpp_tests/test_suffix_automaton.cpp tests it directly.
//
// What it answers. Let s[0..n-1] be every token seen so far (the prompt, then the committed tokens).
// The *match* is the longest suffix of s that also occurs earlier in s, i.e. ends at some position
// e < n-1 (the trivial occurrence at the very end excluded; occurrences may overlap it). Its length
// is match_length(). Of its earlier occurrences we use the EARLIEST one (smallest end e =
// match_end()); propose(m) returns the m tokens that followed it: s[e+1], s[e+2], ...
//
//   * Why the earliest occurrence: it is the classic firstpos of the automaton state, exact in O(1)
//     per token (the most recent occurrence is the maximum of endpos over a subtree of the suffix-link
//     tree, which changes as states are cloned: no O(1) update). It is also HF's prompt-lookup choice,
//     and it leaves the longest continuation available in the history.
//   * When the continuation reaches the end of the history (the match overlaps its earlier
//     occurrence: a repeat with period P = n-1-e shorter than m), overlap_copy (default on) keeps
//     copying from the proposal itself, like an LZ77 overlapping copy: draft j is (s ++ draft)[e+1+j],
//     so "a b a b a b" proposes "a b a b ...". With overlap_copy off the proposal stops at the end
//     of the history (at most P tokens).
//   * Nothing (an empty list) is proposed while match_length() < min_match (default 2: a one-token
//     match is a weak signal on natural text; an empty proposal makes the step a plain decode step).
//   * propose(0) is an empty list; a negative max_tokens throws std::invalid_argument.
//
// Construction: the classic online suffix automaton (Blumer et al.; each state = one endpos class)
// over an integer alphabet. Per appended token: amortised O(1) new states/transitions/link walks
// (at most 2n-1 states and 3n-4 transitions in total), each transition lookup O(1) for states with
// few out-edges (linear scan) and O(log sigma) for wide ones (binary search in a sorted vector).
// The match is read in O(1) from the automaton itself: after appending, the suffix link of the last
// state is the state of the longest suffix that also ends elsewhere (its len is the match length,
// its firstpos the earliest end), so there is no separate streaming matcher to keep in sync.
// propose(m) is O(m). Append-only: committed tokens are never rolled back.
//
// Tokens are int64 ids >= 0; a negative id throws (-1 marks empty slots in this project, and
// feeding it is a bug upstream).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace specdec {

class SuffixAutomaton {
 public:
  static constexpr int64_t kDefaultMinMatch = 2;

  explicit SuffixAutomaton(int64_t min_match = kDefaultMinMatch, bool overlap_copy = true)
      : min_match_(min_match), overlap_copy_(overlap_copy) {
    if (min_match < 1) {
      throw std::invalid_argument("SuffixAutomaton: min_match must be >= 1 (tokens of the shortest match "
                                  "that proposes), got " + std::to_string(min_match));
    }
    clear();
  }

  // Forget every token (keeps min_match and overlap_copy).
  void clear() {
    states_.clear();
    tokens_.clear();
    states_.push_back(State{0, -1, -1, {}});  // the root: the empty string
    last_ = 0;
  }

  // Reserve room for n tokens in total (optional; avoids reallocations).
  void reserve(size_t n) {
    tokens_.reserve(n);
    states_.reserve(2 * n + 1);
  }

  // Append tokens[0..count-1]. All are checked before any is appended (a bad token leaves the
  // automaton unchanged).
  void extend(const int64_t* tokens, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      if (tokens[i] < 0) {
        throw std::invalid_argument("SuffixAutomaton.extend: token ids must be >= 0, got " +
                                    std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                    " of the " + std::to_string(count) + " tokens passed");
      }
    }
    if (count > kMaxTokens - tokens_.size()) {
      throw std::length_error("SuffixAutomaton.extend: at most " + std::to_string(kMaxTokens) + " tokens");
    }
    for (size_t i = 0; i < count; ++i) push(tokens[i]);
  }
  void extend(const std::vector<int64_t>& tokens) { extend(tokens.data(), tokens.size()); }
  void push_back(int64_t token) { extend(&token, 1); }

  // Tokens seen so far.
  size_t size() const { return tokens_.size(); }
  const std::vector<int64_t>& tokens() const { return tokens_; }
  size_t num_states() const { return states_.size(); }
  int64_t min_match() const { return min_match_; }
  bool overlap_copy() const { return overlap_copy_; }

  // Length of the longest suffix that also occurs ending before the last position (0: none).
  int64_t match_length() const { return last_ == 0 ? 0 : states_[states_[last_].link].len; }

  // End position of the earliest earlier occurrence of that suffix, or -1 when match_length() == 0.
  int64_t match_end() const { return last_ == 0 ? -1 : states_[states_[last_].link].first_end; }

  // Up to max_tokens tokens that followed the match (see the header comment); empty while
  // match_length() < min_match.
  std::vector<int64_t> propose(int64_t max_tokens) const {
    std::vector<int64_t> out;
    propose_into(max_tokens, out);
    return out;
  }

  // Same as propose, into `out` (cleared first); returns the number of tokens proposed.
  size_t propose_into(int64_t max_tokens, std::vector<int64_t>& out) const {
    if (max_tokens < 0) {
      throw std::invalid_argument("SuffixAutomaton.propose: max_tokens must be >= 0, got " +
                                  std::to_string(max_tokens));
    }
    out.clear();
    if (max_tokens == 0 || match_length() < min_match_) return 0;
    const size_t n = tokens_.size();
    const size_t start = static_cast<size_t>(match_end()) + 1;  // <= n - 1
    const size_t period = n - start;                              // >= 1 tokens of history after it
    size_t count = static_cast<size_t>(max_tokens);
    if (!overlap_copy_) count = std::min(count, period);
    out.reserve(count);
    for (size_t j = 0; j < count; ++j) {
      // (s ++ out)[start + j]: from the history, then from the proposal itself (period `period`).
      out.push_back(j < period ? tokens_[start + j] : out[j - period]);
    }
    return count;
  }

 private:
  struct Edge {
    int64_t token;
    int32_t to;
  };
  struct State {
    int32_t len;        // length of the longest string of this endpos class
    int32_t link;       // suffix link (-1 at the root)
    int32_t first_end;  // smallest end position of an occurrence (firstpos; -1 at the root)
    std::vector<Edge> next;  // out-transitions sorted by token
  };
  static constexpr size_t kLinearScan = 8;  // out-degree up to which lookups scan linearly
  static constexpr size_t kMaxTokens = std::numeric_limits<int32_t>::max() / 2 - 1;  // 2n states fit int32

  int32_t find(int32_t state, int64_t token) const {
    const std::vector<Edge>& next = states_[state].next;
    if (next.size() <= kLinearScan) {
      for (const Edge& e : next) {
        if (e.token == token) return e.to;
      }
      return -1;
    }
    auto it = std::lower_bound(next.begin(), next.end(), token,
                               [](const Edge& e, int64_t t) { return e.token < t; });
    return it != next.end() && it->token == token ? it->to : -1;
  }

  void set(int32_t state, int64_t token, int32_t to) {
    std::vector<Edge>& next = states_[state].next;
    auto it = std::lower_bound(next.begin(), next.end(), token,
                               [](const Edge& e, int64_t t) { return e.token < t; });
    if (it != next.end() && it->token == token) {
      it->to = to;
    } else {
      next.insert(it, Edge{token, to});
    }
  }

  void push(int64_t c) {
    const int32_t pos = static_cast<int32_t>(tokens_.size());
    tokens_.push_back(c);
    const int32_t cur = static_cast<int32_t>(states_.size());
    states_.push_back(State{states_[last_].len + 1, -1, pos, {}});
    int32_t p = last_;
    while (p != -1 && find(p, c) == -1) {
      set(p, c, cur);
      p = states_[p].link;
    }
    if (p == -1) {
      states_[cur].link = 0;
    } else {
      const int32_t q = find(p, c);
      if (states_[p].len + 1 == states_[q].len) {
        states_[cur].link = q;
      } else {
        const int32_t clone = static_cast<int32_t>(states_.size());
        State copy{states_[p].len + 1, states_[q].link, states_[q].first_end, states_[q].next};
        states_.push_back(std::move(copy));
        while (p != -1 && find(p, c) == q) {
          set(p, c, clone);
          p = states_[p].link;
        }
        states_[q].link = clone;
        states_[cur].link = clone;
      }
    }
    last_ = cur;
  }

  int64_t min_match_;
  bool overlap_copy_;
  std::vector<State> states_;
  std::vector<int64_t> tokens_;
  int32_t last_ = 0;
};

}  // namespace specdec
