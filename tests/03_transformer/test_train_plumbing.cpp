// Chapter 03 training plumbing without a forward pass: the schedule and the optimizer's groups.

#include "03_transformer/train.h"
#include "fivefold/error.h"
#include "testing.h"

using namespace fivefold::ch03;

TEST(Schedule, WarmupThenCosine) {
  TrainConfig c;
  c.lr = 1.0;
  c.min_lr = 0.1;
  c.warmup_steps = 10;
  c.total_steps = 110;
  EXPECT_DOUBLE_EQ(learning_rate(c, 0), 0.1);      // (0 + 1) / 10
  EXPECT_DOUBLE_EQ(learning_rate(c, 9), 1.0);      // end of warm-up
  EXPECT_DOUBLE_EQ(learning_rate(c, 10), 1.0);     // cosine starts at the peak
  EXPECT_NEAR(learning_rate(c, 60), 0.55, 1e-12);  // half way: min + (lr - min) / 2
  EXPECT_NEAR(learning_rate(c, 110), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(learning_rate(c, 1000), 0.1);  // floor after the decay
  c.total_steps = 10;
  EXPECT_THROW(c.validate(), fivefold::Error);
  c.total_steps = 110;
  c.min_lr = 2.0;
  EXPECT_THROW(c.validate(), fivefold::Error);
}

TEST(Optimizer, DecayOnlyOnMatricesNotEmbeddingsByDefault) {
  ModelConfig m;
  m.n_layers = 2;
  Transformer model(m);
  TrainConfig c;
  auto optimizer = make_optimizer(model, c);
  ASSERT_EQ(optimizer->param_groups().size(), 2u);
  // 7 matrices a layer and the LM head decay; 5 norms and the embedding do not.
  EXPECT_EQ(optimizer->param_groups()[0].params().size(), 2u * 7 + 1);
  EXPECT_EQ(optimizer->param_groups()[1].params().size(), 2u * 2 + 1 + 1);
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(optimizer->param_groups()[0].options())
                       .weight_decay(),
                   0.1);
  EXPECT_DOUBLE_EQ(static_cast<torch::optim::AdamWOptions&>(optimizer->param_groups()[1].options())
                       .weight_decay(),
                   0.0);
  c.decay_embeddings = true;
  EXPECT_EQ(make_optimizer(model, c)->param_groups()[0].params().size(), 2u * 7 + 2);
}
