// Chapter 15, the planner's exercise: one micro-batch through one stage, priced for chapter 11's
// simulator.
#include "15_trainer_5d/planner.h"

namespace fivefold::ch15 {

ch11::UnitCosts micro_batch_costs(const StageTimes& t) {
  ch11::UnitCosts costs;
  // Each weight's product runs three times: forward, then the input's gradient (B) and the
  // weight's gradient (W). B also runs attention's backward and what recomputation runs again, and
  // it carries the backward's collectives: tp's mirror forward's (and the recomputed forward's),
  // cp's and ep's own (and ep's recomputed), and the gradient's send to the previous stage. W
  // needs nobody.
  costs.forward = t.products + t.attention_forward + t.tp + t.cp_forward + t.ep_forward + t.pp_send;
  costs.backward_input = t.products + t.attention_backward + t.recomputed + t.tp + t.tp_recomputed +
                         t.cp_backward + t.ep_backward + t.ep_recomputed + t.pp_send;
  costs.backward_weight = t.products;
  return costs;
}

}  // namespace fivefold::ch15
