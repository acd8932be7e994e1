#pragma once
/// @file measure.h
/// @brief What one process's training steps did, measured as a run goes (a RunObserver): the
/// bytes it handed each communicator, the state it kept, the matmul FLOPs of one step, and how
/// many steps began with the whole model gathered. Chapter 15's report compares them with the
/// chapters' formulas.

#include <cstdint>
#include <memory>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "fivefold/comm_stats.h"
#include "runtime/run.h"

namespace fivefold::runtime {

/// Add it to RunConfig::observers; read it after the run.
class StepMeter : public RunObserver {
 public:
  void started(ch03::TrainingStep& step, int64_t first_step) override;
  void step_begins(int64_t step) override;
  void step_ended(int64_t step, ch03::TrainingStep& trainer,
                  const ch03::StepResult& result) override;
  void gathered_whole_model() override { whole_model_ = true; }

  /// The communicator counts of the training steps alone: no evaluation, checkpoint or set-up
  /// traffic (what the per-step formulas predict).
  const dist::CommStats& training_comm() const { return training_comm_; }
  /// The model as the step holds it (TrainingStep::model(): a tensor-parallel slice, a pipeline
  /// stage's layers): what the data-parallel reductions carry. Null before the run starts.
  ch03::Transformer held() const { return held_; }
  /// Training steps that began right after the whole model was gathered for an evaluation or a
  /// checkpoint (ZeRO-3's first forward then finds every unit already gathered).
  int64_t steps_after_whole_model() const { return steps_after_whole_model_; }
  /// What the step kept right after the last training step (TrainingStep::state_bytes).
  const ch03::StateBytes& state() const { return state_; }
  /// The matmul FLOPs of the run's first training step, forward, backward and update (chapter
  /// 02's FlopCounter, alive for that step only: it slows every operation a little); -1 before
  /// any step.
  int64_t step_flops() const { return step_flops_; }

 private:
  ch03::Transformer held_{nullptr};
  dist::CommStats training_comm_;
  dist::CommStats before_;
  int64_t first_step_ = 0;
  int64_t steps_after_whole_model_ = 0;
  bool whole_model_ = false;
  ch03::StateBytes state_;
  int64_t step_flops_ = -1;
  std::unique_ptr<ch02::FlopCounter> counter_;  // alive for the first step
};

}  // namespace fivefold::runtime
