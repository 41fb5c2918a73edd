// Hand-computed cases for specdec::SuffixAutomaton (csrc/suffix_automaton.h), plus a brute-force
// cross-check on pseudo-random sequences. Notation: s = the tokens seen; the match is the longest
// suffix of s that also ends at some e < |s| - 1, e the EARLIEST such end; propose(m) copies
// s[e+1], s[e+2], ... (continuing through the proposal itself with overlap_copy).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "suffix_automaton.h"

namespace {

using specdec::SuffixAutomaton;
using Tokens = std::vector<int64_t>;

// (L, e) by brute force: every suffix length from the longest down, every earlier end from the first.
std::pair<int64_t, int64_t> brute_match(const Tokens& s) {
  const int64_t n = static_cast<int64_t>(s.size());
  for (int64_t len = n - 1; len >= 1; --len) {
    for (int64_t end = len - 1; end <= n - 2; ++end) {
      bool equal = true;
      for (int64_t i = 0; i < len && equal; ++i) equal = s[end - i] == s[n - 1 - i];
      if (equal) return {len, end};
    }
  }
  return {0, -1};
}

TEST(SuffixAutomaton, EmptyAndOneToken) {
  SuffixAutomaton a;
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.match_length(), 0);
  EXPECT_EQ(a.match_end(), -1);
  EXPECT_TRUE(a.propose(4).empty());
  a.push_back(42);
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(a.match_length(), 0);
  EXPECT_TRUE(a.propose(4).empty());
}

TEST(SuffixAutomaton, PeriodThreeWithAndWithoutOverlapCopy) {
  // s = 1 2 3 1 2: "1 2" ends first at 1 -> continuation 3 1 2, then (overlap) 3 1 ...
  SuffixAutomaton a(2, true), b(2, false);
  a.extend({1, 2, 3, 1, 2});
  b.extend({1, 2, 3, 1, 2});
  EXPECT_EQ(a.match_length(), 2);
  EXPECT_EQ(a.match_end(), 1);
  EXPECT_EQ(a.propose(5), (Tokens{3, 1, 2, 3, 1}));
  EXPECT_EQ(b.propose(5), (Tokens{3, 1, 2}));  // capped by the history
  EXPECT_EQ(b.propose(2), (Tokens{3, 1}));
  EXPECT_TRUE(a.propose(0).empty());
}

TEST(SuffixAutomaton, AllSameToken) {
  // s = 7 7 7 7: the longest earlier suffix is "7 7 7" ending at 2; one token of history follows.
  SuffixAutomaton a(1, true), b(1, false);
  a.extend({7, 7, 7, 7});
  b.extend({7, 7, 7, 7});
  EXPECT_EQ(a.match_length(), 3);
  EXPECT_EQ(a.match_end(), 2);
  EXPECT_EQ(a.propose(3), (Tokens{7, 7, 7}));
  EXPECT_EQ(b.propose(3), (Tokens{7}));
  SuffixAutomaton c(2);
  c.extend({7, 7});  // "7" repeats but is shorter than min_match 2
  EXPECT_EQ(c.match_length(), 1);
  EXPECT_TRUE(c.propose(3).empty());
  c.push_back(7);
  EXPECT_EQ(c.propose(3), (Tokens{7, 7, 7}));
}

TEST(SuffixAutomaton, EarliestOccurrenceAndShrinkingMatch) {
  SuffixAutomaton a(2);
  a.extend({1, 2, 3, 0, 1, 2, 4, 0, 1, 2});  // "0 1 2" occurs earlier at 3..5 only
  EXPECT_EQ(a.match_length(), 3);
  EXPECT_EQ(a.match_end(), 5);
  EXPECT_EQ(a.propose(2), (Tokens{4, 0}));
  a.extend({5, 1, 2});  // now only "1 2" repeats; earliest end 1 -> 3 0 1
  EXPECT_EQ(a.match_length(), 2);
  EXPECT_EQ(a.match_end(), 1);
  EXPECT_EQ(a.propose(3), (Tokens{3, 0, 1}));
  a.push_back(9);  // "9" never seen: no match
  EXPECT_EQ(a.match_length(), 0);
  EXPECT_EQ(a.match_end(), -1);
  EXPECT_TRUE(a.propose(3).empty());
}

TEST(SuffixAutomaton, CloneKeepsFirstOccurrence) {
  // a b x a b y a b: building it clones the state of "a b"; the match "a b" keeps firstpos 1.
  SuffixAutomaton a(2, false);
  a.extend({10, 11, 12, 10, 11, 13, 10, 11});
  EXPECT_EQ(a.match_length(), 2);
  EXPECT_EQ(a.match_end(), 1);
  EXPECT_EQ(a.propose(3), (Tokens{12, 10, 11}));
}

TEST(SuffixAutomaton, WideRootUsesBinarySearch) {
  // 100 distinct tokens (the root has 100 out-edges), then a repeat of 50..52.
  SuffixAutomaton a(3);
  for (int64_t t = 0; t < 100; ++t) a.push_back(1000 - 7 * t);
  a.extend({1000 - 7 * 50, 1000 - 7 * 51, 1000 - 7 * 52});
  EXPECT_EQ(a.match_length(), 3);
  EXPECT_EQ(a.match_end(), 52);
  EXPECT_EQ(a.propose(2), (Tokens{1000 - 7 * 53, 1000 - 7 * 54}));
}

TEST(SuffixAutomaton, BadInputThrowsAndLeavesItUnchanged) {
  EXPECT_THROW(SuffixAutomaton(0), std::invalid_argument);
  SuffixAutomaton a;
  a.extend({1, 2});
  EXPECT_THROW(a.extend({3, -1}), std::invalid_argument);
  EXPECT_EQ(a.tokens(), (Tokens{1, 2}));
  EXPECT_THROW(a.propose(-1), std::invalid_argument);
  a.clear();
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(a.num_states(), 1u);
}

TEST(SuffixAutomaton, MatchesBruteForceOnRandomSequences) {
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int alphabet = 1 + static_cast<int>(rng() % 4);
    const int n = 1 + static_cast<int>(rng() % 60);
    SuffixAutomaton a(1 + static_cast<int64_t>(rng() % 2), rng() % 2 == 0);
    Tokens s;
    for (int i = 0; i < n; ++i) {
      const int64_t t = static_cast<int64_t>(rng() % alphabet);
      a.push_back(t);
      s.push_back(t);
      const auto [len, end] = brute_match(s);
      ASSERT_EQ(a.match_length(), len) << "trial " << trial << " at " << i;
      ASSERT_EQ(a.match_end(), end) << "trial " << trial << " at " << i;
      const Tokens got = a.propose(6);
      if (len < a.min_match()) {
        ASSERT_TRUE(got.empty());
        continue;
      }
      Tokens want, ext = s;
      for (size_t j = 0; j < 6; ++j) {
        const size_t index = static_cast<size_t>(end) + 1 + j;
        if (index >= s.size() && !a.overlap_copy()) break;
        want.push_back(ext[index]);
        ext.push_back(ext[index]);
      }
      ASSERT_EQ(got, want) << "trial " << trial << " at " << i;
    }
    EXPECT_LE(a.num_states(), 2 * s.size());
  }
}

}  // namespace
