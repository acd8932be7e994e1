// Chapter 12 exercise: merging two partial attention results (the online softmax).
//
// Write merge_attention, declared in chapters/12_context_parallel/attention.h. a and b hold the
// same queries' attention over two disjoint sets of keys: each output is normalised over its own
// keys, and each LSE is log Σ exp(score) over them. What is the LSE over both sets? By how much
// must each output be reweighted so that the sum is normalised over both? Mind the queries that
// see no key in one set (its LSE is −inf) or in both.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch12 &&
//   ctest --test-dir build -L loop_ch12 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch12 --output-on-failure

#include "12_context_parallel/attention.h"
#include "fivefold/error.h"

namespace fivefold::ch12 {

ch03::AttentionOutput merge_attention(const ch03::AttentionOutput& a,
                                      const ch03::AttentionOutput& b) {
  (void)a;
  (void)b;
  throw NotImplemented(
      "ch12::merge_attention (chapters/12_context_parallel/README.md, \"The exercise\")");
}

}  // namespace fivefold::ch12
