// Chapter 02 exercise: count the matmul FLOPs of one token. Read chapters/02_flops_6np/README.md,
// section "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch02 &&
//   ctest --test-dir build -L loop_ch02 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch02 --output-on-failure

#include "02_flops_6np/flops.h"
#include "fivefold/error.h"

namespace fivefold::ch02 {

FlopBreakdown forward_flops_per_token(const TransformerShape& shape, int64_t context) {
  // Fill each field of FlopBreakdown for one token of a `context`-token sequence. A product of a
  // [1, k] row by a [k, n] matrix costs 2·k·n. Which products does each layer do per token?
  // (Hint: grouped-query attention has fewer key/value columns than query columns.)
  throw NotImplemented(
      "ch02: forward_flops_per_token (chapters/02_flops_6np/README.md, 'The exercise')");
}

double training_flops_per_token(const TransformerShape& shape, int64_t context) {
  // Forward + backward. How many products of the same size does backward need per forward one?
  throw NotImplemented(
      "ch02: training_flops_per_token (chapters/02_flops_6np/README.md, 'The exercise')");
}

}  // namespace fivefold::ch02
