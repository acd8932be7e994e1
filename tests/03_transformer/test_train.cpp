// Chapter 03 training step (needs the forward pass, hence the exercise): accumulation equals one
// big batch, clipping, the first AdamW step computed by hand, and a short run that learns.

#include <cmath>

#include "03_transformer/train.h"
#include "testing.h"

using namespace fivefold::ch03;

namespace {
ModelConfig tiny() {
  ModelConfig m;
  m.d_model = 64;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.d_ff = 176;
  return m;
}

std::map<std::string, torch::Tensor> gradients(Transformer& model) {
  std::map<std::string, torch::Tensor> g;
  for (const auto& item : model->named_parameters()) g[item.key()] = item.value().grad().clone();
  return g;
}

const TokenDataset& corpus() {
  static const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 3000)));
  return data;
}
}  // namespace

TEST(TrainStep, AccumulatingMicroBatchesEqualsOneBatch) {
  Transformer model(tiny());
  const BatchSampler sampler(corpus(), 32, 8, 1);
  const double whole = accumulate_gradients(model, {sampler.batch(0)});
  const auto expected = gradients(model);
  for (auto& p : model->parameters()) p.mutable_grad().zero_();
  std::vector<Batch> micro;
  for (int r = 0; r < 4; ++r) micro.push_back(sampler.batch(0, r, 4));  // 4 micro-batches of 2 rows
  EXPECT_NEAR(accumulate_gradients(model, micro), whole, 1e-5);
  for (const auto& [name, g] : gradients(model)) {
    EXPECT_TENSOR_CLOSE(g, expected.at(name), 1e-6, 1e-4);  // fp32 sums in another order
  }
}

TEST(TrainStep, ClippingBoundsTheGlobalNorm) {
  Transformer model(tiny());
  accumulate_gradients(model, {BatchSampler(corpus(), 32, 4, 2).batch(0)});
  double squares = 0;
  for (const auto& p : model->parameters()) squares += p.grad().pow(2).sum().item<double>();
  const double norm = clip_gradients(model, 0);  // 0: measure only
  EXPECT_NEAR(norm, std::sqrt(squares), 1e-9 * norm);
  EXPECT_NEAR(clip_gradients(model, norm / 2), norm, 1e-9 * norm);  // returns the norm before
  EXPECT_NEAR(clip_gradients(model, 0), norm / 2, 1e-5 * norm);
}

TEST(TrainStep, FirstAdamWStepByHand) {
  // Step 1 of Adam: bias-corrected m = g, v = g², so the update is lr·g/(|g| + eps); AdamW's decay
  // multiplies the decayed parameters by (1 - lr·wd) first (Loshchilov & Hutter).
  Transformer model(tiny());
  TrainConfig c;
  c.grad_clip = 0;
  const Batch batch = BatchSampler(corpus(), 32, 4, 3).batch(0);
  accumulate_gradients(model, {batch});
  const auto g = gradients(model);
  std::map<std::string, torch::Tensor> before;
  for (const auto& item : model->named_parameters())
    before[item.key()] = item.value().detach().clone();
  auto optimizer = make_optimizer(model, c);
  const auto result = train_step(model, *optimizer, c, {batch}, /*step=*/0);
  const double lr = c.lr / c.warmup_steps;
  EXPECT_DOUBLE_EQ(result.lr, lr);
  for (const auto& item : model->named_parameters()) {
    const auto& name = item.key();
    const bool decays = before[name].dim() == 2 && name != "model.embed_tokens.weight";
    auto expected = before[name] * (1 - lr * (decays ? c.weight_decay : 0.0)) -
                    lr * g.at(name) / (g.at(name).abs() + c.eps);
    SCOPED_TRACE(name);
    EXPECT_TENSOR_CLOSE(item.value(), expected, 1e-6, 1e-5);
  }
}

TEST(TrainStep, AShortRunLearnsContextNotJustCharacterFrequencies) {
  // The unigram entropy of the corpus is the best loss a model that ignores context can reach.
  // After 150 steps of 16 x 64 tokens the loss on held-out text must be clearly below it: the model
  // uses the preceding tokens (no positional encoding yet: that is chapter 04).
  const TokenDataset held_out(ByteTokenizer::encode(synthetic_corpus(0, Split::HeldOut, 400)));
  auto counts = torch::bincount(corpus().tensor(), {}, ByteTokenizer::kVocab).to(torch::kDouble);
  auto p = counts / counts.sum();
  const double unigram = -(p * torch::log(p.clamp_min(1e-300))).sum().item<double>();

  torch::manual_seed(0);
  Transformer model(tiny());
  TrainConfig c;
  c.total_steps = 150;
  auto optimizer = make_optimizer(model, c);
  const BatchSampler sampler(corpus(), 64, 16, 4);
  const Batch evaluation = BatchSampler(held_out, 64, 32, 5).batch(0);
  auto held_out_loss = [&] {
    torch::NoGradGuard no_grad;
    return loss_of(model, evaluation).item<double>();
  };
  const double before = held_out_loss();
  for (int64_t step = 0; step < c.total_steps; ++step)
    train_step(model, *optimizer, c, {sampler.batch(step)}, step);
  const double after = held_out_loss();
  std::printf("unigram entropy %.3f, held-out loss %.3f -> %.3f\n", unigram, before, after);
  EXPECT_NEAR(before, std::log(259.0), 0.1);  // near-uniform predictions at initialisation
  EXPECT_LT(after, unigram - 0.5);
}
