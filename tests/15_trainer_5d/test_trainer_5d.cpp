// Chapter 15 under mpirun (8 ranks): compose_step's step in layouts that use three or four of
// the dimensions at once, against one process on the same global batch: at step 1 the loss, the
// gradient norm and every parameter's gradient (gathered by name); over 3 steps, with AdamW
// without clipping (a constant factor changes the curve) and with clipping, the losses, norms,
// the whole model and AdamW's state. A dimension whose step is left out would still give the
// one device's numbers (its ranks compute the same thing redundantly: without the context-
// parallel wrapper every cp rank trains on whole rows, and the average over cp of equal gradients
// is the gradient), so step 1 also checks that each dimension's group carried bytes. Shown to
// fail on purpose: the context-parallel wrapper left out fails the cp layouts' traffic check; the
// replicas taken as dp x cp instead of edp with experts split fails the first layout's loss,
// norm and gradients. The steps are the trainer's own (apply_layout), and the curve runs its
// balancing update after every step, comparing each expert's load with one process's: the load
// summed over dp x cp instead of dp x cp x tp under sequence parallelism (layout.cpp's routed
// group) fails the first layout there.

#include <map>

#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/data.h"
#include "07_moe/moe.h"
#include "15_trainer_5d/trainer_5d.h"
#include "fivefold/comm_stats.h"
#include "fixtures.h"
#include "fivefold/memory.h"
#include "fivefold/mesh.h"
#include "parity.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch15;
using fivefold::ch15::testing::sizes;
using fivefold::testing::clipping;
using fivefold::testing::no_clipping;
using fivefold::testing::split;
using fivefold::testing::world;

namespace {

// 12 rows of 16 tokens (zig-zag over cp 2: 4 chunks of 4; 12 rows: dp 2 x 2 or 3 micro-batches).
const ch03::BatchSampler& batches() {
  static const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  static const ch03::BatchSampler sampler(data, 16, 12, 1);
  return sampler;
}

struct Case {
  std::string name;
  Layout layout;
  int64_t micro = 2;  // micro-batches per data-parallel rank
  bool moe = true;    // DeepSeek-V3 in miniature (MLA + experts), else Llama with GQA
};

std::vector<Case> cases() {
  std::vector<Case> out;
  Case a{"tp2 SP x pp2 x cp2, ep2, ZeRO-1", sizes(1, 2, 2, 2, 2, 1)};
  a.layout.sequence_parallel = true;
  out.push_back(a);
  Case b{"dp2 x tp2 x pp2 interleaved, ep2", sizes(2, 2, 2, 1, 2, 0)};
  b.layout.schedule = "interleaved";
  b.layout.virtual_stages = 2;
  out.push_back(b);
  Case c{"dp2 x cp2 contiguous all-gather x tp2, ep4, ZeRO-2", sizes(2, 2, 1, 2, 4, 2)};
  c.layout.cp_layout = ch12::CpLayout::Contiguous;
  c.layout.cp_attention = ch12::CpAttention::AllGather;
  out.push_back(c);
  Case d{"dp2 x pp2 zb x cp2, ep2, ZeRO-3", sizes(2, 1, 2, 2, 2, 3)};
  d.layout.schedule = "zb";
  out.push_back(d);
  Case e{"Llama: tp2 SP x pp2 x cp2, 3 micro-batches", sizes(1, 2, 2, 2, 1, 0), 3, false};
  e.layout.sequence_parallel = true;
  out.push_back(e);
  return out;
}

ch03::ModelConfig model_of(const Case& c) {
  auto config = c.moe ? ch10::testing::deepseek_config() : ch10::testing::tp_config(false);
  config.n_layers = 4;  // pp 2 x 2 virtual stages
  return config;
}

// What the trainer builds for a layout: apply_layout's mesh, step, placement and balancing update.
struct Built {
  std::unique_ptr<ch03::TrainingStep> step;
  RankSetup run;
};

Built build(const Case& c, ch03::Transformer whole, const ch03::TrainConfig& train) {
  Built b;
  b.run = apply_layout(c.layout, world());
  b.step = b.run.make_step(std::move(whole), train);
  return b;
}

// This rank's micro-batches of step `s` and the single process's (the same rows: dp x micro
// slices of the global batch).
std::vector<ch03::Batch> mine(const Case& c, const Built& b, int64_t s) {
  return split(batches().batch(s, static_cast<int>(b.run.data_rank), static_cast<int>(c.layout.dp)),
               c.micro);
}
std::vector<ch03::Batch> all(const Case& c, int64_t s) {
  return split(batches().batch(s), c.layout.dp * c.micro);
}

}  // namespace

TEST(Trainer5D, StepEqualsTheSingleDevice) {
  ASSERT_EQ(world()->size(), 8) << "the layouts are for 8 ranks";
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto config = model_of(c);
    // The layout is one resolve_layout accepts for this model and batch.
    Workload run;
    run.model = config;
    run.seq_len = batches().batch(0).inputs.size(1);
    run.batch = batches().batch(0).inputs.size(0);
    run.micro_batches = c.micro;
    resolve_layout(c.layout, world()->size(), run);

    ch03::SingleProcessStep single(ch07::make_model(config), no_clipping());
    auto built = build(c, ch07::make_model(config), no_clipping());
    const auto want = single.step(all(c, 0), 0);
    dist::reset_comm_stats();
    const auto got = built.step->step(mine(c, built, 0), 0);
    // Every dimension of the layout did its part: its group carried bytes in the step (a
    // dimension whose step was left out computes the same numbers redundantly, and carries none).
    const auto carried = [](const std::string& group) {
      int64_t bytes = 0;
      const auto stats = dist::comm_stats();
      if (stats.count(group) == 0) return bytes;
      for (const auto& [op, counts] : stats.at(group)) bytes += counts.payload_bytes;
      return bytes;
    };
    if (c.layout.tp > 1) {
      EXPECT_GT(carried("tp"), 0);
    }
    if (c.layout.pp > 1) {
      EXPECT_GT(carried("pp-activations"), 0);
    }
    if (c.layout.cp > 1) {
      EXPECT_GT(carried("cp"), 0);
    }
    if (c.layout.ep > 1) {
      EXPECT_GT(carried("ep"), 0);
    }
    if (c.layout.dp > 1) {
      EXPECT_GT(carried(c.layout.ep > 1 ? "edp" : "dp+cp"), 0);
    }
    EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss);
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
    const auto grads = built.step->gradients();
    int64_t compared = 0;
    for (const auto& item : single.model()->named_parameters()) {
      if (!item.value().grad().defined()) continue;  // the balancing bias; unchosen experts
      SCOPED_TRACE(item.key());
      ASSERT_TRUE(grads.count(item.key()) > 0);
      EXPECT_TENSOR_CLOSE(grads.at(item.key()), item.value().grad(), 1e-6, 1e-4);
      ++compared;
    }
    EXPECT_GT(compared, 20);
  }
}

TEST(Trainer5D, FollowsTheSingleProcessCurve) {
  for (const auto& c : cases()) {
    for (const auto& train : {no_clipping(), clipping()}) {
      SCOPED_TRACE(c.name + (train.grad_clip > 0 ? ", clipped" : ", unclipped"));
      const auto config = model_of(c);
      ch03::SingleProcessStep single(ch07::make_model(config), train);
      auto built = build(c, ch07::make_model(config), train);
      for (int64_t s = 0; s < 3; ++s) {
        const auto want = single.step(all(c, s), s);
        const auto got = built.step->step(mine(c, built, s), s);
        EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << "step " << s;
        EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-4 * want.grad_norm) << "step " << s;
        // The trainer's balancing update (apply_layout's after_step): each expert's load summed
        // over the ranks that routed other tokens and merged over the stages equals one process's,
        // and so does the bias it moves (compared with the model below).
        const auto want_load = ch07::after_step(single.model());
        const auto got_load = built.run.after_step(built.step->model());
        EXPECT_EQ(got_load.value("moe_load", nlohmann::json()),
                  want_load.value("moe_load", nlohmann::json()))
            << "step " << s;
        if (want_load.contains("moe_dropped")) {
          EXPECT_NEAR(got_load["moe_max_load"].get<double>(),
                      want_load["moe_max_load"].get<double>(), 1e-12) << "step " << s;
          EXPECT_NEAR(got_load["moe_dropped"].get<double>(),
                      want_load["moe_dropped"].get<double>(), 1e-12) << "step " << s;
        }
      }
      auto& full = built.step->full_model();
      for (const auto& item : single.model()->named_parameters()) {
        SCOPED_TRACE(item.key());
        EXPECT_TENSOR_CLOSE(full->named_parameters()[item.key()], item.value(),
                            fivefold::testing::kParameterAtol, 1e-4);
      }
      const auto want_state = single.optimizer_state();
      fivefold::testing::expect_same_optimizer_state(built.step->optimizer_state(), want_state);
      // What a checkpoint saves: the same state on world rank 0, nothing on the other ranks,
      // which never hold the whole of it meanwhile (the gather above costs each all of it).
      {
        int64_t whole_bytes = 0;
        for (const auto& [name, t] : want_state) whole_bytes += t.numel() * t.element_size();
        MemoryTracker memory;
        const auto for_writer = built.step->optimizer_state_for_writer();
        if (world()->rank() == 0) {
          fivefold::testing::expect_same_optimizer_state(for_writer, want_state, "the writer's: ");
        } else {
          EXPECT_TRUE(for_writer.empty()) << for_writer.size() << " tensors off the writer";
          EXPECT_LT(memory.peak_bytes(), whole_bytes) << "the whole state held off the writer";
        }
      }

      // Resume: a copy of the single process's model and its AdamW state into a fresh layout,
      // two steps on (the first step's loss and norm depend on the weights alone; the second
      // sees the loaded moments), then the state compared again.
      auto copy = ch07::make_model(config);
      fivefold::testing::copy_weights(*copy, *single.model());
      auto resumed = build(c, copy, train);
      resumed.step->load_optimizer_state(want_state, "the single process");
      for (int64_t s = 3; s < 5; ++s) {
        const auto want = single.step(all(c, s), s);
        const auto got = resumed.step->step(mine(c, resumed, s), s);
        EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << "resumed step " << s;
        EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-4 * want.grad_norm) << "resumed step " << s;
      }
      fivefold::testing::expect_same_optimizer_state(resumed.step->optimizer_state(),
                                                     single.optimizer_state(), "resumed: ");
    }
  }
}
