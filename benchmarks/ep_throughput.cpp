// Chapter 13's benchmark: training steps of an MoE model (DeepSeek-V3-shaped: MLA, 16 routed
// experts of which 2 per token, one shared) with the experts split over every rank (ep = the
// world size, dp = ep), under three balancing settings: none, the Switch auxiliary loss
// (α = 0.01) and DeepSeek-V3's bias update (γ = 0.001, 0.01 here: the run is short).
//
//   OMP_NUM_THREADS=2 build/bin/bench_ep_throughput        (ep 1: one process, every expert)
//   mpirun -np 2 -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=passive build/bin/bench_ep_throughput
//   benchmarks/run_ep_throughput.sh build                  (ep 1, 2 and 4 on the same batches)
//
// Figures: the median step (slowest rank) of the last --window steps, the time the ranks spent
// blocked in the all-to-alls per step, and the load imbalance over those steps: the tokens the
// most loaded expert-parallel rank received over the mean (1 = balanced; the ranks' loads are
// sums of their experts' counts, summed over every data-parallel rank), and the same for
// experts. With ep = 1 the rank imbalance is that of the ranks the experts would be split over
// at ep 4, so the three runs report the same measure.

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "03_transformer/data.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "13_expert_parallel/expert_parallel.h"
#include "fivefold/cli.h"
#include "fivefold/comm_stats.h"
#include "fivefold/error.h"
#include "fivefold/log.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch03;

namespace {

ModelConfig moe_config(int64_t d_model, double aux, double bias) {
  ModelConfig c;
  c.d_model = d_model;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.d_ff = 2 * d_model;
  c.rope_theta = 10000;
  c.extensions = {{"q_lora_rank", d_model / 2},
                  {"kv_lora_rank", d_model / 4},
                  {"qk_nope_head_dim", d_model / 8},
                  {"qk_rope_head_dim", d_model / 16},
                  {"v_head_dim", d_model / 8},
                  {"n_routed_experts", 16},
                  {"num_experts_per_tok", 2},
                  {"n_shared_experts", 1},
                  {"moe_intermediate_size", d_model},
                  {"n_group", 1},
                  {"topk_group", 1},
                  {"first_k_dense_replace", 0},
                  {"aux_loss_alpha", aux},
                  {"fivefold_bias_update_speed", bias}};
  return c;
}

struct Result {
  double step_seconds = 0;     // median of the window, slowest rank
  double blocked_seconds = 0;  // in the all-to-alls per step, slowest rank
  double rank_imbalance = 0;   // max / mean tokens per ep rank (groups of 16/ep_ref experts)
  double expert_imbalance = 0;
  double loss = 0;  // the last step's
};

Result run(const dist::CommunicatorPtr& world, const ModelConfig& config, const BatchSampler& data,
           int64_t steps, int64_t window, int64_t reference_ep) {
  TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 5;
  t.total_steps = steps;
  const auto group = ch13::make_expert_parallel(world, world->size());
  auto step = ch13::expert_parallel_step(group, 0)(ch07::make_model(config), t);
  std::vector<double> times;
  std::vector<double> ranks, experts;
  Result r;
  for (int64_t s = 0; s < steps; ++s) {
    world->barrier();
    if (s == steps - window) dist::reset_comm_stats();
    Timer timer;
    const auto result = step->step({data.batch(s, world->rank(), world->size())}, s);
    auto seconds = torch::tensor({timer.seconds()}, torch::kDouble);
    world->all_reduce(seconds, dist::ReduceOp::Max);
    const auto load = ch07::after_step(step->model(), world.get());  // summed over every rank
    if (s < steps - window) continue;
    times.push_back(seconds.item<double>());
    r.loss = result.loss;
    for (const auto& layer : load["moe_load"]) {
      const auto counts = torch::tensor(layer.get<std::vector<int64_t>>(), torch::kDouble);
      const auto per_rank = counts.reshape({reference_ep, -1}).sum(1);
      ranks.push_back((per_rank.max() / per_rank.mean()).item<double>());
      experts.push_back((counts.max() / counts.mean()).item<double>());
    }
  }
  auto blocked = torch::tensor(
      {dist::comm_counts(group.ep->name(), dist::Op::AllToAll).blocked_seconds /
       static_cast<double>(window)},
      torch::kDouble);
  world->all_reduce(blocked, dist::ReduceOp::Max);
  r.step_seconds = median(times);
  r.blocked_seconds = blocked.item<double>();
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  r.rank_imbalance = mean(ranks);
  r.expert_imbalance = mean(experts);
  return r;
}

int run_benchmark(int argc, char** argv) {
  {
    ArgParser args("bench_ep_throughput",
                   "Training steps of an MoE model with its experts split over every rank "
                   "(ep = world size): step time, all-to-all waits and load imbalance under no "
                   "balancing, the auxiliary loss and the bias update.");
    args.option("d-model", "128", "hidden size (the experts' width too)");
    args.option("batch", "8", "sequences per step, over all ranks");
    args.option("seq", "128", "tokens per sequence");
    args.option("steps", "60", "steps per setting");
    args.option("window", "20", "the last steps, over which the figures are taken");
    if (!args.parse(argc, argv)) return 0;
    Runtime runtime;
    auto world = runtime.world();
    const int64_t steps = args.integer("steps"), window = args.integer("window");
    FIVEFOLD_CHECK(window >= 1 && window <= steps, "--window must be in 1..--steps");
    FIVEFOLD_CHECK(16 % world->size() == 0 && args.integer("batch") % world->size() == 0,
                   "bench_ep_throughput: the world size must divide the 16 experts and --batch");
    const TokenDataset tokens(
        ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 4000)));
    const BatchSampler data(tokens, args.integer("seq"), args.integer("batch"), 1);
    const int64_t d = args.integer("d-model");
    struct Setting {
      const char* name;
      double aux, bias;
    };
    const Setting settings[] = {{"none", 0, 0}, {"aux loss 0.01", 0.01, 0}, {"bias 0.01", 0, 0.01}};
    log0() << "ep " << world->size() << " (dp " << world->size() << "), d_model " << d
           << ", 16 experts (2 per token), batch " << args.integer("batch") << " x "
           << args.integer("seq") << ", figures over the last " << window << " of " << steps
           << " steps";
    log0() << "| ep | balancing | step | all-to-all waits / step | max/mean per rank (of 4) | "
              "max/mean per expert | loss |";
    for (const auto& s : settings) {
      const auto r = run(world, moe_config(d, s.aux, s.bias), data, steps, window, 4);
      char line[256];
      std::snprintf(line, sizeof line, "| %d | %s | %.1f ms | %.1f ms | %.3f | %.3f | %.3f |",
                    world->size(), s.name, 1e3 * r.step_seconds, 1e3 * r.blocked_seconds,
                    r.rank_imbalance, r.expert_imbalance, r.loss);
      log0() << line;
    }
    return 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_ep_throughput", [&] { return run_benchmark(argc, argv); });
}
