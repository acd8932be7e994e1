// Chapter 11: the 1F1B schedule as data (the exercise: README, "The exercise").

#include "11_pipeline_parallel/schedule.h"

#include <algorithm>

#include "fivefold/error.h"

namespace fivefold::ch11 {

Schedule one_f_one_b(int64_t ranks, int64_t micro_batches) {
  FIVEFOLD_CHECK(ranks >= 1 && micro_batches >= 1, "1f1b: needs ranks and micro-batches >= 1");
  Schedule s{"1f1b", ranks, 1, micro_batches, {}};
  for (int64_t r = 0; r < ranks; ++r) {
    std::vector<Action> list;
    // Warm-up: the forwards that fill the pipeline before the first gradient can come back.
    const int64_t warmup = std::min(ranks - r - 1, micro_batches);
    for (int64_t j = 0; j < warmup; ++j) list.push_back({ActionKind::Forward, j, r});
    // Steady state: one forward, then the backward of the oldest micro-batch in flight.
    for (int64_t j = 0; j < micro_batches - warmup; ++j) {
      list.push_back({ActionKind::Forward, warmup + j, r});
      list.push_back({ActionKind::Backward, j, r});
    }
    // Cool-down: the backwards still owed.
    for (int64_t j = micro_batches - warmup; j < micro_batches; ++j)
      list.push_back({ActionKind::Backward, j, r});
    s.lists.push_back(std::move(list));
  }
  return s;
}

}  // namespace fivefold::ch11
