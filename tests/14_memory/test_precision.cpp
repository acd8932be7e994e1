// Chapter 14: mixed precision. The bf16 kernel's products are the fp32 operands rounded to bf16,
// multiplied, rounded again; a training step in bf16 keeps its weights, gradients and AdamW's
// state in fp32, and lands near the fp32 step (bf16 keeps 8 bits of mantissa: ~0.4% a product).

#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/generate.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "fixtures.h"
#include "14_memory/precision.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch14;
using torch::Tensor;

namespace {

double relative(const Tensor& got, const Tensor& want) {
  return ((got - want).norm() / want.norm()).item<double>();
}

}  // namespace

TEST(Precision, ParsesItsNamesAndRefusesOthers) {
  for (const char* name : {"fp32", "bf16"}) EXPECT_EQ(to_string(parse_precision(name)), name);
  try {
    parse_precision("fp16");
    FAIL() << "fp16 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp32, bf16"), std::string::npos) << e.what();
  }
}

TEST(Precision, Bf16ProductsRoundTheOperandsAndTheResult) {
  const auto a = torch::randn({37, 64}, generator_for(1, "a"));
  const auto b = torch::randn({64, 29}, generator_for(2, "b"));
  const Bf16MatmulKernel kernel;
  const auto result = kernel.mm(a, b);
  EXPECT_EQ(result.scalar_type(), torch::kBFloat16) << "the result is handed on in bf16";
  EXPECT_EQ(kernel.result_type(torch::kFloat), torch::kBFloat16) << "and `linear` hands it on";
  const auto got = result.to(torch::kFloat);
  const auto rounded = [](const Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat); };
  // The operands rounded, multiplied in fp32 (oneDNN accumulates in fp32), the result rounded.
  EXPECT_TENSOR_CLOSE(got, rounded(rounded(a).mm(rounded(b))), 0, 1e-2);
  const double error = relative(got, a.mm(b));
  EXPECT_GT(error, 1e-4) << "not rounded at all";
  EXPECT_LT(error, 1e-2);
  const auto x = torch::randn({3, 5, 8}, generator_for(3, "x"));
  const auto y = torch::randn({3, 8, 4}, generator_for(4, "y"));
  EXPECT_LT(relative(kernel.bmm(x, y).to(torch::kFloat), x.bmm(y)), 1e-2);
}

// One AdamW step of chapter 10's MLA + MoE model in bf16 against the same in fp32: the loss and
// every gradient within bf16's rounding, every parameter, gradient and moment stored in fp32.
TEST(Precision, ABf16StepKeepsFp32StateAndLandsNearTheFp32Step) {
  ch14::testing::Fp32Afterwards restore;
  const auto batch = ch10::testing::tp_batches().batch(0, 0, 1);
  std::map<std::string, Tensor> grads[2];
  double loss[2] = {0, 0};
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    ch03::Transformer model = ch07::make_model(ch10::testing::deepseek_config());
    ch03::SingleProcessStep step(model, ch03::TrainConfig{});
    const auto result = step.step({batch}, 0);
    const int i = precision == Precision::Bf16;
    loss[i] = result.loss;
    for (const auto& item : model->named_parameters()) {
      EXPECT_EQ(item.value().scalar_type(), torch::kFloat) << item.key();
      if (!item.value().grad().defined()) continue;
      EXPECT_EQ(item.value().grad().scalar_type(), torch::kFloat) << item.key();
      grads[i][item.key()] = item.value().grad().clone();
    }
    for (const auto& [name, t] : step.optimizer_state())  // the moments (and integer step counts)
      if (t.is_floating_point()) EXPECT_EQ(t.scalar_type(), torch::kFloat) << name;
  }
  EXPECT_NEAR(loss[1], loss[0], 1e-2 * loss[0]);
  EXPECT_NE(loss[1], loss[0]) << "the bf16 step computed in fp32";
  ASSERT_EQ(grads[1].size(), grads[0].size());
  for (const auto& [name, want] : grads[0]) {
    if (want.norm().item<double>() == 0) continue;
    EXPECT_LT(relative(grads[1].at(name), want), 5e-2) << name;
  }
}

// Mixed precision's weights: a model whose trainable parameters are stored in bf16 (the rounding
// of fp32 master weights an optimizer keeps) still runs its residual stream, norms, router and
// loss in fp32: the embedding hands fp32 rows on, each norm and the head widen their weight; the
// gradients come back in the parameters' own type. Its loss and gradients land within bf16's
// rounding of the fp32 model's, dense (tied embedding) and MLA + MoE alike.
TEST(Precision, AModelWithBf16ParametersKeepsAnFp32ResidualStream) {
  ch14::testing::Fp32Afterwards restore;
  use_precision(Precision::Bf16, nullptr);
  const auto batch = ch10::testing::tp_batches().batch(0, 0, 1);
  for (const auto& config : {ch10::testing::tp_config(true), ch10::testing::deepseek_config()}) {
    SCOPED_TRACE(config.extensions.empty() ? "Llama, tied" : "MLA + MoE");
    std::map<std::string, Tensor> grads[2];
    double loss[2] = {0, 0};
    for (int bf16 = 0; bf16 < 2; ++bf16) {
      ch03::Transformer model = ch07::make_model(config);
      if (bf16) {
        torch::NoGradGuard no_grad;
        for (auto& p : model->parameters())
          if (p.requires_grad()) p.set_data(p.to(torch::kBFloat16));
      }
      EXPECT_EQ(model->embed(batch.inputs).scalar_type(), torch::kFloat);
      const auto result = ch03::loss_of(model, batch);
      ASSERT_EQ(result.scalar_type(), torch::kFloat);
      result.backward();
      loss[bf16] = result.item<double>();
      for (const auto& item : model->named_parameters()) {
        if (!item.value().grad().defined()) continue;
        EXPECT_EQ(item.value().grad().scalar_type(), item.value().scalar_type()) << item.key();
        grads[bf16][item.key()] = item.value().grad().to(torch::kFloat);
      }
    }
    EXPECT_NEAR(loss[1], loss[0], 1e-2 * loss[0]);
    ASSERT_EQ(grads[1].size(), grads[0].size());
    for (const auto& [name, want] : grads[0]) {
      if (want.norm().item<double>() == 0) continue;
      EXPECT_LT(relative(grads[1].at(name), want), 5e-2) << name;
    }
  }
}

// Generation under bf16 products (a bf16 run's exact-match evaluation generates): the KV cache's
// path gives the logits of the path without it, within bf16's rounding, whether the parameters
// are fp32 (the run evaluates its fp32 masters) or bf16. MLA's cache path multiplies the
// attention's fp32 output by W^UV; with W^UV in bf16 that product threw (seen: every DeepSeek run
// in bf16 stopped at its first evaluation, before the step's checkpoint).
TEST(Precision, TheKvCacheGivesTheLogitsWithoutItUnderBf16Products) {
  ch14::testing::Fp32Afterwards restore;
  use_precision(Precision::Bf16, nullptr);
  const auto tokens = ch10::testing::tp_batches().batch(0, 0, 1).inputs.narrow(0, 0, 1);
  for (const auto& config : {ch10::testing::tp_config(true), ch10::testing::deepseek_config()}) {
    for (bool bf16_parameters : {false, true}) {
      SCOPED_TRACE(std::string(config.extensions.empty() ? "Llama" : "MLA + MoE") +
                   (bf16_parameters ? ", bf16 parameters" : ", fp32 parameters"));
      ch03::Transformer model = ch07::make_model(config);
      torch::NoGradGuard no_grad;
      if (bf16_parameters)
        for (auto& p : model->parameters())
          if (p.requires_grad()) p.set_data(p.to(torch::kBFloat16));
      const auto want = model->forward(tokens);
      ch03::KVCache cache;
      const auto got = model->forward(tokens, &cache);
      EXPECT_LT(relative(got.to(torch::kFloat), want.to(torch::kFloat)), 2e-2);
      EXPECT_EQ(ch03::generate(model, {1, 2, 3}, 4).size(), 4u);
    }
  }
}

namespace {

int64_t trainable_numel(ch03::Transformer& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

}  // namespace

// Master weights on one process (TrainConfig::param_dtype = bf16): the parameters and gradients
// in bf16, AdamW over fp32 masters: ZeRO's mixed-precision split, 2Ψ + 2Ψ + 12Ψ, measured. A
// checkpoint reads the masters themselves (full_model), and a step resumed from them and from
// the optimizer's state takes the same step, bit for bit, as the run never interrupted.
TEST(Precision, MasterWeightsKeepTheMixedPrecisionSplitAndResumeExactly) {
  ch14::testing::Fp32Afterwards restore;
  use_precision(Precision::Bf16, nullptr);
  const auto config = ch10::testing::tp_config(false);
  ch03::TrainConfig train;
  train.param_dtype = torch::kBFloat16;
  const auto& batches = ch10::testing::tp_batches();
  auto make = [&] { return ch07::make_model(config); };

  ch03::Transformer model = make();
  const int64_t psi = trainable_numel(model);
  ch03::SingleProcessStep step(model, train);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  double losses[3];
  for (int64_t i = 0; i < 2; ++i) losses[i] = step.step({batches.batch(i, 0, 1)}, i).loss;
  const ch03::StateBytes state = step.state_bytes();
  EXPECT_EQ(state.parameters, 2 * psi);
  EXPECT_EQ(state.gradients, 2 * psi);
  EXPECT_EQ(state.optimizer, 12 * psi) << "fp32 masters (4) and AdamW's two moments (8)";

  // The checkpoint: the masters themselves, of which the parameters were the rounding.
  std::map<std::string, Tensor> rounded, saved;
  for (const auto& item : model->named_parameters()) rounded[item.key()] = item.value().clone();
  ch03::Transformer& full = step.full_model();
  int64_t finer = 0;  // elements where the master holds more than its rounding
  for (const auto& item : full->named_parameters()) {
    const auto& master = item.value();
    ASSERT_EQ(master.scalar_type(), torch::kFloat) << item.key();
    EXPECT_TRUE(master.to(torch::kBFloat16).equal(rounded.at(item.key()))) << item.key();
    finer += master.ne(rounded.at(item.key()).to(torch::kFloat)).sum().item<int64_t>();
    saved[item.key()] = master.detach().clone();
  }
  EXPECT_GT(finer, psi / 2) << "the masters are only their rounding";
  io::TensorMap optimizer;  // copies: the state's tensors are AdamW's own, which step 3 changes
  for (const auto& [name, t] : step.optimizer_state()) optimizer[name] = t.clone();
  losses[2] = step.step({batches.batch(2, 0, 1)}, 2).loss;
  const auto after = step.gradients();

  // Resumed from the masters and the optimizer's state.
  ch03::Transformer resumed = make();
  {
    torch::NoGradGuard no_grad;
    for (auto& item : resumed->named_parameters()) item.value().copy_(saved.at(item.key()));
  }
  ch03::SingleProcessStep again(resumed, train);
  again.load_optimizer_state(optimizer, "memory");
  EXPECT_EQ(again.step({batches.batch(2, 0, 1)}, 2).loss, losses[2]);
  for (const auto& [name, grad] : again.gradients()) EXPECT_TRUE(grad.equal(after.at(name))) << name;
  auto got = resumed->named_parameters(), want = model->named_parameters();
  for (const auto& item : want) EXPECT_TRUE(got[item.key()].equal(item.value())) << item.key();

  // The same three steps with fp32 parameters (bf16 products alone): within bf16's rounding.
  ch03::Transformer plain = make();
  ch03::SingleProcessStep fp32(plain, ch03::TrainConfig{});
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_NEAR(fp32.step({batches.batch(i, 0, 1)}, i).loss, losses[i], 1e-2 * losses[i]) << i;
}

// With master weights the clip reads and scales the masters' fp32 gradients: the norm is that of
// the bf16 gradients widened, and AdamW's first moment after one step is (1 - β1) times each
// widened gradient scaled in fp32, exactly; scaled in bf16 (then widened), as the clip did before
// 2026-12-07, it is rounded once more and differs.
TEST(Precision, TheClipScalesTheMastersFp32Gradients) {
  ch14::testing::Fp32Afterwards restore;
  use_precision(Precision::Bf16, nullptr);
  const auto config = ch10::testing::tp_config(false);
  ch03::TrainConfig train;
  train.param_dtype = torch::kBFloat16;
  train.grad_clip = 0.05;
  const auto batch = ch10::testing::tp_batches().batch(0, 0, 1);

  // The bf16 gradients the step will compute: the same model, rounded as the masters round it.
  ch03::Transformer probe = ch07::make_model(config);
  ch03::MasterWeights rounding(probe, torch::kBFloat16);
  ch03::loss_of(probe, batch).backward();
  double squares = 0;
  for (const auto& p : probe->parameters())
    if (p.grad().defined()) squares += p.grad().to(torch::kFloat).pow(2).sum().item<double>();
  const double norm = std::sqrt(squares);
  ASSERT_GT(norm, 2 * train.grad_clip) << "the test needs a step that clips";

  ch03::Transformer model = ch07::make_model(config);
  ch03::SingleProcessStep step(model, train);
  EXPECT_EQ(step.step({batch}, 0).grad_norm, norm);
  const auto state = step.optimizer_state();
  int64_t rounded_apart = 0;  // elements where scaling in bf16 would have given another moment
  for (const auto& item : probe->named_parameters()) {
    const auto& grad = item.value().grad();
    if (!grad.defined()) continue;
    const auto widened = grad.to(torch::kFloat) * (train.grad_clip / norm);
    const auto want = widened * (1 - train.beta1);
    const auto& got = state.at(item.key() + ".exp_avg");
    EXPECT_TRUE(got.equal(want)) << item.key() << ": not the fp32 gradient's clip";
    const auto in_bf16 = (grad * (train.grad_clip / norm)).to(torch::kFloat) * (1 - train.beta1);
    rounded_apart += in_bf16.ne(want).sum().item<int64_t>();
  }
  EXPECT_GT(rounded_apart, 0) << "the test cannot tell a clip in bf16 from one in fp32";
}
