// Chapter 10: the communication operators, forward and backward, against what they must compute.
// Every rank's input differs (rank-dependent values), so an operator that skips its collective, or
// runs it in the wrong direction, gives another number. Shown to fail on purpose: f with an
// identity backward fails CopyToTensorParallelSumsTheGradient at 2 and 4 ranks; g with an
// all-reduce backward fails ReduceFromTensorParallelPassesTheGradient.

#include "10_tensor_parallel/mappings.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch10;
using fivefold::testing::world;

namespace {
// A tensor that differs on every rank, with gradients on.
torch::Tensor per_rank(std::vector<int64_t> shape, int rank, const char* name) {
  return torch::randn(shape, fivefold::generator_for(static_cast<uint64_t>(rank), name))
      .requires_grad_(true);
}
}  // namespace

TEST(Conjugates, CopyToTensorParallelSumsTheGradient) {
  auto tp = world();
  auto x = torch::randn({3, 5}, fivefold::generator_for(0, "x"))
               .requires_grad_(true);  // same everywhere
  auto y = copy_to_tensor_parallel(x, tp);
  EXPECT_TENSOR_EQ(y, x);  // forward: the identity
  auto w = per_rank({3, 5}, tp->rank(), "w").detach();
  (y * w).sum().backward();
  auto want = w.clone();
  tp->all_reduce(want);  // every rank's use of x contributes to its gradient
  EXPECT_TENSOR_CLOSE(x.grad(), want, 1e-6, 1e-6);
}

TEST(Conjugates, ReduceFromTensorParallelPassesTheGradient) {
  auto tp = world();
  auto x = per_rank({4, 2}, tp->rank(), "partial");
  const auto before = x.detach().clone();
  auto y = reduce_from_tensor_parallel(x, tp);
  auto want = x.detach().clone();
  tp->all_reduce(want);
  EXPECT_TENSOR_CLOSE(y, want, 1e-6, 1e-6);  // forward: the sum of the partial outputs
  EXPECT_TENSOR_EQ(x.detach(), before);      // the input is left alone
  auto c = torch::randn({4, 2}, fivefold::generator_for(0, "c"));  // same everywhere
  (y * c).sum().backward();
  EXPECT_TENSOR_EQ(x.grad(), c);  // backward: the identity
}

// Sequence parallelism's pair, with a sequence that does not split evenly (7 over 2 or 4 ranks).
TEST(SequenceParallel, GatherAndReduceScatterAreConjugate) {
  auto tp = world();
  const int64_t seq = 7;
  const auto part = sequence_part(seq, tp->rank(), tp->size());
  // The whole sequence, the same on every rank; each rank holds its part.
  auto full = torch::randn({2, seq, 3}, fivefold::generator_for(0, "seq"));
  auto mine = full.narrow(1, part.first, part.length).clone().requires_grad_(true);
  auto gathered = gather_from_sequence_parallel(mine, seq, tp);
  EXPECT_TENSOR_EQ(gathered, full);
  // Backward: each rank's gradient of the whole sequence differs; the part's gradient is the sum
  // over ranks of their gradients at its positions.
  auto g = per_rank({2, seq, 3}, tp->rank(), "g").detach();
  (gathered * g).sum().backward();
  auto sum = g.clone();
  tp->all_reduce(sum);
  EXPECT_TENSOR_CLOSE(mine.grad(), sum.narrow(1, part.first, part.length), 1e-6, 1e-6);

  // Reduce-scatter: partial sums in, this rank's part of the sum out; backward gathers.
  auto partial = per_rank({2, seq, 3}, tp->rank(), "partial");
  auto scattered = reduce_scatter_to_sequence_parallel(partial, tp);
  auto total = partial.detach().clone();
  tp->all_reduce(total);
  EXPECT_TENSOR_CLOSE(scattered, total.narrow(1, part.first, part.length), 1e-6, 1e-6);
  auto h = torch::randn({2, seq, 3}, fivefold::generator_for(0, "h"));  // same everywhere
  (scattered * h.narrow(1, part.first, part.length)).sum().backward();
  EXPECT_TENSOR_EQ(partial.grad(), h);  // every rank's partial sum reaches every position once

  // Scatter: no communication forward, gather backward.
  auto whole = full.clone().requires_grad_(true);
  auto piece = scatter_to_sequence_parallel(whole, tp);
  EXPECT_TENSOR_EQ(piece, full.narrow(1, part.first, part.length));
  (piece * h.narrow(1, part.first, part.length)).sum().backward();
  EXPECT_TENSOR_EQ(whole.grad(), h);
}

TEST(SequenceParallel, PartsFollowTheSplitRule) {
  EXPECT_EQ(sequence_part(7, 0, 4).first, 0);
  EXPECT_EQ(sequence_part(7, 0, 4).length, 2);
  EXPECT_EQ(sequence_part(7, 3, 4).first, 6);
  EXPECT_EQ(sequence_part(7, 3, 4).length, 1);
  EXPECT_THROW(sequence_part(7, 4, 4), fivefold::Error);
}
