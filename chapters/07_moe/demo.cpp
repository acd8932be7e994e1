// Chapter 07 demo: parameters against active parameters (DeepSeek-V3 and a small model), and the
// expert load over training without balancing, with the Switch auxiliary loss, and with
// DeepSeek-V3's bias update.
//
//   ./build/bin/ch07_moe_demo [--steps 300]

#include <cstdio>
#include <string>

#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "fivefold/cli.h"
#include "fivefold/runtime.h"
#include "runtime/run.h"

using namespace fivefold;
using namespace fivefold::ch03;
using namespace fivefold::runtime;

namespace {
// d_model 64, 4 layers (the first dense), MLA, 16 experts of width 64 in 4 groups, 2 per token
// from 2 groups, one shared expert.
ModelConfig small(double aux_alpha, double gamma) {
  ModelConfig c;
  c.d_model = 64;
  c.n_layers = 4;
  c.n_heads = c.n_kv_heads = 4;
  c.d_ff = 192;
  c.rope_theta = 10000;
  c.extensions = {{"q_lora_rank", nullptr},
                  {"kv_lora_rank", 32},
                  {"qk_nope_head_dim", 16},
                  {"qk_rope_head_dim", 8},
                  {"v_head_dim", 16},
                  {"n_routed_experts", 16},
                  {"num_experts_per_tok", 2},
                  {"n_shared_experts", 1},
                  {"moe_intermediate_size", 64},
                  {"n_group", 4},
                  {"topk_group", 2},
                  {"first_k_dense_replace", 1},
                  {"routed_scaling_factor", 2.5},
                  {"aux_loss_alpha", aux_alpha},
                  {"fivefold_bias_update_speed", gamma}};
  return c;
}

// One row of '#' per expert, scaled to the largest count.
void histogram(const nlohmann::json& counts) {
  int64_t most = 1;
  for (const auto& n : counts) most = std::max(most, n.get<int64_t>());
  for (size_t j = 0; j < counts.size(); ++j) {
    const int64_t n = counts[j].get<int64_t>();
    std::printf("      expert %2zu %5lld %s\n", j, static_cast<long long>(n),
                std::string(static_cast<size_t>(40 * n / most), '#').c_str());
  }
}
}  // namespace

int main(int argc, char** argv) {
  ArgParser args("ch07_moe_demo",
                 "Active against total parameters, and the expert load over training without "
                 "and with balancing.");
  args.option("steps", "300", "training steps for each run");
  try {
    if (!args.parse(argc, argv)) return 0;
    Runtime runtime;

    // 1. Parameters buy capacity, active parameters cost FLOPs (6 per active parameter a token).
    const auto v3 = ch07::deepseek_v3_config();
    std::printf("%-20s %16s %16s %8s %18s\n", "model", "parameters", "active", "share",
                "6·active / token");
    for (const auto& [name, config] : {std::pair<const char*, ModelConfig>{"DeepSeek-V3", v3},
                                       {"this demo's model", small(0, 0)}}) {
      const auto p = ch07::count_parameters(config);
      std::printf("%-20s %16lld %16lld %7.1f%% %18.4g\n", name, static_cast<long long>(p.total),
                  static_cast<long long>(p.active), 100.0 * p.active / p.total, 6.0 * p.active);
    }

    // 2. The load over training.
    const int64_t steps = args.integer("steps");
    struct Variant {
      const char* name;
      double alpha, gamma;
    };
    for (const Variant& v :
         {Variant{"no balancing", 0, 0}, Variant{"Switch auxiliary loss, alpha 0.01", 0.01, 0},
          Variant{"bias update (aux-loss-free), gamma 0.01", 0, 0.01}}) {
      std::printf("\n%s: max/mean load of the MoE layers, every %lld steps\n", v.name,
                  static_cast<long long>(steps / 10));
      RunConfig c;
      c.model = small(v.alpha, v.gamma);
      c.build_model = ch07::make_model;
      nlohmann::json last;
      std::string series;
      int64_t step = 0;
      c.after_step = [&](Transformer& model) {
        last = ch07::after_step(model);
        if (++step % (steps / 10) == 0) {
          char cell[16];
          std::snprintf(cell, sizeof(cell), " %.2f", last["moe_max_load"].get<double>());
          series += cell;
        }
        return last;
      };
      c.steps = c.train.total_steps = steps;
      c.train.warmup_steps = std::min<int64_t>(c.train.warmup_steps, steps / 10);
      c.eval_every = 0;
      c.progress = false;
      const RunResult r = run_training(c);
      std::printf("   %s\n   held-out loss %.3f; last step's load of layer 1 (tokens x 2):\n",
                  series.c_str(), r.eval.loss);
      histogram(last["moe_load"][0]);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ch07_moe_demo: error: %s\n", e.what());
    return 1;
  }
}
