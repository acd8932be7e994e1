// Chapter 11 exercise: the 1F1B schedule as data.
//
// Write one_f_one_b, declared in chapters/11_pipeline_parallel/schedule.h: for each rank r (its
// stage is r), the ordered compute actions. First a warm-up of forwards: how many can rank r run
// before the first gradient could come back from the last stage (and never more than m)? Then
// one forward and one backward in turn (the backward of the oldest micro-batch in flight), then
// the backwards still owed. Use ActionKind::Forward and ActionKind::Backward only:
// add_communication adds the sends and receives. simulate() checks the lists and times them.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch11 &&
//   ctest --test-dir build -L loop_ch11 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch11 --output-on-failure

#include "11_pipeline_parallel/schedule.h"
#include "fivefold/error.h"

namespace fivefold::ch11 {

Schedule one_f_one_b(int64_t ranks, int64_t micro_batches) {
  (void)ranks;
  (void)micro_batches;
  throw NotImplemented(
      "ch11::one_f_one_b (chapters/11_pipeline_parallel/README.md, \"The exercise\")");
}

}  // namespace fivefold::ch11
