// Chapter 14: activation recomputation. The checkpoint function gives the gradients of the run
// without it, keeps only its inputs, runs its region again in backward (with the forward's random
// numbers and loss weight); installed in a model, every mode gives the loss, every gradient and
// the experts' load of the model without it, and the FLOPs chapter 14's formula counts.

#include "../10_tensor_parallel/fixtures.h"
#include "02_flops_6np/flops.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "14_memory/plan.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch14;
using fivefold::ch14::testing::kept_per_block;
using torch::Tensor;

namespace {

// A region with a parameter and two outputs: tanh(x·W)·y and its row sums.
struct SmallRegion {
  Tensor w = torch::randn({6, 5}, generator_for(1, "w")).requires_grad_();
  int calls = 0;
  std::vector<Tensor> operator()(const std::vector<Tensor>& in) {
    ++calls;
    auto h = torch::tanh(in[0].matmul(w)) * in[1];
    return {h, h.sum(-1)};
  }
};

// Gradients of x, y and W for the loss sum(out0²) + sum(out1), with or without checkpoint.
std::vector<Tensor> small_gradients(bool checkpointed, int* calls = nullptr) {
  SmallRegion region;
  auto x = torch::randn({4, 6}, generator_for(2, "x")).requires_grad_();
  auto y = torch::randn({4, 5}, generator_for(3, "y")).requires_grad_();
  Region run = [&region](const std::vector<Tensor>& in) { return region(in); };
  auto out = checkpointed ? checkpoint(run, {x, y}) : run({x, y});
  (out[0].pow(2).sum() + out[1].sum()).backward();
  if (calls != nullptr) *calls = region.calls;
  return {x.grad(), y.grad(), region.w.grad()};
}

}  // namespace

TEST(Checkpoint, GivesTheGradientsOfTheRunWithoutIt) {
  int calls = 0;
  const auto got = small_gradients(true, &calls);
  const auto want = small_gradients(false);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE("gradient " + std::to_string(i) + " (x, y, W)");
    ASSERT_TRUE(got[i].defined());
    EXPECT_TENSOR_EQ(got[i], want[i]);  // the same operations on the same numbers
  }
  EXPECT_EQ(calls, 2) << "the region runs once in forward and once more in backward";
}

TEST(Checkpoint, KeepsOnlyItsInputsUntilBackward) {
  auto x = torch::randn({256, 64}, generator_for(4, "x")).requires_grad_();
  const Region chain = [](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{torch::tanh(torch::tanh(torch::tanh(in[0]))).sum()};
  };
  int64_t kept[2] = {0, 0};
  for (bool checkpointed : {false, true}) {
    MemoryTracker memory;
    auto out = checkpointed ? checkpoint(chain, {x}) : chain({x});
    kept[checkpointed] = memory.current_bytes();  // alive until backward
    out[0].backward();
  }
  const int64_t activation = x.numel() * 4;
  // Without: each tanh keeps its output for backward (3 activations) and the scalar sum.
  EXPECT_EQ(kept[0], 3 * activation + 4);
  // With: the scalar output alone; x was alive before and is not counted.
  EXPECT_EQ(kept[1], 4);
}

// A region that reads its input only rounded to bf16 (the value of x.to(bf16), the gradient of
// x itself, as the fast paths' tiled kernel reads k) can keep that rounding in x's place: half the
// bytes, and the same gradient, in x's type.
TEST(Checkpoint, KeepsANarrowerCopyAndHandsTheGradientBackInTheInputsType) {
  const auto w = torch::randn({32, 8}, generator_for(5, "w"));
  const Region region = [&w](const std::vector<Tensor>& in) {
    const auto rounded =
        in[0] + (in[0].to(torch::kBFloat16).to(in[0].scalar_type()) - in[0]).detach();
    return std::vector<Tensor>{torch::tanh(rounded.matmul(w)).pow(2).sum()};
  };
  Tensor grads[2];
  int64_t kept[2];
  for (bool narrow : {false, true}) {
    auto x = torch::randn({64, 32}, generator_for(6, "x")).requires_grad_();
    MemoryTracker memory;
    auto out = narrow ? checkpoint(region, {x}, {x.detach().to(torch::kBFloat16)})
                      : checkpoint(region, {x});
    kept[narrow] = memory.current_bytes();
    out[0].backward();
    grads[narrow] = x.grad();
  }
  EXPECT_EQ(kept[0], 4);                // the scalar output (x was alive before)
  EXPECT_EQ(kept[1], 64 * 32 * 2 + 4);  // and the bf16 copy kept in x's place
  ASSERT_EQ(grads[1].scalar_type(), torch::kFloat);
  EXPECT_TENSOR_EQ(grads[1], grads[0]);  // not rounded to bf16 on its way back
  EXPECT_GT((grads[0] - grads[0].to(torch::kBFloat16).to(torch::kFloat)).abs().max().item<double>(),
            0.0)
      << "the test needs a gradient that bf16 cannot hold";
  auto x = torch::randn({4, 32}).requires_grad_();
  EXPECT_THROW(checkpoint(region, {x}, {torch::zeros({4, 31})}), Error);  // another shape
  EXPECT_THROW(checkpoint(region, {x}, {x, x}), Error);                   // one per input
}

TEST(Checkpoint, RunsAgainWithTheForwardsRandomNumbersAndLossWeight) {
  // A dropout-like mask drawn inside the region, and a factor read from the loss weight of the
  // forward's micro-batch (chapter 07's auxiliary loss reads it so); backward runs outside both.
  const Region region = [](const std::vector<Tensor>& in) {
    auto keep = (torch::rand(in[0].sizes()) > 0.5).to(torch::kFloat);
    return std::vector<Tensor>{in[0] * keep * ch03::LossWeightScope::current()};
  };
  Tensor grads[2];
  for (bool checkpointed : {false, true}) {
    torch::manual_seed(7);
    auto x = torch::ones({1000}).requires_grad_();
    std::vector<Tensor> out;
    {
      ch03::LossWeightScope weight(0.25);
      out = checkpointed ? checkpoint(region, {x}) : region({x});
    }
    torch::rand({3});  // the generator moves on before backward
    out[0].sum().backward();
    grads[checkpointed] = x.grad();
  }
  EXPECT_TENSOR_EQ(grads[1], grads[0]);
  EXPECT_GT(grads[0].sum().item<double>(), 0.2 * 1000 * 0.25);  // a mask, not all zeros
}

TEST(Checkpoint, IsThePlainRegionWithoutGradients) {
  int calls = 0;
  const Region region = [&calls](const std::vector<Tensor>& in) {
    ++calls;
    return std::vector<Tensor>{in[0] * 2};
  };
  auto out = checkpoint(region, {torch::ones({3})});
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_TENSOR_EQ(out[0], torch::full({3}, 2.0));
  EXPECT_EQ(calls, 1);
  EXPECT_THROW(checkpoint(Region{}, {torch::ones({3})}), Error);
}

TEST(Recompute, ParsesItsModesAndRefusesOthers) {
  for (const char* name : {"none", "full", "selective"})
    EXPECT_EQ(to_string(parse_recompute(name)), name);
  try {
    parse_recompute("some");
    FAIL() << "'some' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none, full, selective"), std::string::npos) << e.what();
  }
  ch03::Transformer model = ch07::make_model(ch10::testing::tp_config(false));
  EXPECT_THROW(apply_recompute(model, {Recompute::Full, 0}), Error);
}

namespace {

struct Result {
  double loss = 0;
  std::map<std::string, Tensor> grads;
  nlohmann::json load;  // the experts' load statistics after the step (chapter 07)
};

// One accumulated step over two micro-batches (each with its loss weight) of `config`'s model
// with `recompute` installed.
Result run(const ch03::ModelConfig& config, const RecomputeConfig& recompute) {
  ch03::Transformer model = ch07::make_model(config);
  apply_recompute(model, recompute);
  const auto batch = ch10::testing::tp_batches().batch(0, 0, 1);
  std::vector<ch03::Batch> micro;
  for (int64_t i = 0; i < 2; ++i)
    micro.push_back({batch.inputs.narrow(0, i * 2, 2), batch.targets.narrow(0, i * 2, 2)});
  Result r;
  r.loss = ch03::accumulate_gradients(model, micro);
  for (const auto& item : model->named_parameters())
    if (item.value().grad().defined()) r.grads[item.key()] = item.value().grad().clone();
  r.load = ch07::after_step(model);
  return r;
}

std::vector<std::pair<std::string, RecomputeConfig>> modes() {
  return {{"full", {Recompute::Full, 1}},
          {"full every 2", {Recompute::Full, 2}},
          {"selective", {Recompute::Selective, 1}}};
}

}  // namespace

// Dense Llama (grouped-query attention, RoPE) and DeepSeek-V3 in miniature (MLA, a dense layer
// then experts with the balancing bias, and the Switch auxiliary loss so that the loss weight of
// each micro-batch matters): every mode, the same numbers as no recomputation, bit for bit.
TEST(Recompute, EveryModeGivesTheLossGradientsAndLoadOfTheRunWithout) {
  auto deepseek = ch10::testing::deepseek_config();
  deepseek.extensions["aux_loss_alpha"] = 0.01;
  for (const auto& [name, config] :
       {std::pair{std::string("llama"), ch10::testing::tp_config(false)},
        std::pair{std::string("deepseek"), deepseek}}) {
    const Result want = run(config, {});
    ASSERT_FALSE(want.grads.empty());
    for (const auto& [mode, recompute] : modes()) {
      SCOPED_TRACE(name + ", " + mode);
      const Result got = run(config, recompute);
      EXPECT_EQ(got.loss, want.loss);
      ASSERT_EQ(got.grads.size(), want.grads.size());
      for (const auto& [param, grad] : want.grads) {
        SCOPED_TRACE(param);
        ASSERT_TRUE(got.grads.count(param));
        EXPECT_TENSOR_EQ(got.grads.at(param), grad);
      }
      EXPECT_EQ(got.load.dump(), want.load.dump()) << "the load counted once per step";
    }
  }
}

// Chapter 02's counter during a whole step (forward, backward) = chapter 14's formula: 3 x forward
// plus the recomputed part again, for every mode.
TEST(Recompute, MeasuredFlopsEqualTheFormula) {
  auto config = ch10::testing::tp_config(false);
  config.n_layers = 3;  // every 2: layers 0 and 2 recomputed
  for (int64_t seq : {5, 12}) {
    for (const auto& [mode, recompute] :
         {std::pair{std::string("none"), RecomputeConfig{}}, modes()[0], modes()[1], modes()[2]}) {
      SCOPED_TRACE(mode + ", seq " + std::to_string(seq));
      ch03::Transformer model = ch07::make_model(config);
      apply_recompute(model, recompute);
      auto tokens = torch::randint(0, config.vocab_size, {2, seq}, generator_for(5, "tokens"));
      ch02::FlopCounter counter;
      ch03::loss_of(model, {tokens, tokens}).backward();
      EXPECT_EQ(counter.flops(),
                2.0 * seq * training_flops_per_token(config.shape(), seq, recompute));
    }
  }
  // Full on every block: the extra forward of the blocks, (8NP - 6NP) for the matrices in them.
  const auto shape = config.shape();
  const double none = training_flops_per_token(shape, 8, {});
  const double full = training_flops_per_token(shape, 8, {Recompute::Full, 1});
  const auto forward = ch02::forward_flops_per_token(shape, 8);
  EXPECT_DOUBLE_EQ(full - none, forward.total() - forward.lm_head);
}

// What one block keeps from forward to backward, measured as the growth of the storage alive
// when the loss is computed as blocks are added (MemoryTracker), against the formula, for every
// mode, at two sequence lengths, with as many key/value heads as heads and with fewer.
// In fp32 and in bf16 (where the linear maps keep bf16 copies of their inputs and weights).
TEST(Recompute, KeptActivationsEqualTheFormula) {
  ch14::testing::Fp32Afterwards restore;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    for (int64_t kv_heads : {8, 2}) {
      for (int64_t seq : {8, 16}) {
        for (const auto& [mode, recompute] : {std::pair{std::string("none"), RecomputeConfig{}},
                                              modes()[0], modes()[1], modes()[2]}) {
          SCOPED_TRACE(to_string(precision) + ", " + mode + ", " + std::to_string(kv_heads) +
                       " kv heads, seq " + std::to_string(seq));
          auto config = ch10::testing::tp_config(false);
          config.n_kv_heads = kv_heads;
          const int64_t batch = 2;
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto kept = kept_per_block(
              [&, recompute = recompute](int64_t layers) {
                config.n_layers = layers;
                ch03::Transformer model = ch07::make_model(config);
                apply_recompute(model, recompute);
                return model;
              },
              {tokens, tokens}, 3);
          for (int64_t layer : {1, 2}) {  // the block added
            const bool again = recompute.mode == Recompute::Full && layer % recompute.every == 0;
            const Recompute as = again                               ? Recompute::Full
                                 : recompute.mode == Recompute::Full ? Recompute::None
                                                                     : recompute.mode;
            EXPECT_EQ(kept[layer - 1],
                      block_activation_bytes(config.shape(), batch, seq, as, {}, precision))
                << "block " << layer;
          }
        }
      }
    }
  }
}

// notes/14_memory.md §1's figures for Llama-2-7B's shape at 4096 tokens, one row.
TEST(Recompute, Llama2SevenBFigures) {
  ch03::ModelConfig c;
  c.d_model = 4096;
  c.d_ff = 11008;
  c.n_heads = c.n_kv_heads = 32;
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::None), 3693117440);
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::Selective), 1528856576);
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::Full), 67108864);
  // In bf16: 2·4096·(2·4096 + 4096 + 4·11008) = 461,373,440 bytes fewer without recomputation
  // and with selective.
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::None, {}, Precision::Bf16),
            3231744000);
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::Selective, {}, Precision::Bf16),
            1067483136);
  EXPECT_EQ(block_activation_bytes(c.shape(), 1, 4096, Recompute::Full, {}, Precision::Bf16),
            67108864);
}

// Under a budget: the fewest FLOPs that fit. The blocks' bytes of each mode are the measured
// formula's (KeptActivationsEqualTheFormula); the choice is checked against them here.
TEST(Recompute, UnderABudgetTheCheapestModeThatFits) {
  auto config = ch10::testing::tp_config(false);
  config.n_layers = 4;
  const auto shape = config.shape();
  const int64_t b = 2, s = 16;
  auto total = [&](Recompute mode) { return 4 * block_activation_bytes(shape, b, s, mode); };
  const int64_t none = total(Recompute::None), selective = total(Recompute::Selective);
  const int64_t full = total(Recompute::Full);
  ASSERT_GT(none, selective);
  EXPECT_EQ(recompute_under_budget(shape, b, s, none).config.mode, Recompute::None);
  const auto fits_selective = recompute_under_budget(shape, b, s, none - 1);
  EXPECT_EQ(fits_selective.config.mode, Recompute::Selective);
  EXPECT_EQ(fits_selective.bytes, selective);
  // Two of the four blocks recomputed (every 2: blocks 0 and 2; every 3: 0 and 3, the same cost)
  // keep 4bsd, the other two everything.
  const int64_t every_2 = (full + none) / 2;
  ASSERT_LT(every_2, selective);  // so a budget of every_2 rules selective out
  const auto choice = recompute_under_budget(shape, b, s, every_2);
  EXPECT_EQ(choice.config.mode, Recompute::Full);
  EXPECT_EQ(recomputed_layers(4, choice.config.every), 2);
  EXPECT_EQ(choice.bytes, every_2);
  const auto tight = recompute_under_budget(shape, b, s, full);
  EXPECT_EQ(tight.config.mode, Recompute::Full);
  EXPECT_EQ(tight.config.every, 1);
  EXPECT_DOUBLE_EQ(tight.flops_per_token, training_flops_per_token(shape, s, {Recompute::Full, 1}));
  try {
    recompute_under_budget(shape, b, s, full - 1);
    ADD_FAILURE() << "a budget below full recomputation was met";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(full)), std::string::npos) << e.what();
  }
}

TEST(Recompute, PerStageRecomputesTheFirstStagesOnly) {
  // --recompute-stages 2: stages 0 and 1 run the config, later stages nothing; 0: every stage.
  const RecomputeConfig first_two{Recompute::Full, 2, 2};
  EXPECT_EQ(first_two.for_stage(0).mode, Recompute::Full);
  EXPECT_EQ(first_two.for_stage(1).mode, Recompute::Full);
  EXPECT_EQ(first_two.for_stage(1).every, 2);
  EXPECT_EQ(first_two.for_stage(2).mode, Recompute::None);
  EXPECT_FALSE(recomputes_block(first_two.for_stage(3), 0));
  const RecomputeConfig every_stage{Recompute::Selective, 1, 0};
  EXPECT_EQ(every_stage.for_stage(7).mode, Recompute::Selective);
}

// A DeepSeek-V3-shaped block (chapter 06's MLA, chapter 07's MoE) keeps what
// deepseek_block_activation_bytes says: its dense first layer and a MoE layer, with 1, 2 and 3 rows
// (one row keeps kv_b_proj's whole output), with k 2 and 3, without the query latent, without the
// shared expert; with full recomputation of every block, its input (and a MoE layer its routing);
// with selective, the attention core's inputs; in fp32 and in bf16.
TEST(Recompute, ADeepSeekBlockKeepsWhatItsFormulaSays) {
  ch14::testing::Fp32Afterwards restore;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    for (int variant = 0; variant < 6; ++variant) {
      const Recompute mode = variant == 4   ? Recompute::Full
                             : variant == 5 ? Recompute::Selective
                                            : Recompute::None;
      for (int64_t seq : {4, 8}) {
        for (int64_t batch : {1, 2, 3}) {
          auto config = ch10::testing::deepseek_config();
          config.extensions["first_k_dense_replace"] = 2;  // block 1 dense, block 2 MoE
          if (variant == 1) config.extensions["num_experts_per_tok"] = 3;
          if (variant == 2) config.extensions["q_lora_rank"] = nullptr;
          if (variant == 3) config.extensions["n_shared_experts"] = 0;
          SCOPED_TRACE(to_string(precision) + ", variant " + std::to_string(variant) + ", seq " +
                       std::to_string(seq) + ", batch " + std::to_string(batch));
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto kept = kept_per_block(
              [&](int64_t layers) {
                config.n_layers = layers;
                ch03::Transformer model = ch07::make_model(config);
                apply_recompute(model, {mode, 1, 0});
                return model;
              },
              {tokens, tokens}, 3);
          for (int64_t layer : {1, 2})  // the block added: 1 dense, 2 MoE
            EXPECT_EQ(kept[layer - 1], deepseek_block_activation_bytes(config, layer, batch, seq,
                                                                       mode, {}, {}, precision))
                << "block " << layer;
        }
      }
    }
  }
}

// Routing the formula does not count is refused by name, not miscounted.
TEST(Recompute, ADeepSeekBlockFormulaRefusesWhatItDoesNotCount) {
  for (const char* key : {"fivefold_capacity_factor", "aux_loss_alpha"}) {
    auto config = ch10::testing::deepseek_config();
    config.extensions[key] = 1.25;
    EXPECT_NO_THROW(deepseek_block_activation_bytes(config, 0, 2, 8)) << key << ": dense layer";
    try {
      deepseek_block_activation_bytes(config, 1, 2, 8);
      ADD_FAILURE() << key << " was counted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("dropless"), std::string::npos) << e.what();
    }
  }
}
