// Chapter 10: the tensor-parallel model against the single-device model, at tp = the world size
// (1, 2, 4), with and without sequence parallelism, tied and untied embeddings: the weights at
// initialisation (bit for bit), the loss, every parameter's gradient gathered from the slices,
// and the global norm at step 1; then three SGD steps (an update a constant gradient scale
// changes). Shown to fail on purpose at 2 ranks, each test run alone (the harness ends the job at
// the first failure): f's backward made the identity fails GradientsEqualOneDevice (the embedding's
// gradient) and SgdStepsEqualOneDevice; g's forward made the identity fails both; the norms'
// partial gradients left unsummed under SP (tensor_parallel_groups) fails both with SP; the norm's
// squares not summed over tp, or the replicated norms counted on every tp rank, fails
// GradientsEqualOneDevice (the global norm).

#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/step.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch10;
using fivefold::ch10::testing::tp_batches;
using fivefold::ch10::testing::tp_config;
using fivefold::testing::world;

namespace {

io::TensorMap weights_of(ch03::Transformer& model) {
  io::TensorMap w;
  for (const auto& item : model->named_parameters()) w[item.key()] = item.value().detach().clone();
  return w;
}

io::TensorMap grads_of(ch03::Transformer& model) {
  io::TensorMap g;
  for (const auto& item : model->named_parameters()) g[item.key()] = item.value().grad().clone();
  return g;
}

std::vector<std::pair<std::string, torch::Tensor>> named(ch03::Transformer& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

struct Variant {
  bool tied, sp;
};
const Variant kVariants[] = {{false, false}, {false, true}, {true, false}, {true, true}};

}  // namespace

TEST(TensorParallelModel, StartsFromTheSingleDeviceWeights) {
  for (const auto& v : kVariants) {
    auto tp = std::make_shared<TensorParallel>(TensorParallel{world(), v.sp});
    auto local = make_model(tp_config(v.tied), tp);
    auto whole = ch07::make_model(tp_config(v.tied));
    const auto gathered = gather_shards(weights_of(local), local->parameter_shards(), *world());
    const auto want = weights_of(whole);
    ASSERT_EQ(gathered.size(), want.size());
    for (const auto& [name, w] : want) {
      SCOPED_TRACE(name);
      EXPECT_TENSOR_EQ(gathered.at(name), w);
    }
  }
}

TEST(TensorParallelModel, GradientsEqualOneDevice) {
  for (const auto& v : kVariants) {
    SCOPED_TRACE(std::string(v.tied ? "tied" : "untied") + (v.sp ? ", SP" : ""));
    const auto batch = tp_batches().batch(0);
    auto whole = ch07::make_model(tp_config(v.tied));
    auto want_loss = ch03::loss_of(whole, batch);
    want_loss.backward();
    const double want_norm = ch03::clip_gradients(whole, 0);

    auto tp = std::make_shared<TensorParallel>(TensorParallel{world(), v.sp});
    auto local = make_model(tp_config(v.tied), tp);
    auto loss = ch03::loss_of(local, batch);
    loss.backward();
    // fp32 over different summation orders: 1e-6 relative on the loss.
    EXPECT_NEAR(loss.item<double>(), want_loss.item<double>(), 1e-6 * want_loss.item<double>());
    const auto groups = tensor_parallel_groups(local, *tp);
    ch09::reduce_partial_gradients(named(local), groups);  // the norms under SP
    const auto grads = gather_shards(grads_of(local), local->parameter_shards(), *world());
    for (const auto& [name, g] : grads_of(whole)) {
      SCOPED_TRACE(name);
      EXPECT_TENSOR_CLOSE(grads.at(name), g, 1e-6, 1e-4);
    }
    const double norm = ch09::clip_gradients(named(local), 0, groups);
    EXPECT_NEAR(norm, want_norm, 1e-5 * want_norm);
  }
}

TEST(TensorParallelModel, SgdStepsEqualOneDevice) {
  // Plain SGD moves each weight by lr x its gradient: a gradient off by any factor shows.
  const double lr = 0.5;
  for (const auto& v : kVariants) {
    SCOPED_TRACE(std::string(v.tied ? "tied" : "untied") + (v.sp ? ", SP" : ""));
    auto whole = ch07::make_model(tp_config(v.tied));
    auto tp = std::make_shared<TensorParallel>(TensorParallel{world(), v.sp});
    auto local = make_model(tp_config(v.tied), tp);
    const auto groups = tensor_parallel_groups(local, *tp);
    for (int step = 0; step < 3; ++step) {
      const auto batch = tp_batches().batch(step);
      for (auto* m : {&whole, &local}) {
        (*m)->zero_grad();
        ch03::loss_of(*m, batch).backward();
      }
      ch09::reduce_partial_gradients(named(local), groups);
      torch::NoGradGuard no_grad;
      for (auto* m : {&whole, &local})
        for (auto& p : (*m)->parameters()) p.sub_(lr * p.grad());
    }
    const auto gathered = gather_shards(weights_of(local), local->parameter_shards(), *world());
    for (const auto& [name, w] : weights_of(whole)) {
      SCOPED_TRACE(name);
      EXPECT_TENSOR_CLOSE(gathered.at(name), w, 1e-5, 1e-4);
    }
  }
}

TEST(VocabParallelLoss, EqualsCrossEntropyWithoutFullLogits) {
  auto tp = world();
  const int64_t vocab = 259, tokens = 10;
  auto logits = torch::randn({tokens, vocab}, generator_for(0, "logits")) * 3;
  auto targets = torch::randint(vocab, {tokens}, generator_for(0, "targets"));
  targets[2] = -100;  // padding counts for nothing
  targets[7] = -100;
  auto full = logits.clone().requires_grad_(true);
  auto want = torch::cross_entropy_loss(full, targets);
  want.backward();
  // This rank's vocabulary rows only.
  const int64_t first = split_offset(vocab, tp->rank(), tp->size());
  auto mine = shard(logits, 1, tp->rank(), tp->size()).clone().requires_grad_(true);
  auto loss = vocab_parallel_cross_entropy(mine, targets, first, tp);
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-6 * want.item<double>());
  loss.backward();
  EXPECT_TENSOR_CLOSE(mine.grad(), shard(full.grad(), 1, tp->rank(), tp->size()), 1e-7, 1e-5);
}

TEST(TensorParallelModel, RefusesWhatItCannotSplit) {
  auto c = tp_config(false);
  EXPECT_NO_THROW(check_tensor_parallel(c, 4));
  c.n_heads = 6;
  c.n_kv_heads = 6;
  try {
    check_tensor_parallel(c, 4);
    ADD_FAILURE() << "6 heads over 4 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("6 attention heads"), std::string::npos) << e.what();
  }
  c = tp_config(false);
  c.n_kv_heads = 2;  // 8 query heads split, 2 key/value heads do not
  EXPECT_THROW(check_tensor_parallel(c, 4), Error);
  c = tp_config(false);
  c.vocab_size = 257;  // vocabulary and d_ff split unevenly: accepted
  c.d_ff = 66;
  EXPECT_NO_THROW(check_tensor_parallel(c, 4));
}
