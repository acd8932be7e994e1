// Chapter 15, the planner's exercise: one micro-batch through one stage, priced for chapter 11's
// simulator.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch15 &&
//   ctest --test-dir build -L loop_ch15 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch15 --output-on-failure
#include "15_trainer_5d/planner.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

ch11::UnitCosts micro_batch_costs(const StageTimes& t) {
  // Contract: the three costs chapter 11's simulator runs for one micro-batch through one stage,
  // in seconds: forward (F), the input's gradient (B) and the weights' gradient (W), each the sum
  // of the parts of `t` it waits for. B + W is the whole backward; ZB-H1 runs W later, so W holds
  // only what needs no other rank. Leave `scale` empty (estimate_step sets it). The tests:
  // Planner.PricesAMicroBatchFromItsParts, then the whole step against the chapters' exact counts
  // (notes/15_trainer_5d.md §7).
  (void)t;
  throw NotImplemented(
      "ch15: micro_batch_costs (chapters/15_trainer_5d/README.md, \"Choosing the layout\")");
}

}  // namespace fivefold::ch15
