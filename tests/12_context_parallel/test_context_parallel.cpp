// Chapter 12 under mpirun: ring and all-gather attention, and the training step with context
// parallelism, against one process. Every rank holds different tokens of the same sequences, so a
// kernel that attends only to its own keys, or a step that forgets the ranks' tokens, gives other
// numbers. Shown to fail on purpose (at 2 ranks): the ring without its last hop of the key/value
// gradients fails KernelsEqualFullAttention (dk, dv); a loss weight of 1 for every rank (no
// cp·n_r/n) fails GradientsEqualTheSingleDevice with the contiguous layout of 13 tokens.

#include "../02_flops_6np/shapes.h"
#include "../10_tensor_parallel/fixtures.h"
#include "02_flops_6np/flops.h"
#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "12_context_parallel/context_parallel.h"
#include "12_context_parallel/plan.h"
#include "fivefold/comm_stats.h"
#include "fivefold/memory.h"

#include <map>
#include <numeric>
#include "fivefold/mesh.h"
#include "fivefold/seed.h"
#include "parity.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch12;
using fivefold::testing::clipping;
using fivefold::testing::no_clipping;
using fivefold::testing::split;
using fivefold::testing::world;

namespace {

torch::Tensor draw(std::vector<int64_t> shape, const char* name) {
  return torch::randn(shape, generator_for(12, name));  // the same on every rank
}

const char* layout_name(CpLayout l) { return l == CpLayout::Zigzag ? "zigzag" : "contiguous"; }

// 4 rows of 16 tokens (zig-zag over 2 and 4 ranks) or 13 (contiguous: uneven parts).
const ch03::BatchSampler& batches(int64_t seq) {
  static const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  static const ch03::BatchSampler sixteen(data, 16, 4, 1), thirteen(data, 13, 4, 1);
  return seq == 16 ? sixteen : thirteen;
}

struct Layout {
  int pp = 1, dp = 1, cp = 1, tp = 1;
  CpLayout split = CpLayout::Zigzag;
  CpAttention attention = CpAttention::Ring;
  int zero = 0;
};

std::string describe(const Layout& l) {
  return "pp " + std::to_string(l.pp) + " dp " + std::to_string(l.dp) + " cp " +
         std::to_string(l.cp) + " tp " + std::to_string(l.tp) + " " + layout_name(l.split) +
         (l.attention == CpAttention::Ring ? " ring" : " allgather") + " ZeRO " +
         std::to_string(l.zero);
}

struct Built {
  ch03::StepFactory make;
  dist::CommunicatorPtr dp;  // the batches' rows are cut over dp; the tokens over cp
};

Built build(const Layout& l) {
  dist::DeviceMesh mesh(world(), {{"pp", l.pp}, {"dp", l.dp}, {"cp", l.cp}, {"tp", l.tp}});
  const auto data = mesh.comm("dp+cp");
  ch10::TensorParallelPtr tp;
  if (l.tp > 1) tp = std::make_shared<ch10::TensorParallel>(mesh.comm("tp"), false);
  ch03::StepFactory inner;
  if (l.pp > 1) {
    ch11::PipelineLayout layout;
    layout.links = std::make_shared<ch11::PipelineLinks>(mesh.comm("pp"));
    layout.dp = data;
    layout.model_parallel = mesh.comm("pp+tp");
    layout.tp = tp;
    layout.zero = l.zero;
    layout.schedule = "1f1b";
    inner = ch11::pipeline_parallel_step(layout, ch07::make_model);
  } else if (l.tp > 1) {
    inner = ch10::tensor_parallel_step(tp, data, l.zero, ch07::make_model);
  } else {
    inner = ch09::data_parallel_step(data, l.zero);
  }
  return {context_parallel_step(inner, {mesh.comm("cp"), l.split, l.attention}), mesh.comm("dp")};
}

io::TensorMap gradients(ch03::TrainingStep& step) {
  auto& inner = dynamic_cast<ContextParallelStep&>(step).inner();
  if (auto* p = dynamic_cast<ch11::PipelineParallelStep*>(&inner)) return p->gradients();
  if (auto* t = dynamic_cast<ch10::TensorParallelStep*>(&inner)) return t->gradients();
  return dynamic_cast<ch09::DataParallelStep&>(inner).gradients();
}

std::vector<Layout> layouts() {
  const int n = world()->size();
  std::vector<Layout> out;
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous})
    for (auto attention : {CpAttention::Ring, CpAttention::AllGather})
      out.push_back({1, 1, n, 1, split, attention});
  if (n == 4) {
    out.push_back({1, 2, 2, 1, CpLayout::Zigzag, CpAttention::Ring});
    out.push_back({1, 1, 2, 2, CpLayout::Zigzag, CpAttention::Ring});
    out.push_back({1, 1, 2, 2, CpLayout::Contiguous, CpAttention::AllGather});
    out.push_back({2, 1, 2, 1, CpLayout::Zigzag, CpAttention::Ring});
  }
  return out;
}

}  // namespace

TEST(ContextParallel, ShardsCoverTheSequence) {
  // Every position exactly once over the ranks; zig-zag pairs chunk r with chunk 2cp − 1 − r.
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    for (int64_t cp : {1, 2, 3, 4}) {
      const int64_t seq = split == CpLayout::Zigzag ? 8 * cp : 13;
      std::vector<torch::Tensor> parts;
      for (int64_t r = 0; r < cp; ++r) parts.push_back(shard_positions(seq, cp, r, split));
      auto all = std::get<0>(torch::cat(parts).sort());
      EXPECT_TRUE(torch::equal(all, ch03::position_range(0, seq))) << layout_name(split) << cp;
    }
  }
  EXPECT_TRUE(torch::equal(shard_positions(8, 2, 0, CpLayout::Zigzag),
                           torch::tensor({0, 1, 6, 7}, torch::kLong)));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [] { check_context_parallel(14, 4, CpLayout::Zigzag); }, "2 x cp = 8 equal chunks"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [] { check_context_parallel(3, 4, CpLayout::Contiguous); }, "fewer tokens than ranks"));
  EXPECT_TRUE(fivefold::testing::throws_error_containing([] { parse_cp_layout("striped"); },
                                                         "choose contiguous or zigzag"));
}

TEST(ContextParallel, KernelsEqualFullAttention) {
  auto cp = world();
  const int n = cp->size();
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    for (auto attention : {CpAttention::Ring, CpAttention::AllGather}) {
      const int64_t seq = split == CpLayout::Zigzag ? 16 : 13;
      SCOPED_TRACE(std::string(layout_name(split)) +
                   (attention == CpAttention::Ring ? " ring" : " allgather"));
      // The whole sequence on every rank (grouped-query: 4 query heads over 2).
      auto q = draw({2, 4, seq, 6}, "q").requires_grad_(true);
      auto k = draw({2, 2, seq, 6}, "k").requires_grad_(true);
      auto v = draw({2, 2, seq, 5}, "v").requires_grad_(true);
      const auto w = draw({2, 4, seq, 5}, "w");
      ch03::AttentionOutput want;
      want.output = ch03::causal_attention(q, k, v, &want.lse);
      (want.output * w).sum().backward();
      // This rank's tokens, attending over every rank's.
      const auto mine = shard_positions(seq, n, cp->rank(), split);
      auto part = [&](const torch::Tensor& t) {
        return t.detach().index_select(2, mine).requires_grad_(true);
      };
      auto q_r = part(q), k_r = part(k), v_r = part(v);
      const double scale = 1.0 / std::sqrt(6.0);
      const ContextParallelKernel kernel({cp, split, attention});
      auto got = kernel.attend(q_r, k_r, v_r, mine, mine, scale);
      EXPECT_TENSOR_CLOSE(got.output, want.output.index_select(2, mine), 1e-5, 1e-5);
      EXPECT_TENSOR_CLOSE(got.lse, want.lse.index_select(2, mine), 1e-5, 1e-5);
      (got.output * w.index_select(2, mine)).sum().backward();
      EXPECT_TENSOR_CLOSE(q_r.grad(), q.grad().index_select(2, mine), 1e-5, 1e-5);
      EXPECT_TENSOR_CLOSE(k_r.grad(), k.grad().index_select(2, mine), 1e-5, 1e-5);
      EXPECT_TENSOR_CLOSE(v_r.grad(), v.grad().index_select(2, mine), 1e-5, 1e-5);
    }
  }
}

TEST(ContextParallel, GradientsEqualTheSingleDevice) {
  for (const auto& l : layouts()) {
    for (const bool mla : {false, true}) {
      const int64_t seq = l.split == CpLayout::Zigzag ? 16 : 13;
      SCOPED_TRACE(describe(l) + (mla ? " MLA + MoE" : " GQA"));
      auto config = mla ? ch10::testing::deepseek_config() : ch10::testing::tp_config(false);
      config.n_layers = 2;
      ch03::SingleProcessStep single(ch07::make_model(config), no_clipping());
      auto built = build(l);
      auto step = built.make(ch07::make_model(config), no_clipping());
      const int64_t m = 2;
      const auto want = single.step(split(batches(seq).batch(0), m), 0);
      const auto mine = batches(seq).batch(0, built.dp->rank(), built.dp->size());
      const auto got = step->step(split(mine, m), 0);
      EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss);
      EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm);
      const auto grads = gradients(*step);
      for (const auto& item : single.model()->named_parameters()) {
        if (!item.value().grad().defined()) continue;  // the balancing bias
        SCOPED_TRACE(item.key());
        ASSERT_TRUE(grads.count(item.key()) > 0);
        EXPECT_TENSOR_CLOSE(grads.at(item.key()), item.value().grad(), 1e-6, 1e-4);
      }
    }
  }
}

TEST(ContextParallel, FollowsTheSingleProcessCurve) {
  // 3 steps of AdamW without clipping and with it, ZeRO 0 and 1 (zero 3 at dp 2 x cp 2);
  // then full_model() (whole sequences, chapter 03's kernel) and the optimizer state equal the
  // single process's; then a resume from the single process's state, two steps on.
  const int n = world()->size();
  std::vector<Layout> cases{{1, 1, n, 1, CpLayout::Zigzag, CpAttention::Ring},
                            {1, 1, n, 1, CpLayout::Contiguous, CpAttention::AllGather, 1}};
  if (n == 4) cases.push_back({1, 2, 2, 1, CpLayout::Zigzag, CpAttention::Ring, 3});
  for (const auto& l : cases) {
    for (const auto& config_of : {no_clipping(), clipping()}) {
      const int64_t seq = l.split == CpLayout::Zigzag ? 16 : 13;
      SCOPED_TRACE(describe(l) + (config_of.grad_clip > 0 ? " clipped" : " unclipped"));
      auto config = ch10::testing::tp_config(true);
      ch03::SingleProcessStep single(ch07::make_model(config), config_of);
      auto built = build(l);
      auto step = built.make(ch07::make_model(config), config_of);
      // Steps [first, last) of `layout_step` and of the single process: the same loss and norm.
      const auto train_alike = [&](ch03::TrainingStep& layout_step, int first, int last,
                                   const std::string& label) {
        for (int s = first; s < last; ++s) {
          const auto want = single.step(split(batches(seq).batch(s), 2), s);
          const auto got = layout_step.step(
              split(batches(seq).batch(s, built.dp->rank(), built.dp->size()), 2), s);
          EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss) << label << s;
          EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << label << s;
        }
      };
      train_alike(*step, 0, 3, "step ");
      auto& full = step->full_model();
      for (const auto& item : single.model()->named_parameters()) {
        SCOPED_TRACE(item.key());
        EXPECT_TENSOR_CLOSE(full->named_parameters()[item.key()], item.value(),
                            fivefold::testing::kParameterAtol, 1e-4);
      }
      const auto batch = batches(seq).batch(5);
      EXPECT_NEAR(ch03::loss_of(full, batch).item<double>(),
                  ch03::loss_of(single.model(), batch).item<double>(), 1e-5);
      const auto want_state = single.optimizer_state();
      fivefold::testing::expect_same_optimizer_state(step->optimizer_state(), want_state);

      // Resume: the single process's model and AdamW state into a fresh context-parallel step,
      // two steps on (the first step's loss and norm depend on the weights alone; the second
      // sees the loaded moments), then the state compared again.
      // (A copy: at cp 1 the step trains the model it is given, and the single process goes on
      // training its own.)
      auto copy = ch07::make_model(config);
      fivefold::testing::copy_weights(*copy, *single.model());
      auto resumed = built.make(copy, config_of);
      resumed->load_optimizer_state(want_state, "the single process");
      train_alike(*resumed, 3, 5, "resumed step ");
      fivefold::testing::expect_same_optimizer_state(resumed->optimizer_state(),
                                                     single.optimizer_state(), "resumed: ");
    }
  }
}

TEST(ContextParallel, TrafficEqualsTheFormula) {
  // Every operation on the cp communicator during one forward and backward of a 2-layer model
  // (8 query heads over 4 key/value heads of width 4), counted by the communicator.
  const int n = world()->size(), r = world()->rank();
  dist::DeviceMesh mesh(world(), {{"cp", n}});
  auto config = ch10::testing::tp_config(false);
  config.n_layers = 2;
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    for (auto attention : {CpAttention::Ring, CpAttention::AllGather}) {
      const int64_t seq = split == CpLayout::Zigzag ? 16 : 13;
      SCOPED_TRACE(std::string(layout_name(split)) +
                   (attention == CpAttention::Ring ? " ring" : " allgather"));
      auto model = ch07::make_model(config);
      model->set_attention_kernel(std::make_shared<ContextParallelKernel>(
          ContextParallel{mesh.comm("cp"), split, attention}));
      const auto batch = shard_batch(batches(seq).batch(0), n, r, split);
      dist::reset_comm_stats();
      ch03::loss_of(model, batch).backward();
      const auto want = context_parallel_traffic(n, r, 4, seq, 4, 4, 4, split, attention);
      const std::pair<dist::Op, CpOps> ops[] = {{dist::Op::AllGather, want.all_gather},
                                                {dist::Op::SendRecv, want.send_recv},
                                                {dist::Op::ReduceScatter, want.reduce_scatter},
                                                {dist::Op::AllToAll, CpOps{}}};
      for (const auto& [op, formula] : ops) {
        SCOPED_TRACE(dist::op_name(op));
        const auto got = dist::comm_counts(mesh.comm("cp")->name(), op);
        EXPECT_EQ(got.calls, config.n_layers * formula.calls);
        EXPECT_EQ(got.payload_bytes, config.n_layers * formula.payload_bytes);
      }
    }
  }
}

TEST(ContextParallel, ZigzagBalancesTheCausalWork) {
  // The attention FLOPs each rank executes (chapter 02's counter), forward and backward, for its
  // shard of 64 tokens: equal on every rank under zig-zag, growing with the rank under contiguous
  // sharding (rank r computes r + 1 blocks of the causal triangle).
  auto cp = world();
  const int n = cp->size();
  const int64_t seq = 64;
  auto q = draw({1, 2, seq, 8}, "q"), k = draw({1, 2, seq, 8}, "k"), v = draw({1, 2, seq, 8}, "v");
  std::map<CpLayout, std::vector<double>> flops;
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    const auto mine = shard_positions(seq, n, cp->rank(), split);
    auto part = [&](const torch::Tensor& t) {
      return t.index_select(2, mine).requires_grad_(true);
    };
    const ContextParallelKernel kernel({cp, split, CpAttention::Ring});
    double counted = 0;
    {
      ch02::FlopCounter counter;
      auto out = kernel.attend(part(q), part(k), part(v), mine, mine, 1.0 / std::sqrt(8.0));
      out.output.sum().backward();
      counted = counter.flops();
    }
    // The plan's count: 1 row x 2 heads x the visible tiles' scores x (8 d_k + 6 d_v).
    EXPECT_EQ(counted, 2.0 * static_cast<double>(attention_scores(n, cp->rank(), seq, split,
                                                                  CpAttention::Ring) *
                                                 blockwise_flops_per_score(8, 8)))
        << (split == CpLayout::Zigzag ? "zigzag" : "contiguous");
    auto all = cp->all_gather(torch::tensor({counted}, torch::kDouble));
    flops[split].assign(all.data_ptr<double>(), all.data_ptr<double>() + n);
  }
  const auto& zigzag = flops[CpLayout::Zigzag];
  const auto& contiguous = flops[CpLayout::Contiguous];
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(zigzag[static_cast<size_t>(r)], zigzag[0]) << "rank " << r;
    EXPECT_GT(contiguous[static_cast<size_t>(r)], contiguous[static_cast<size_t>(r) - 1]);
  }
  // Both skip the blocks no query sees: at most about half the full square each.
  const double whole = std::accumulate(contiguous.begin(), contiguous.end(), 0.0);
  EXPECT_LE(std::accumulate(zigzag.begin(), zigzag.end(), 0.0), whole);
  if (n > 1) {
    EXPECT_LT(*std::max_element(zigzag.begin(), zigzag.end()), contiguous.back());
  }
}

TEST(ContextParallel, AttentionFlopsEqualThePlan) {
  // attention_scores x blockwise_flops_per_score, what `fivefold plan` predicts, against chapter
  // 02's counter over forward and backward: both kernels, both layouts, 16 tokens and 13 (uneven
  // contiguous parts), grouped-query heads and keys wider than values (as MLA's).
  auto cp = world();
  const int n = cp->size();
  const int64_t key_dim = 6, value_dim = 4;
  for (const int64_t seq : {16, 13})
  for (auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
    if (split == CpLayout::Zigzag && seq % (2 * n) != 0) continue;  // zig-zag needs 2·cp | seq
    auto q = draw({2, 4, seq, key_dim}, "q"), k = draw({2, 2, seq, key_dim}, "k"),
         v = draw({2, 2, seq, value_dim}, "v");
    for (auto attention : {CpAttention::Ring, CpAttention::AllGather}) {
      const auto mine = shard_positions(seq, n, cp->rank(), split);
      auto part = [&](const torch::Tensor& t) {
        return t.index_select(2, mine).requires_grad_(true);
      };
      const ContextParallelKernel kernel({cp, split, attention});
      double counted = 0;
      {
        ch02::FlopCounter counter;
        auto out = kernel.attend(part(q), part(k), part(v), mine, mine, 0.5);
        out.output.sum().backward();
        counted = counter.flops();
      }
      EXPECT_EQ(counted, 2.0 * 4.0 *
                             static_cast<double>(attention_scores(n, cp->rank(), seq, split,
                                                                  attention) *
                                                 blockwise_flops_per_score(key_dim, value_dim)))
          << (attention == CpAttention::Ring ? "ring" : "all-gather") << ", "
          << (split == CpLayout::Zigzag ? "zigzag" : "contiguous") << ", seq " << seq;
    }
  }
}

TEST(ContextParallel, ActivationsFallAsOneOverCp) {
  // What one micro-batch's forward leaves for backward (MemoryTracker) on each rank, against the
  // same model and batch on one rank (ring attention over a group of one): 1/cp of it, up to the
  // gathered key positions (8 bytes per token and layer on every rank).
  auto cp = world();
  const int n = cp->size(), r = cp->rank();
  auto self = cp->split(r, 0, "self");
  auto config = ch10::testing::tp_config(false);
  const auto whole = batches(16).batch(0);
  auto kept = [&](const dist::CommunicatorPtr& group) {
    auto model = ch07::make_model(config);
    model->set_attention_kernel(std::make_shared<ContextParallelKernel>(
        ContextParallel{group, CpLayout::Zigzag, CpAttention::Ring}));
    const auto batch = shard_batch(whole, group->size(), group->rank(), CpLayout::Zigzag);
    MemoryTracker tracker;
    auto loss = ch03::loss_of(model, batch);
    return static_cast<double>(tracker.current_bytes());
  };
  const double one = kept(self), mine = kept(cp);
  const double positions = static_cast<double>(config.n_layers * 16 * 8 * (n - 1)) / n;
  EXPECT_NEAR(mine, one / n + positions, 0.01 * one / n) << "one rank: " << one;
}

TEST(ContextParallel, ActivationBytesEqualThePlan) {
  // cp_activation_bytes, the figure `fivefold plan --cp` prints, against MemoryTracker's count of
  // what one micro-batch's forward leaves for backward on each rank: exactly, both kernels and
  // layouts, even (16 tokens) and uneven (13, contiguous) parts. Shown to fail: the ring's own
  // keys and values left out (2·K·d), or the all-gather's gathered block left out.
  auto cp = world();
  const int n = cp->size(), r = cp->rank();
  const auto config = ch10::testing::tp_config(false);
  const auto shape = ch02::shape_from_hf_config(ch03::config_to_json(config));
  for (const auto attention : {CpAttention::Ring, CpAttention::AllGather}) {
    for (const auto split : {CpLayout::Zigzag, CpLayout::Contiguous}) {
      for (const int64_t seq : {16, 13}) {
        if (seq == 13 && split == CpLayout::Zigzag) continue;
        SCOPED_TRACE(std::string(layout_name(split)) + " " + std::to_string(seq));
        auto model = ch07::make_model(config);
        model->set_attention_kernel(
            std::make_shared<ContextParallelKernel>(ContextParallel{cp, split, attention}));
        const auto batch = shard_batch(batches(seq).batch(0), n, r, split);
        MemoryTracker tracker;
        auto loss = ch03::loss_of(model, batch);
        EXPECT_EQ(tracker.current_bytes(),
                  cp_activation_bytes(shape, n, r, batch.inputs.size(0), seq, split, attention))
            << (attention == CpAttention::Ring ? "ring" : "allgather");
      }
    }
  }
}

// notes/12_context_parallel.md's figures for Llama-2-7B at 32,768 tokens: the probabilities take
// 137 GB a block; without them one device keeps 415 GB, a rank of cp 4 (zig-zag, ring) 104 GB.
TEST(ContextParallelPlan, Llama2SevenBFiguresOfTheNotes) {
  const auto shape = ch02::shape_from_hf_config(ch02_test::llama2_7b());
  const int64_t s = 32768;
  EXPECT_NEAR(4.0 * shape.n_heads * s * s / 1e9, 137, 0.5);
  const auto bytes = [&](int64_t cp) {
    return static_cast<double>(
               cp_activation_bytes(shape, cp, 0, 1, s, CpLayout::Zigzag, CpAttention::Ring)) /
           1e9;
  };
  EXPECT_NEAR(bytes(1), 415, 0.5);
  EXPECT_NEAR(bytes(4), 104, 0.5);
}
