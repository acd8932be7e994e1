// Chapter 09 exercise: the bucketed, overlapped gradient all-reduce. Read
// chapters/09_data_parallel/README.md, section "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch09 &&
//   ctest --test-dir build -L loop_ch09 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch09 --output-on-failure

#include "09_data_parallel/ddp.h"
#include "fivefold/error.h"

namespace fivefold::ch09 {

void DistributedDataParallel::mark_ready(size_t index) {
  // Called by the hook on parameter `index`'s gradient accumulator, during backward.
  // 1. Mark the parameter ready (ready_), once per backward, and count it in its bucket
  //    (bucket_of_, ready_in_bucket_).
  // 2. While the next bucket to launch (next_bucket_) is complete, launch(it) and move on:
  //    buckets must start in index order on every rank, or two ranks could wait in different
  //    all-reduces.
  throw NotImplemented(
      "ch09: DistributedDataParallel::mark_ready (chapters/09_data_parallel/README.md, "
      "'The exercise')");
}

}  // namespace fivefold::ch09
