// What a process's training steps did, measured around each step.

#include "runtime/measure.h"

#include <cmath>

namespace fivefold::runtime {

void StepMeter::started(ch03::TrainingStep& step, int64_t first_step) {
  held_ = step.model();
  first_step_ = first_step;
}

void StepMeter::step_begins(int64_t step) {
  if (whole_model_) ++steps_after_whole_model_;
  whole_model_ = false;
  before_ = dist::comm_stats();
  if (step == first_step_) counter_ = std::make_unique<ch02::FlopCounter>();
}

void StepMeter::step_ended(int64_t /*step*/, ch03::TrainingStep& trainer,
                           const ch03::StepResult& /*result*/) {
  if (counter_) step_flops_ = std::llround(counter_->flops());
  counter_.reset();
  dist::accumulate_comm_stats(training_comm_, dist::comm_stats_since(before_));
  state_ = trainer.state_bytes();  // after the step, before any evaluation gathers
}

}  // namespace fivefold::runtime
