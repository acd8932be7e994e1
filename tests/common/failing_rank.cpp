// Checks the test harness itself: an assertion that fails on rank 1 only, while the other ranks
// go on into a collective, must end the whole job at once (never leave them waiting).
// Not part of the ordinary suites: CTest runs it through expect_failure.cmake.

#include "testing.h"

TEST(Harness, FailureOnOneRankEndsTheJob) {
  auto world = fivefold::testing::world();
  if (world->rank() == 1) {
    EXPECT_EQ(1 + 1, 3) << "deliberate failure on rank 1";
  }
  auto x = torch::ones({4});
  world->all_reduce(x);  // rank 1 never gets here: it has aborted the job
  world->all_reduce(x);
}
