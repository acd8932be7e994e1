// Chapter 13 under mpirun: the expert-parallel MoE layer and the training step against one
// process. Every rank routes its own tokens and holds other experts, so a dispatch that loses a
// row, a combine that returns rows to the wrong token, or a step that forgets the ranks' shares
// gives other numbers. Shown to fail on purpose (at 2 and 4 ranks): combine without undoing the
// regrouping (index_copy replaced by the rows as they are) fails LayerEqualsTheSingleDeviceMoe at
// 4 ranks (output, every gradient); the loss weight left at 1 (no 1/ep) fails
// StepEqualsTheSingleDevice (loss, norm, every gradient) and the unclipped curve; the shared
// parameters' gradients not summed over ep fail StepEqualsTheSingleDevice (the router's, the
// attention's, the shared expert's).

#include <map>

#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/data.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "13_expert_parallel/expert_parallel.h"
#include "13_expert_parallel/plan.h"
#include "fivefold/comm_stats.h"
#include "fivefold/mesh.h"
#include "fivefold/seed.h"
#include "parity.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch13;
using fivefold::testing::clipping;
using fivefold::testing::no_clipping;
using fivefold::testing::split;
using fivefold::testing::world;

namespace {

// The MoE settings of the layer tests: 8 experts, 2 per token, one shared expert.
ch07::MoeConfig layer_config(double capacity_factor, double aux_loss_alpha) {
  ch07::MoeConfig m;
  m.n_routed_experts = 8;
  m.num_experts_per_tok = 2;
  m.n_shared_experts = 1;
  m.moe_intermediate_size = 12;
  m.n_group = 1;
  m.topk_group = 1;
  m.capacity_factor = capacity_factor;
  m.aux_loss_alpha = aux_loss_alpha;
  return m;
}

// Routings: as the router likes; every token to rank 0's experts (the other ranks receive none);
// every token to the last expert (one expert receives all of them).
enum class Routing { Free, OnlyRankZero, OneExpertTakesAll };

const char* routing_name(Routing r) {
  return r == Routing::Free ? "free" : r == Routing::OnlyRankZero ? "rank 0 only" : "one expert";
}

void steer(ch07::MoeImpl& moe, Routing routing, int64_t ep) {
  torch::NoGradGuard no_grad;
  auto& bias = moe.gate->e_score_correction_bias;
  const int64_t e = bias.size(0);
  bias.zero_();
  if (routing == Routing::OnlyRankZero) bias.narrow(0, 0, e / ep).fill_(10.0);
  if (routing == Routing::OneExpertTakesAll) bias[e - 1].fill_(10.0);
}

torch::Tensor tokens_of(int rank, int64_t d) {
  return torch::randn({3, 5, d}, generator_for(static_cast<uint64_t>(13 + rank), "x"));
}

torch::Tensor weights_of(int rank, int64_t d) {
  return torch::randn({3, 5, d}, generator_for(static_cast<uint64_t>(13 + rank), "w"));
}

// 8 rows of 12 tokens: 2 rows per rank at 4 ranks.
const ch03::BatchSampler& batches() {
  static const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  static const ch03::BatchSampler sampler(data, 12, 8, 1);
  return sampler;
}

// DeepSeek-V3 in miniature (chapter 10's), with the Switch auxiliary loss when `aux`.
ch03::ModelConfig model_config(bool aux) {
  auto c = ch10::testing::deepseek_config();
  c.n_layers = 2;
  if (aux) c.extensions["aux_loss_alpha"] = 0.01;
  return c;
}

struct Layout {
  int ep = 1;  // expert-parallel ranks, folded into the dp = world / (tp x pp) data ranks
  int zero = 0;
  int tp = 1, pp = 1;
  bool sp = false;
};

int data_ranks(const Layout& l) { return world()->size() / (l.tp * l.pp); }

std::string describe(const Layout& l) {
  return "ep " + std::to_string(l.ep) + " of dp " + std::to_string(data_ranks(l)) + ", tp " +
         std::to_string(l.tp) + (l.sp ? " SP" : "") + ", pp " + std::to_string(l.pp) +
         ", ZeRO " + std::to_string(l.zero);
}

std::vector<Layout> layouts() {
  const int n = world()->size();
  std::vector<Layout> out{{n, 0}, {n, 1}, {n, 2}, {n, 3}};
  if (n == 4) {
    out.insert(out.end(), {{2, 0}, {2, 1}, {2, 2}, {2, 3}});
    // Inside chapter 10's and 11's steps: tp 2 (with and without SP) and pp 2, each x ep 2.
    out.insert(out.end(), {{2, 0, 2, 1}, {2, 1, 2, 1, true}, {2, 2, 1, 2}});
  }
  return out;
}

struct Built {
  std::unique_ptr<ch03::TrainingStep> step;
  dist::CommunicatorPtr dp;      // the batch's rows are cut over dp
  dist::CommunicatorPtr routed;  // the ranks that routed different tokens (dp; dp x tp under SP)
};

// The step as `fivefold train` builds it: chapter 09's over edp, or chapter 10's / 11's over edp
// with the expert-parallel hooks, wrapped in ExpertParallelStep.
// `whole`: the model the run starts from (built, or loaded from a checkpoint).
Built build(const Layout& l, ch03::Transformer whole_model, const ch03::TrainConfig& train) {
  dist::DeviceMesh mesh(world(), {{"pp", l.pp}, {"dp", data_ranks(l)}, {"tp", l.tp}});
  const auto group = make_expert_parallel(mesh.comm("dp"), l.ep);
  ch03::StepFactory make;
  if (l.tp == 1 && l.pp == 1) {
    make = expert_parallel_step(group, l.zero);
  } else {
    const ch03::ModelBuilder whole = [group](const ch03::ModelConfig& c,
                                             const ch03::ModelPart& part) {
      return make_model(c, group, part);
    };
    ch10::TensorParallelPtr tp;
    if (l.tp > 1)
      tp = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{mesh.comm("tp"), l.sp});
    ch03::StepFactory inner;
    if (l.pp > 1) {
      ch11::PipelineLayout layout;
      layout.links = std::make_shared<ch11::PipelineLinks>(mesh.comm("pp"));
      layout.dp = group.edp;
      layout.model_parallel = mesh.comm("pp+tp");
      layout.tp = tp;
      layout.zero = l.zero;
      layout.hooks = expert_parallel_hooks(group);
      inner = ch11::pipeline_parallel_step(layout, whole);
    } else {
      inner = ch10::tensor_parallel_step(tp, group.edp, l.zero, whole, expert_parallel_hooks(group));
    }
    make = expert_parallel_step(group, inner);
  }
  return {make(std::move(whole_model), train), mesh.comm("dp"),
          l.sp ? mesh.comm("dp+tp") : mesh.comm("dp")};
}

}  // namespace

TEST(ExpertParallel, PlacementAndRefusals) {
  EXPECT_EQ(expert_range(8, 4, 3).first, 6);
  EXPECT_EQ(expert_range(8, 4, 3).count, 2);
  EXPECT_EQ(expert_range(8, 1, 0).count, 8);
  auto moe = ch10::testing::deepseek_config();
  auto dense = ch10::testing::tp_config(false);
  check_expert_parallel(moe, 4, 8);
  check_expert_parallel(dense, 1, 3);  // ep 1 is no expert parallelism: any model
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { check_expert_parallel(moe, 3, 3); }, "must split evenly"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { check_expert_parallel(moe, 4, 2); }, "does not divide the 2 data-parallel ranks"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { check_expert_parallel(dense, 2, 2); }, "no routed experts"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { check_expert_parallel(moe, 0, 2); }, "at least 1"));
}

TEST(ExpertParallel, LayerEqualsTheSingleDeviceMoe) {
  // Each rank feeds its own 15 tokens to the expert-parallel layer; the reference is the whole
  // layer (every expert) on one rank, fed each rank's tokens in turn. Output, the input's
  // gradient, the router's and the shared expert's gradients, the load and the auxiliary loss
  // equal the reference on this rank's tokens; each held expert's gradient equals the sum over
  // every rank's tokens; the bias update from the summed load equals the reference's.
  auto data = world();
  const int n = data->size(), r = data->rank();
  const auto group = make_expert_parallel(data, n);
  ch03::ModelConfig model;
  model.d_model = 16;
  const int64_t d = model.d_model;
  for (const auto routing : {Routing::Free, Routing::OnlyRankZero, Routing::OneExpertTakesAll}) {
    for (const double capacity : {0.0, 1.0}) {
      for (const double aux : {0.0, 0.01}) {
        SCOPED_TRACE(std::string(routing_name(routing)) + ", capacity " +
                     std::to_string(capacity) + ", aux " + std::to_string(aux));
        auto config = layer_config(capacity, aux);
        config.bias_update_speed = 0.01;
        torch::manual_seed(7);  // the same whole layer on every rank
        ch07::Moe whole(model, config);
        ch07::Moe mine(model, config, nullptr, expert_range(8, n, r));
        mine->dispatcher = std::make_shared<ExpertParallelDispatcher>(group.ep);
        {
          torch::NoGradGuard no_grad;
          const auto weights = whole->named_parameters();
          for (auto& item : mine->named_parameters()) item.value().copy_(weights[item.key()]);
        }
        steer(*whole, routing, n);
        steer(*mine, routing, n);

        // The reference: each rank's tokens through the whole layer.
        std::map<std::string, torch::Tensor> expert_sum;  // held experts' gradients, summed
        torch::Tensor want_out, want_dx;
        std::map<std::string, torch::Tensor> want_grads;  // the rest, this rank's tokens
        ch07::ExpertLoad want_load;
        for (int s = 0; s < n; ++s) {
          whole->zero_grad(/*set_to_none=*/true);
          const auto before = whole->load().counts.clone();
          const int64_t dropped_before = whole->load().dropped;
          auto x = tokens_of(s, d).requires_grad_(true);
          auto out = whole->forward(x);
          (out * weights_of(s, d)).sum().backward();
          for (const auto& item : whole->named_parameters()) {
            if (!item.value().grad().defined()) continue;
            if (is_expert_parameter("." + item.key())) {
              if (mine->named_parameters().contains(item.key())) {
                auto& sum = expert_sum[item.key()];
                sum = sum.defined() ? sum + item.value().grad() : item.value().grad().clone();
              }
            } else if (s == r) {
              want_grads[item.key()] = item.value().grad().clone();
            }
          }
          if (s == r) {
            want_out = out.detach();
            want_dx = x.grad();
            want_load = whole->load();
            want_load.counts = whole->load().counts - before;  // the load accumulates
            want_load.dropped = whole->load().dropped - dropped_before;
          }
        }

        auto x = tokens_of(r, d).requires_grad_(true);
        auto out = mine->forward(x);
        (out * weights_of(r, d)).sum().backward();
        EXPECT_TENSOR_CLOSE(out, want_out, 1e-6, 1e-5);
        EXPECT_TENSOR_CLOSE(x.grad(), want_dx, 1e-6, 1e-5);
        EXPECT_TRUE(torch::equal(mine->load().counts, want_load.counts));
        EXPECT_EQ(mine->load().dropped, want_load.dropped);
        EXPECT_NEAR(mine->load().aux_loss, want_load.aux_loss, 1e-7);
        for (const auto& item : mine->named_parameters()) {
          if (!item.value().requires_grad()) continue;
          SCOPED_TRACE(item.key());
          const bool expert = is_expert_parameter("." + item.key());
          const auto& want = expert ? expert_sum : want_grads;
          if (want.count(item.key()) == 0) {  // no token chose this expert on any rank
            EXPECT_FALSE(item.value().grad().defined());
            continue;
          }
          ASSERT_TRUE(item.value().grad().defined());
          EXPECT_TENSOR_CLOSE(item.value().grad(), want.at(item.key()), 1e-6, 1e-5);
        }
        whole->update_bias(nullptr);  // the load of every rank's tokens
        mine->update_bias(data.get());
        EXPECT_TENSOR_CLOSE(mine->gate->e_score_correction_bias,
                            whole->gate->e_score_correction_bias, 0, 0);
      }
    }
  }
}

TEST(ExpertParallel, TrafficEqualsTheFormula) {
  // The all-to-alls of one forward and backward of the layer, as the communicator counted them,
  // against expert_parallel_traffic from the routing (which rank's experts each assignment
  // chose, counted here from the router's choice and exchanged with an all-gather).
  auto data = world();
  const int n = data->size(), r = data->rank();
  const auto group = make_expert_parallel(data, n);
  ch03::ModelConfig model;
  model.d_model = 16;
  for (const auto routing : {Routing::Free, Routing::OnlyRankZero}) {
    SCOPED_TRACE(routing_name(routing));
    torch::manual_seed(7);
    ch07::Moe mine(model, layer_config(0, 0), nullptr, expert_range(8, n, r));
    mine->dispatcher = std::make_shared<ExpertParallelDispatcher>(group.ep);
    steer(*mine, routing, n);
    dist::reset_comm_stats();
    // The input needs a gradient, as a block's does: otherwise the dispatch has no backward.
    auto x = tokens_of(r, 16).requires_grad_(true);
    (mine->forward(x) * weights_of(r, 16)).sum().backward();
    const auto counted = dist::comm_counts(group.ep->name(), dist::Op::AllToAll);

    const auto rank_of = mine->last_routing().experts.reshape(-1).div(8 / n, "floor");
    const auto sent = torch::bincount(rank_of, {}, n);                 // [n] rows to each rank
    const auto all = data->all_gather(sent.unsqueeze(0)).reshape({n, n});  // [source, destination]
    const auto received = all.select(1, r).contiguous();
    const std::vector<int64_t> sent_rows(sent.data_ptr<int64_t>(), sent.data_ptr<int64_t>() + n);
    const std::vector<int64_t> received_rows(received.data_ptr<int64_t>(),
                                             received.data_ptr<int64_t>() + n);
    const auto want = expert_parallel_traffic(sent_rows, received_rows, r, 8, 16);
    EXPECT_EQ(counted.calls, want.calls);
    EXPECT_EQ(counted.payload_bytes, want.payload_bytes);
    EXPECT_EQ(static_cast<int64_t>(counted.modelled_wire_bytes), want.wire_bytes);
    if (routing == Routing::OnlyRankZero && r > 0) {
      EXPECT_EQ(received.sum().item<int64_t>(), 0) << "rank " << r << " receives no token";
    }
  }
}

TEST(ExpertParallel, PlanEqualsTheModel) {
  // The parameters the plan gives each rank equal the numel of the rank's model; the plan's
  // traffic under even routing equals the formula's for tokens·k/ep rows to every rank.
  auto data = world();
  const int n = data->size();
  const auto group = make_expert_parallel(data, n);
  const auto config = model_config(false);
  auto local = make_model(config, group);
  int64_t numel = 0, experts = 0;
  for (const auto& item : local->named_parameters()) {
    numel += item.value().numel();
    if (is_expert_parameter(item.key())) experts += item.value().numel();
  }
  const auto plan = expert_parallel_plan(config, n, 24);
  EXPECT_EQ(plan.parameters_per_rank, numel);
  EXPECT_EQ(plan.expert_parameters, experts);
  EXPECT_EQ(plan.moe_layers, 1);
  EXPECT_EQ(plan.memory_bytes, 16 * numel);
  const std::vector<int64_t> rows(static_cast<size_t>(n), 24 * 2 / n);
  const auto layer = expert_parallel_traffic(rows, rows, 0, 8, config.d_model);
  EXPECT_EQ(plan.per_micro_batch.wire_bytes, layer.wire_bytes);
  // DeepSeek-V3 at ep 64: 4 of the 256 experts per MoE layer on each rank.
  const auto v3 = expert_parallel_plan(ch07::deepseek_v3_config(), 64, 4096);
  EXPECT_EQ(v3.experts_per_rank, 4);
  EXPECT_EQ(v3.moe_layers, 58);
  EXPECT_EQ(v3.expert_parameters, 58LL * 4 * 3 * 7168 * 2048);
  // The notes' figures (notes/13_expert_parallel.md), from the same code.
  // §6: 3.70 GB per MoE layer and 214.6 GB over the 58, at 4,096 tokens per micro-batch, fp32.
  const double wire = static_cast<double>(v3.per_micro_batch.wire_bytes);
  EXPECT_NEAR(wire / 58 / 1e9, 3.70, 0.005);
  EXPECT_NEAR(wire / 1e9, 214.6, 0.05);
  // §1: 671.0 B parameters, 37.6 B active; the routed experts of the 58 MoE layers hold 653.9 B
  // (97%); 16 bytes each of fp32 training state is 10.7 TB; 10.2 B expert parameters a rank.
  const auto counts = ch07::count_parameters(ch07::deepseek_v3_config());
  EXPECT_NEAR(counts.total / 1e9, 671.0, 0.05);
  EXPECT_NEAR(counts.active / 1e9, 37.6, 0.05);
  const auto whole = expert_parallel_plan(ch07::deepseek_v3_config(), 1, 4096);
  EXPECT_NEAR(whole.expert_parameters / 1e9, 653.9, 0.05);
  EXPECT_NEAR(static_cast<double>(whole.expert_parameters) / counts.total, 0.97, 0.005);
  EXPECT_NEAR(16.0 * counts.total / 1e12, 10.7, 0.05);
  EXPECT_NEAR(v3.expert_parameters / 1e9, 10.2, 0.05);
}

TEST(ExpertParallel, StepEqualsTheSingleDevice) {
  // Step 1 of the expert-parallel step (ep x edp over the world's data-parallel ranks) against
  // one process on the same micro-batches (each rank's rows are one micro-batch there, so the
  // auxiliary loss and capacity see the same tokens): loss, norm, every gradient (gathered).
  for (const auto& l : layouts()) {
    for (const bool aux : {false, true}) {
      if (aux && l.sp) continue;  // refused: the Switch loss needs the whole sequence's routing
      SCOPED_TRACE(describe(l) + (aux ? ", aux loss" : ""));
      const auto config = model_config(aux);
      const int n = data_ranks(l);
      ch03::SingleProcessStep single(ch07::make_model(config), no_clipping());
      auto built = build(l, ch07::make_model(config), no_clipping());
      const auto want = single.step(split(batches().batch(0), n), 0);
      const auto got = built.step->step({batches().batch(0, built.dp->rank(), n)}, 0);
      EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss);
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
      const auto grads = dynamic_cast<ExpertParallelStep&>(*built.step).gradients();
      for (const auto& item : single.model()->named_parameters()) {
        if (!item.value().grad().defined()) continue;  // the balancing bias; unchosen experts
        SCOPED_TRACE(item.key());
        ASSERT_TRUE(grads.count(item.key()) > 0);
        EXPECT_TENSOR_CLOSE(grads.at(item.key()), item.value().grad(), 1e-6, 1e-4);
      }
    }
  }
}

TEST(ExpertParallel, FollowsTheSingleProcessCurve) {
  // 3 steps, AdamW without clipping and with it, each followed by the bias update (the load
  // summed over every data-parallel rank); then the whole model and AdamW's state (gathered by
  // name) equal the single process's, and a step restored from that state continues alike.
  for (const auto& l : layouts()) {
    for (const auto& train : {no_clipping(), clipping()}) {
      SCOPED_TRACE(describe(l) + (train.grad_clip > 0 ? ", clipped" : ", unclipped"));
      const auto config = model_config(false);
      const int n = data_ranks(l);
      ch03::SingleProcessStep single(ch07::make_model(config), train);
      auto built = build(l, ch07::make_model(config), train);
      auto& step = *built.step;
      for (int s = 0; s < 3; ++s) {
        const auto want = single.step(split(batches().batch(s), n), s);
        const auto got = step.step({batches().batch(s, built.dp->rank(), n)}, s);
        EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss) << "step " << s;
        EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << "step " << s;
        // The balancing update from the load summed over the ranks that routed other tokens (a
        // pipeline stage without MoE layers reports none).
        const auto want_load = ch07::after_step(single.model());
        const auto got_load = ch07::after_step(step.model(), built.routed.get());
        if (got_load.contains("moe_load")) {
          EXPECT_EQ(got_load["moe_load"], want_load["moe_load"]) << "step " << s;
        }
      }
      auto& full = step.full_model();
      for (const auto& item : single.model()->named_parameters()) {
        SCOPED_TRACE(item.key());
        EXPECT_TENSOR_CLOSE(full->named_parameters()[item.key()], item.value(),
                            fivefold::testing::kParameterAtol, 1e-4);
      }
      const auto state = step.optimizer_state();
      fivefold::testing::expect_same_optimizer_state(state, single.optimizer_state());
      // Resume: a new step from the whole model and the gathered state takes steps 3 and 4 alike
      // (the second sees AdamW's moments), and holds the same state after them.
      auto again = build(l, step.full_model(), train);
      again.step->load_optimizer_state(state, "test");
      for (int s = 3; s < 5; ++s) {
        const auto want = single.step(split(batches().batch(s), n), s);
        const auto got = again.step->step({batches().batch(s, again.dp->rank(), n)}, s);
        EXPECT_NEAR(got.loss, want.loss, 1e-5 * want.loss) << "resumed step " << s;
        EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-4 * want.grad_norm) << "resumed step " << s;
        ch07::after_step(single.model());
        ch07::after_step(again.step->model(), again.routed.get());
      }
      fivefold::testing::expect_same_optimizer_state(again.step->optimizer_state(),
                                                     single.optimizer_state(), "resumed: ");
      // The whole model goes at the next step, through ep's own step too (ModelPartStep::step).
      ch03::Transformer whole = again.step->full_model();
      again.step->step({batches().batch(5, again.dp->rank(), n)}, 5);
      EXPECT_EQ(whole.ptr().use_count(), 1) << "the step still holds the whole model";
    }
  }
}
