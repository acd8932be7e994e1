// A run in chapter 14's layouts.

#include "runtime/layout.h"

#include "runtime/fast.h"

namespace fivefold::runtime {

ch14::Workload workload_of(const RunConfig& run) {
  return {run.model, run.seq_len, run.batch, run.micro_batches,
          run.fast ? TiledCausalAttentionKernel::kDefaultTile : 0};
}

void use_layout(const ch14::Layout& layout, const dist::CommunicatorPtr& world, RunConfig& run) {
  const ch14::RankSetup setup = ch14::apply_layout(layout, world);
  run.build_model = setup.build_model;
  run.make_step = setup.make_step;
  run.after_step = setup.after_step;
  run.placement = {setup.data_rank, setup.data_ranks, setup.processes, setup.writer, setup.agree};
}

}  // namespace fivefold::runtime
