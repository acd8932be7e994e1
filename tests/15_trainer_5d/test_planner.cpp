// Chapter 15's planner: its pieces against the chapters' exact counts, the groups' links, the
// pipeline's idle time, the search against the trainer's own checks, and the cluster files.

#include <array>
#include <filesystem>
#include <fstream>
#include <set>

#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "14_memory/recompute.h"
#include "15_trainer_5d/planner.h"
#include "15_trainer_5d/predict.h"
#include "fivefold/error.h"
#include "fixtures.h"
#include "runtime/cluster.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch15;
using fivefold::ch15::testing::sizes;
using fivefold::testing::throws_error_containing;

namespace {

// A Llama of 4 blocks (GQA: 4 query heads, 2 key/value heads) on 64-token rows.
Workload small(int64_t batch = 8, int64_t micro = 1) {
  Workload w;
  w.model.vocab_size = 256;
  w.model.d_model = 64;
  w.model.n_layers = 4;
  w.model.n_heads = 4;
  w.model.n_kv_heads = 2;
  w.model.d_ff = 128;
  w.model.rope_theta = 10000;
  w.seq_len = 64;
  w.batch = batch;
  w.micro_batches = micro;
  return w;
}

// A cluster of `devices`, `per_node` a node, whose links cost nothing unless set.
Cluster cluster(int64_t devices, int64_t per_node = 8) {
  Cluster c;
  c.name = "test";
  c.devices = devices;
  c.devices_per_node = per_node;
  c.memory_bytes = 1e12;
  c.peak_flops_fp32 = c.peak_flops_bf16 = 2e12;
  c.matmul_flops_fp32 = c.matmul_flops_bf16 = 1e12;
  c.intra_node = {0, 1e30};
  c.inter_node = {0, 1e30};
  return c;
}

StepEstimate estimate(const Workload& w, Layout layout, const Cluster& c,
                      ch14::Precision precision = ch14::Precision::Fp32) {
  return estimate_step(w, resolve_layout(layout, c.devices, w), c, precision);
}

}  // namespace

// The exercise's contract: F is the forward with what it sends and waits for; B the input's
// gradient, with attention's backward, what is recomputed and the backward's communication; W
// the weights' gradient alone.
TEST(Planner, PricesAMicroBatchFromItsParts) {
  StageTimes t;
  t.products = 1;
  t.attention_forward = 2;
  t.attention_backward = 4;
  t.recomputed = 8;
  t.tp = 16;
  t.tp_recomputed = 32;
  t.cp_forward = 64;
  t.cp_backward = 128;
  t.pp_send = 256;
  t.ep_forward = 512;
  t.ep_backward = 1024;
  t.ep_recomputed = 2048;
  const ch11::UnitCosts costs = micro_batch_costs(t);
  EXPECT_DOUBLE_EQ(costs.forward, 1 + 2 + 16 + 64 + 256 + 512)
      << "F: products, attention, tp, cp, ep, pp";
  EXPECT_DOUBLE_EQ(costs.backward_input, 1 + 4 + 8 + 16 + 32 + 128 + 256 + 1024 + 2048)
      << "B: products, attention's backward, the recomputed forward, tp twice over, cp, pp, ep "
         "and ep's recomputed forward";
  EXPECT_DOUBLE_EQ(costs.backward_weight, 1) << "W: the weights' products alone";
  EXPECT_TRUE(costs.scale.empty());
}

// The products and the head are chapter 15's exact counts (predicted_flops, which the trainer's
// tests equal to chapter 02's FlopCounter), one device and each rank of tp 2, with and without
// full recomputation (8 FLOPs a weight and token instead of 6). The attention is a causal
// kernel's: half the square, where the exact count of a per-query causal kernel is s(s + 1)/2 of
// s² (tile 1): within (s + 1)/s.
TEST(Planner, ComputesWhatTheChaptersCount) {
  for (auto mode : {ch14::Recompute::None, ch14::Recompute::Full}) {
    for (int64_t tp : {1, 2}) {
      Workload w = small(8, 2);
      w.attention_tile = 1;
      w.recompute = {mode, 1, 0};
      const Layout layout = resolve_layout(sizes(0, tp, 1, 1), tp, w);
      const StepEstimate e = estimate_step(w, layout, cluster(tp), ch14::Precision::Fp32);
      for (int64_t rank = 0; rank < tp; ++rank) {
        const StepFlops exact = predicted_flops(layout, w, rank, rank_parameters(layout, w, rank));
        EXPECT_EQ(e.flops.matrices, exact.matrices) << "tp " << tp << " rank " << rank;
        EXPECT_EQ(e.flops.head, exact.head) << "tp " << tp << " rank " << rank;
        const double s = static_cast<double>(w.seq_len);
        EXPECT_NEAR(static_cast<double>(e.flops.attention) * (s + 1) / s,
                    static_cast<double>(exact.attention), 0.5)
            << "tp " << tp << " rank " << rank;
      }
      // With links that cost nothing, the step is its compute: every FLOP at the matmul rate.
      EXPECT_DOUBLE_EQ(e.step, e.compute);
      EXPECT_NEAR(e.compute * 1e12, static_cast<double>(e.flops.total()), 1e-3 * e.flops.total());
    }
  }
}

// The attention kernel's own rate, where the cluster gives one, prices attention's FLOPs (forward,
// backward and what selective recomputation runs again) and nothing else.
TEST(Planner, PricesAttentionAtItsKernelsRate) {
  for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective}) {
    Workload w = small(8, 2);
    w.recompute = {mode, 1, 0};
    Cluster slow_attention = cluster(1);
    slow_attention.attention_flops_fp32 = slow_attention.matmul_flops_fp32 / 4;
    const StepEstimate same = estimate(w, sizes(1, 1, 1, 1), cluster(1));
    const StepEstimate slow = estimate(w, sizes(1, 1, 1, 1), slow_attention);
    const double products = static_cast<double>(same.flops.matrices + same.flops.head) / 1e12;
    const double attention = static_cast<double>(same.flops.attention) / 1e12;
    EXPECT_NEAR(same.compute, products + attention, 1e-3 * same.compute);
    EXPECT_NEAR(slow.compute, products + 4 * attention, 1e-3 * slow.compute)
        << ch14::to_string(mode);
    EXPECT_EQ(slow.flops.total(), same.flops.total());
  }
}

namespace {

// Records each product `linear` multiplies: a [m, k] · b [k, n] as {m, k, n}.
class RecordingKernel : public ch03::MatmulKernel {
 public:
  torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const override {
    products.push_back({a.size(0), a.size(1), b.size(1)});
    return a.mm(b);
  }
  mutable std::vector<std::array<int64_t, 3>> products;
};

}  // namespace

// A product's cost besides its FLOPs (Cluster::product_latency_fp32, memory_bandwidth) is priced
// for each product a real step multiplies: a training step of the model on one device, without
// and with full recomputation, records them (a kernel in chapter 03's slot), Llama's and
// DeepSeek's in miniature. With FLOPs made free, the compute is one latency a product; with a
// memory slow enough for every product to be bound by it, each product's operand bytes at that
// bandwidth.
TEST(Planner, PricesEachProductTheStepMultiplies) {
  for (bool deepseek : {false, true})
    for (auto mode : {ch14::Recompute::None, ch14::Recompute::Full}) {
      SCOPED_TRACE(std::string(deepseek ? "DeepSeek, " : "Llama, ") + ch14::to_string(mode));
      Workload w = small(4, 1);
      if (deepseek) w.model = ch10::testing::deepseek_config();
      w.recompute = {mode, 1, 0};
      auto kernel = std::make_shared<RecordingKernel>();
      const auto previous = ch03::set_matmul_kernel(kernel);
      torch::manual_seed(0);
      auto model = ch07::make_model(w.model);
      ch14::apply_recompute(model, w.recompute);
      const auto tokens = torch::randint(w.model.vocab_size, {w.batch, w.seq_len + 1});
      const ch03::Batch batch(tokens.narrow(1, 0, w.seq_len), tokens.narrow(1, 1, w.seq_len));
      ch03::loss_of(model, batch).backward();
      ch03::set_matmul_kernel(previous);
      // One product multiplies outside chapter 03's slot (torch::matmul): each MoE block's
      // router's, forward and backward, which full recomputation runs forward again. (The head's
      // three go through the slot.)
      const int64_t tokens_in = w.batch * w.seq_len, d = w.model.d_model;
      std::vector<std::array<int64_t, 3>> products = kernel->products;
      if (deepseek) {
        const auto moe = ch07::MoeConfig::from_json(w.model.extensions);
        for (int64_t layer = 0; layer < w.model.n_layers; ++layer)
          for (int i = 0; moe.is_moe_layer(layer) && i < (mode == ch14::Recompute::Full ? 4 : 3);
               ++i)
            products.push_back({tokens_in, d, moe.n_routed_experts});
      }
      double bytes = 0;
      for (const auto& [m, k, n] : products) bytes += 4.0 * static_cast<double>(m * k + k * n + m * n);

      Cluster free = cluster(1);  // FLOPs cost nothing
      free.matmul_flops_fp32 = free.attention_flops_fp32 = 1e30;
      Cluster latency = free;
      latency.product_latency_fp32 = 1e-3;
      const StepEstimate each = estimate(w, sizes(1, 1, 1, 1), latency);
      EXPECT_NEAR(each.compute / 1e-3, static_cast<double>(products.size()), 1e-6);
      Cluster slow_memory = free;
      slow_memory.memory_bandwidth = 1;  // a byte a second
      const StepEstimate streamed = estimate(w, sizes(1, 1, 1, 1), slow_memory);
      EXPECT_NEAR(streamed.compute, bytes, 1e-9 * bytes);
      // At the FLOPs' rate they cost nothing more: the products are not thin.
      Cluster fast_memory = cluster(1);
      fast_memory.memory_bandwidth = 1e30;
      EXPECT_DOUBLE_EQ(estimate(w, sizes(1, 1, 1, 1), fast_memory).compute,
                       estimate(w, sizes(1, 1, 1, 1), cluster(1)).compute);
    }
}

// The state is chapter 09's ZeRO formula over the rank that holds the most, as chapter 15's
// predict counts the real model's parts (predicted_state_bytes, equal to what the trainer's ranks
// measure): dp 2 x pp 2, each ZeRO stage; bf16 keeps 2 + 2 + 12 bytes a parameter.
TEST(Planner, KeepsChapter09sState) {
  const Workload w = small(8, 2);
  for (int zero = 0; zero <= 3; ++zero) {
    const Layout layout = resolve_layout(sizes(2, 1, 2, 1, 1, zero), 4, w);
    int64_t most = 0, most_bf16 = 0, psi = 0;
    for (int64_t rank = 0; rank < 4; ++rank) {
      const HeldParameters held = rank_parameters(layout, w, rank);
      most = std::max(most, predicted_state_bytes(layout, held).total());
      most_bf16 = std::max(
          most_bf16, predicted_state_bytes(layout, held, ch14::Precision::Bf16).total());
      psi = std::max(psi, held.elements);
    }
    if (zero < 3) {  // ZeRO-3's exact count pads each unit to the ranks; the planner does not
      EXPECT_EQ(estimate(w, layout, cluster(4)).state_bytes, most) << "ZeRO-" << zero;
      EXPECT_EQ(estimate(w, layout, cluster(4), ch14::Precision::Bf16).state_bytes, most_bf16)
          << "ZeRO-" << zero << " with master weights";
    }
    const auto fp32 = ch09::zero_memory_formula(psi, 2, zero);
    EXPECT_EQ(estimate(w, layout, cluster(4)).state_bytes, fp32.total()) << "ZeRO-" << zero;
    EXPECT_EQ(estimate(w, layout, cluster(4), ch14::Precision::Bf16).state_bytes,
              fp32.parameters / 2 + fp32.gradients / 2 + fp32.optimizer * 3 / 2)
        << "ZeRO-" << zero;
  }
}

// DeepSeek-V3 in miniature (chapter 06's MLA, chapter 07's experts after a dense first block):
// products, head and state are the trainer's exact counts of the ranks' real model parts
// (predicted_flops, predicted_state_bytes) with experts over ep, with and without a pipeline;
// none, selective and full recomputation; with tp (chapter 10's split of MLA: heads split, the
// down-projections, router and routed experts whole; with and without sequence parallelism), cp
// and both; each group's communication is exposed on a link that costs; the search tries them all.
TEST(Planner, PricesMlaAndExpertsAsTheTrainerCounts) {
  Workload w = small(8, 2);
  w.attention_tile = 1;
  w.model = ch10::testing::deepseek_config();  // a dense block, then MoE blocks
  w.model.n_layers = 4;
  struct Case {
    int64_t tp, pp, cp, ep;
    bool sp;
  };
  const Case cases[] = {{1, 1, 1, 1, false}, {1, 1, 1, 2, false}, {1, 1, 1, 4, false},
                        {1, 2, 1, 2, false}, {2, 1, 1, 1, false}, {2, 1, 1, 1, true},
                        {2, 1, 1, 2, true},  {4, 1, 1, 1, true},  {2, 2, 1, 1, false},
                        {1, 1, 2, 2, false}, {2, 1, 2, 1, true},  {1, 2, 2, 1, false}};
  for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective, ch14::Recompute::Full})
    for (const Case& k : cases) {
      w.recompute = {mode, 1, 0};
      SCOPED_TRACE("tp " + std::to_string(k.tp) + (k.sp ? " SP" : "") + ", pp " +
                   std::to_string(k.pp) + ", cp " + std::to_string(k.cp) + ", ep " +
                   std::to_string(k.ep) + ", " + ch14::to_string(mode));
      const int64_t dp = 4 / (k.tp * k.pp * k.cp);
      for (int zero = 0; zero <= (dp * k.cp > 1 ? 2 : 0); ++zero) {
        Layout asked = sizes(dp, k.tp, k.pp, k.cp, k.ep, zero);
        asked.sequence_parallel = k.sp;
        const Layout layout = resolve_layout(asked, 4, w);
        const StepEstimate e = estimate_step(w, layout, cluster(4), ch14::Precision::Fp32);
        int64_t most = 0;
        for (int64_t rank = 0; rank < 4; ++rank) {
          const HeldParameters held = rank_parameters(layout, w, rank);
          most = std::max(most, predicted_state_bytes(layout, held).total());
          // The planner's rank: the last stage's, tp rank 0 (the largest shares), cp rank 0.
          const Layout::Place at = layout.place(rank);
          if (at.pp != k.pp - 1 || at.tp != 0 || at.cp != 0 || zero > 0) continue;
          const StepFlops exact = predicted_flops(layout, w, rank, held);
          EXPECT_EQ(e.flops.matrices, exact.matrices) << "rank " << rank;
          EXPECT_EQ(e.flops.head, exact.head) << "rank " << rank;
          if (k.cp > 1) continue;  // chapter 12's kernel: its own count of the scores
          const double s = static_cast<double>(w.seq_len);
          EXPECT_NEAR(static_cast<double>(e.flops.attention) * (s + 1) / s,
                      static_cast<double>(exact.attention), 0.5);
        }
        EXPECT_EQ(e.state_bytes, most) << "ZeRO-" << zero;
        EXPECT_LT(e.exposed.count("ep") ? e.exposed.at("ep") : 0.0, 1e-20);  // free links
      }
      Cluster costly = cluster(4);
      costly.intra_node = {1e-6, 1e9};
      Layout asked = sizes(dp, k.tp, k.pp, k.cp, k.ep, 0);
      asked.sequence_parallel = k.sp;
      const StepEstimate priced =
          estimate_step(w, resolve_layout(asked, 4, w), costly, ch14::Precision::Fp32);
      for (const auto& [group, n] :
           {std::pair{"ep", k.ep}, std::pair{"tp", k.tp}, std::pair{"cp", k.cp}})
        if (n > 1) EXPECT_GT(priced.exposed.at(group), 0) << group;
    }
  w.recompute = {ch14::Recompute::None, 1, 0};
  Workload gqa_experts = w;  // chapter 07's experts under chapter 03's attention: not derived
  gqa_experts.model.extensions.erase("kv_lora_rank");
  EXPECT_TRUE(throws_error_containing(
      [&] { estimate(gqa_experts, sizes(4, 1, 1, 1), cluster(4)); }, "experts without MLA"));
  // The search tries every ep, tp, cp and recomputation.
  SearchLimits everything;
  everything.keep = 100000;
  const Search found = search_layouts(w, cluster(4), ch14::Precision::Fp32, everything);
  std::set<int64_t> eps, tps, cps;
  std::set<ch14::Recompute> modes;
  for (const Candidate& k : found.best) {
    tps.insert(k.layout.tp);
    cps.insert(k.layout.cp);
    modes.insert(k.recompute);
    eps.insert(k.layout.ep);
  }
  EXPECT_EQ(eps, (std::set<int64_t>{1, 2, 4}));
  EXPECT_EQ(tps, (std::set<int64_t>{1, 2, 4}));
  EXPECT_EQ(cps, (std::set<int64_t>{1, 2, 4}));
  EXPECT_EQ(modes.size(), 3u);
}

// A group inside a node crosses the node's link, one that spans nodes the slower link: with 2
// devices a node, tp 2 is on the node and tp 4 is not; cp's group (tp apart) leaves the node
// sooner.
TEST(Planner, PutsEachGroupOnItsLink) {
  const Workload w = small(8);
  Cluster fast = cluster(8, 2), slow = cluster(8, 2);
  fast.intra_node = slow.intra_node = {1e-6, 1e11};
  fast.inter_node = {1e-6, 1e11};
  slow.inter_node = {1e-5, 1e9};
  auto tp_time = [&](const Cluster& c, int64_t tp) {
    return estimate(w, sizes(0, tp, 1, 1), c).exposed.at("tp");
  };
  EXPECT_GT(tp_time(fast, 2), 0);
  EXPECT_DOUBLE_EQ(tp_time(fast, 2), tp_time(slow, 2));
  EXPECT_GT(tp_time(slow, 4), 10 * tp_time(fast, 4));
  // The data-parallel reduction of dp 4 x tp 2 spans 8 ranks: the nodes' link.
  Cluster no_overlap = slow;
  no_overlap.matmul_flops_fp32 = 1e30;  // nothing to hide behind
  EXPECT_GT(estimate(w, sizes(4, 2, 1, 1), no_overlap).exposed.at("dp"),
            estimate(w, sizes(4, 2, 1, 1), cluster(8, 2)).exposed.at("dp"));
}

// The pipeline's idle time is chapter 11's simulator on the modelled costs: with links that cost
// nothing and stages of equal work (4 blocks on 2 stages, the head's cost made negligible), 1F1B
// idles (p − 1)/(m + p − 1) of the step.
TEST(Planner, IdlesAsChapter11Simulates) {
  Workload w = small(8, 4);
  w.model.vocab_size = 1;  // the head's products vanish: equal stages
  const StepEstimate e = estimate(w, sizes(1, 1, 2, 1), cluster(2));
  EXPECT_NEAR(e.bubble / e.step, 1.0 / (4 + 1), 1e-3);
  EXPECT_NEAR(e.step, e.compute + e.bubble, 1e-12);
  // Recomputation makes B longer: the idle share stays (p − 1)/(m + p − 1), the step grows.
  w.recompute = {ch14::Recompute::Full, 1, 0};
  const StepEstimate again = estimate(w, sizes(1, 1, 2, 1), cluster(2));
  EXPECT_NEAR(again.bubble / again.step, 1.0 / 5, 1e-3);
  EXPECT_NEAR(static_cast<double>(again.flops.matrices) / e.flops.matrices, 4.0 / 3, 1e-9);
  EXPECT_NEAR((again.compute - e.compute) * 1e12,
              static_cast<double>(again.flops.total() - e.flops.total()),
              1e-3 * static_cast<double>(again.flops.total() - e.flops.total()));  // the head: 1e-3
}

// Every layout the search counts is one the trainer accepts and every layout the trainer accepts
// in the search's domain is counted: brute force over a wider one (every schedule with every
// v up to 4 at every pp, every m up to 8), each through resolve_layout.
TEST(Planner, SearchesEveryLayoutTheTrainerAccepts) {
  const Workload w = small(8);
  const Cluster c = cluster(8);
  int64_t accepted = 0;
  for (int64_t tp : {1, 2, 4, 8})
    for (int64_t pp : {1, 2, 4, 8})
      for (int64_t cp : {1, 2, 4, 8}) {
        if (8 % (tp * pp * cp) != 0) continue;
        const int64_t dp = 8 / (tp * pp * cp);
        for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb"})
          for (int64_t v = 1; v <= 4; ++v)
            for (int64_t m = 1; m <= 8; ++m)
              for (int zero = 0; zero <= 3; ++zero)
                for (bool sp : {false, true})
                  for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
                    // The search's domain: one schedule without pp, interleaved with v >= 2
                    // (v = 1 is 1F1B), ZeRO 0 without replicas, the ring without cp.
                    if ((pp == 1 && (schedule != "1f1b" || v > 1)) ||
                        (schedule == "interleaved" && v == 1) || (dp * cp == 1 && zero > 0) ||
                        (cp == 1 && attention != ch12::CpAttention::Ring))
                      continue;
                    Layout l = sizes(dp, tp, pp, cp, 1, zero);
                    l.schedule = schedule;
                    l.virtual_stages = v;
                    l.sequence_parallel = sp;
                    l.cp_attention = attention;
                    Workload mw = w;
                    mw.micro_batches = m;
                    try {
                      resolve_layout(l, 8, mw);
                      accepted += 3;  // none, selective, full
                    } catch (const fivefold::Error&) {
                    }
                  }
      }
  SearchLimits everything;
  everything.keep = 1000000;
  const Search found = search_layouts(w, c, ch14::Precision::Fp32, everything);
  EXPECT_GT(accepted, 100);
  EXPECT_EQ(found.valid, accepted);
  EXPECT_EQ(found.fit, found.valid);  // a terabyte each
  ASSERT_EQ(static_cast<int64_t>(found.best.size()), found.fit);
  std::set<std::string> seen;
  for (size_t i = 0; i < found.best.size(); ++i) {
    const Candidate& k = found.best[i];
    Workload mw = w;
    mw.micro_batches = k.micro_batches;
    EXPECT_NO_THROW(resolve_layout(k.layout, 8, mw)) << k.layout.describe();
    if (i > 0) EXPECT_LE(found.best[i - 1].estimate.step, k.estimate.step);
    seen.insert(k.layout.describe() + " m " + std::to_string(k.micro_batches) + " " +
                ch14::to_string(k.recompute));
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), found.fit);  // no layout twice

  // A device too small drops what does not fit; the best kept are the fastest that fit; fixing
  // sizes keeps only those.
  Cluster tight = c;
  tight.memory_bytes = 2.5e6;
  SearchLimits three;
  three.keep = 3;
  const Search fitting = search_layouts(w, tight, ch14::Precision::Fp32, three);
  EXPECT_GT(fitting.dropped, 0);
  EXPECT_EQ(fitting.fit + fitting.dropped, found.valid);
  ASSERT_EQ(fitting.best.size(), 3u);
  for (const Candidate& k : fitting.best) EXPECT_LE(k.estimate.memory_bytes(), tight.memory_bytes);
  SearchLimits tp2 = everything;
  tp2.tp = 2;
  for (const Candidate& k : search_layouts(w, c, ch14::Precision::Fp32, tp2).best)
    EXPECT_EQ(k.layout.tp, 2);
  // Fixing the recomputation keeps a third of the layouts, each with it.
  SearchLimits full = everything;
  full.recompute = ch14::Recompute::Full;
  const Search recomputed = search_layouts(w, c, ch14::Precision::Fp32, full);
  EXPECT_EQ(recomputed.valid * 3, found.valid);
  ASSERT_FALSE(recomputed.best.empty());
  for (const Candidate& k : recomputed.best) EXPECT_EQ(k.recompute, ch14::Recompute::Full);
}

// A long search reports its progress: before each split of the devices (tp, cp, pp) and once at
// the end, the splits done rising to all of them, with the layouts priced so far.
TEST(Planner, ReportsItsProgress) {
  SearchLimits limits;
  std::vector<int64_t> done;
  int64_t total = 0, valid = 0;
  limits.progress = [&](int64_t d, int64_t all, const Search& so_far) {
    done.push_back(d);
    total = all;
    EXPECT_GE(so_far.valid, valid);
    valid = so_far.valid;
  };
  const Search found = search_layouts(small(8), cluster(8), ch14::Precision::Fp32, limits);
  EXPECT_EQ(total, 20);  // (tp, cp, pp) with tp·cp·pp dividing 8
  ASSERT_EQ(done.size(), 21u);
  for (size_t i = 0; i < done.size(); ++i) EXPECT_EQ(done[i], std::min<int64_t>(i, 20));
  EXPECT_EQ(valid, found.valid);
}

// The presets read, and what cluster_toml writes reads back the same; a bad file is refused with
// its name and the key.
TEST(Planner, ReadsClusterFiles) {
  const std::string presets =
      std::string(FIVEFOLD_SOURCE_DIR) + "/chapters/15_trainer_5d/presets/clusters/";
  const Cluster h100 = runtime::read_cluster(presets + "h100-sxm.toml");
  EXPECT_EQ(h100.devices_per_node, 8);
  EXPECT_DOUBLE_EQ(h100.peak_flops_bf16, 989e12);
  EXPECT_DOUBLE_EQ(h100.inter_node.bandwidth, 50e9);
  for (const char* name : {"h800.toml", "a100-80gb.toml", "dev-2-core.toml"})
    EXPECT_NO_THROW(runtime::read_cluster(presets + name)) << name;

  const auto dir = std::filesystem::temp_directory_path() / "fivefold_test_cluster";
  std::filesystem::create_directories(dir);
  const std::string again = (dir / "again.toml").string();
  std::ofstream(again) << runtime::cluster_toml(h100);
  const Cluster back = runtime::read_cluster(again);
  EXPECT_EQ(back.name, h100.name);
  EXPECT_EQ(back.devices, h100.devices);
  EXPECT_DOUBLE_EQ(back.matmul_flops_bf16, h100.matmul_flops_bf16);
  EXPECT_DOUBLE_EQ(back.intra_node.latency, h100.intra_node.latency);
  EXPECT_EQ(back.attention_flops_bf16, 0) << "absent: the products' rate";
  Cluster timed = h100;
  timed.attention_flops_bf16 = 312e12;
  timed.product_latency_fp32 = 12e-6;
  timed.product_latency_bf16 = 9e-6;
  timed.memory_bandwidth = 2.5e12;
  std::ofstream(again) << runtime::cluster_toml(timed);
  const Cluster timed_back = runtime::read_cluster(again);
  EXPECT_DOUBLE_EQ(timed_back.attention_flops_bf16, 312e12);
  EXPECT_DOUBLE_EQ(timed_back.product_latency_fp32, 12e-6);
  EXPECT_DOUBLE_EQ(timed_back.product_latency_bf16, 9e-6);
  EXPECT_DOUBLE_EQ(timed_back.memory_bandwidth, 2.5e12);
  EXPECT_DOUBLE_EQ(h100.memory_bandwidth, 3.35e12) << "HBM3's, from the datasheet";
  const std::string negative = (dir / "negative.toml").string();
  std::ofstream(negative) << runtime::cluster_toml(h100) << "product-latency-us-bf16 = -1\n";
  EXPECT_TRUE(throws_error_containing([&] { runtime::read_cluster(negative); }, "latency"));

  const std::string typo = (dir / "typo.toml").string();
  std::ofstream(typo) << runtime::cluster_toml(h100) << "inter-node-gbs = 3\n";
  EXPECT_TRUE(throws_error_containing([&] { runtime::read_cluster(typo); }, "inter-node-gbs"));
  const std::string missing = (dir / "missing.toml").string();
  std::ofstream(missing) << "name = \"x\"\ndevices = 8\ndevices-per-node = 8\n";
  EXPECT_TRUE(throws_error_containing([&] { runtime::read_cluster(missing); }, "memory-gb"));

  // A collective's own line (what calibrate writes) comes back; half of one is refused.
  Cluster own = h100;
  own.inter_node.by_collective[dist::Op::AllToAll] = {7e-6, 12e9};
  const std::string lines = (dir / "lines.toml").string();
  std::ofstream(lines) << runtime::cluster_toml(own);
  const Cluster read = runtime::read_cluster(lines);
  ASSERT_EQ(read.inter_node.by_collective.size(), 1u);
  EXPECT_DOUBLE_EQ(read.inter_node.by_collective.at(dist::Op::AllToAll).latency, 7e-6);
  EXPECT_DOUBLE_EQ(read.inter_node.by_collective.at(dist::Op::AllToAll).bandwidth, 12e9);
  EXPECT_TRUE(read.intra_node.by_collective.empty());
  const std::string half = (dir / "half.toml").string();
  std::ofstream(half) << runtime::cluster_toml(h100) << "intra-node-all-reduce-gbps = 3\n";
  EXPECT_TRUE(throws_error_containing([&] { runtime::read_cluster(half); },
                                      "intra-node-all-reduce-latency-us"));
  std::filesystem::remove_all(dir);
}

// A collective with a line of its own is priced on it, the others on the link's: a slow
// all-reduce slows tp's f and g and DDP's reduction, not the pipeline's sends; a slow
// send/receive the pipeline alone.
TEST(Planner, PricesEachCollectiveOnItsOwnLine) {
  const Workload w = small(8, 4);
  Cluster base = cluster(4);
  base.intra_node = base.inter_node = {1e-6, 1e10};
  base.matmul_flops_fp32 = 1e30;  // nothing to hide the reduction behind
  Cluster slow_reduce = base, slow_send = base;
  for (Cluster* c : {&slow_reduce, &slow_send})
    for (Link* link : {&c->intra_node, &c->inter_node})
      link->by_collective[c == &slow_reduce ? dist::Op::AllReduce : dist::Op::SendRecv] = {1e-5,
                                                                                           1e8};
  auto exposed = [&](const Cluster& c, const Layout& l, const char* group) {
    return estimate(w, l, c).exposed.at(group);
  };
  const Layout tp = sizes(2, 2, 1, 1), pp = sizes(2, 1, 2, 1);
  EXPECT_GT(exposed(slow_reduce, tp, "tp"), 10 * exposed(base, tp, "tp"));
  EXPECT_GT(exposed(slow_reduce, tp, "dp"), 10 * exposed(base, tp, "dp"));
  EXPECT_DOUBLE_EQ(exposed(slow_reduce, pp, "pp"), exposed(base, pp, "pp"));
  EXPECT_GT(exposed(slow_send, pp, "pp"), 10 * exposed(base, pp, "pp"));
  EXPECT_DOUBLE_EQ(exposed(slow_send, tp, "tp"), exposed(base, tp, "tp"));
  EXPECT_DOUBLE_EQ(base.intra_node.seconds(dist::Op::AllGather, 3, 2e10), 3e-6 + 2);
}
