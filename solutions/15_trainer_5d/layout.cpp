// Chapter 15: a layout checked, cut into groups, and handed to this rank's training run.
#include <sstream>

#include "07_moe/moe.h"
#include "15_trainer_5d/trainer_5d.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

std::string Layout::describe() const {
  std::ostringstream out;
  out << "dp " << dp << " x tp " << tp << (sequence_parallel ? " (sequence parallel)" : "")
      << " x pp " << pp;
  if (pp > 1) {
    out << " (" << schedule;
    if (virtual_stages > 1) out << ", " << virtual_stages << " virtual stages";
    out << ")";
  }
  out << " x cp " << cp;
  if (cp > 1) {
    out << " (" << (cp_layout == ch12::CpLayout::Zigzag ? "zigzag" : "contiguous") << ", "
        << (cp_attention == ch12::CpAttention::Ring ? "ring" : "allgather") << ")";
  }
  if (ep > 1) out << ", ep " << ep;
  out << ", ZeRO-" << zero;
  return out.str();
}

Layout resolve_layout(Layout layout, int64_t world_size, const Workload& work) {
  FIVEFOLD_CHECK(layout.tp >= 1 && layout.pp >= 1 && layout.cp >= 1 && layout.ep >= 1 &&
                     layout.dp >= 0,
                 "the layout's sizes must be at least 1: tp ", layout.tp, ", pp ", layout.pp,
                 ", cp ", layout.cp, ", ep ", layout.ep, ", dp ", layout.dp);
  FIVEFOLD_CHECK(layout.zero >= 0 && layout.zero <= 3, "--zero must be 0, 1, 2 or 3, got ",
                 layout.zero);
  const int64_t model_ranks = layout.tp * layout.pp * layout.cp;
  if (layout.dp == 0) {
    FIVEFOLD_CHECK(world_size % model_ranks == 0, "tp ", layout.tp, " x pp ", layout.pp, " x cp ",
                   layout.cp, " = ", model_ranks, " does not divide the ", world_size,
                   " processes");
    layout.dp = world_size / model_ranks;
  }
  FIVEFOLD_CHECK(layout.ranks() == world_size, "dp ", layout.dp, " x tp ", layout.tp, " x pp ",
                 layout.pp, " x cp ", layout.cp, " = ", layout.ranks(),
                 " must equal the number of processes, ", world_size);
  FIVEFOLD_CHECK(!layout.sequence_parallel || layout.tp > 1,
                 "--sequence-parallel splits the sequence over the tensor-parallel ranks: it "
                 "needs --tp 2 or more");
  // Each chapter refuses what its method cannot do, with its reason.
  ch10::check_tensor_parallel(work.model, static_cast<int>(layout.tp), layout.sequence_parallel);
  ch11::check_pipeline(work.model, layout.pp, layout.virtual_stages, layout.schedule,
                       work.micro_batches);
  ch12::check_context_parallel(work.model, work.seq_len, layout.cp, layout.cp_layout);
  ch13::check_expert_parallel(work.model, layout.ep, layout.dp * layout.cp);
  FIVEFOLD_CHECK(work.micro_batches >= 1 && work.batch % (layout.dp * work.micro_batches) == 0,
                 "the global batch (", work.batch, " rows) must split into ", layout.dp,
                 " data-parallel ranks x ", work.micro_batches, " micro-batches of equal rows");
  return layout;
}

Groups make_groups(const Layout& layout, const dist::DeviceMesh& mesh) {
  Groups groups;
  // The gradients are averaged over dp x cp: the context-parallel ranks saw other tokens of the
  // same rows, as data-parallel ranks see other rows.
  groups.data = mesh.comm("dp+cp");
  groups.cp = mesh.comm("cp");
  groups.pp = mesh.comm("pp");
  groups.pp_tp = mesh.comm("pp+tp");
  if (layout.tp > 1) {
    groups.tp = std::make_shared<ch10::TensorParallel>(
        ch10::TensorParallel{mesh.comm("tp"), layout.sequence_parallel});
  }
  if (layout.ep > 1) groups.experts = ch13::make_expert_parallel(groups.data, layout.ep);
  return groups;
}

RankSetup apply_layout(const Layout& layout, const dist::CommunicatorPtr& world) {
  // Pipeline stages slowest, tensor-parallel peers neighbouring ranks (tp fastest).
  dist::DeviceMesh mesh(world, {{"pp", static_cast<int>(layout.pp)},
                                {"dp", static_cast<int>(layout.dp)},
                                {"cp", static_cast<int>(layout.cp)},
                                {"tp", static_cast<int>(layout.tp)}});
  const Groups groups = make_groups(layout, mesh);
  RankSetup setup;
  setup.build_model = ch07::make_model;  // the most complete model the chapters build
  setup.make_step = compose_step(layout, groups, world->size());
  // Expert load and the balancing update, with the load summed over the ranks that routed
  // different tokens: the data- and context-parallel ones, and under sequence parallelism the tp
  // ones too. Each pipeline stage balances its own layers; the metrics line shows them all.
  auto routed = layout.sequence_parallel ? mesh.comm("dp+cp+tp") : groups.data;
  setup.after_step = [routed](ch03::Transformer& m) { return ch07::after_step(m, routed.get()); };
  if (layout.pp > 1) {
    setup.after_step = [routed, stages = groups.pp](ch03::Transformer& m) {
      return ch11::merge_stage_metrics(ch07::after_step(m, routed.get()), *stages);
    };
  }
  setup.data_rank = mesh.coord("dp");
  setup.data_ranks = layout.dp;
  setup.processes = world->size();
  setup.writer = world->rank() == 0;
  return setup;
}

}  // namespace fivefold::ch15
