// Chapter 07 under data parallelism: each rank routes its own rows, and the bias update, fed the
// loads summed over the ranks, equals the update one process makes from the whole batch: every
// rank ends with the same biases. 1, 2 and 4 ranks.

#include "07_moe/moe.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch07;
using fivefold::testing::world;

TEST(MoeParallel, BiasUpdateFromSummedLoadsEqualsTheWholeBatchs) {
  ch03::ModelConfig model;
  model.d_model = 16;
  MoeConfig c;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 0;
  c.moe_intermediate_size = 8;
  c.n_group = c.topk_group = 1;
  c.bias_update_speed = 0.01;
  auto make = [&] {
    torch::manual_seed(0);  // the same weights on every rank and for the reference
    return Moe(model, c);
  };
  Moe whole = make(), mine = make();
  auto comm = world();
  const int64_t rows = 8 * comm->size();
  for (int step = 0; step < 20; ++step) {
    const auto batch = torch::randn({rows, 4, 16}, generator_for(step, "moe batch"));
    whole->forward(batch);
    mine->forward(batch.chunk(comm->size())[comm->rank()]);
    const ExpertLoad reference = whole->update_bias();
    const ExpertLoad summed = mine->update_bias(comm.get());
    EXPECT_TENSOR_EQ(summed.counts, reference.counts);
    EXPECT_EQ(summed.assignments, reference.assignments);
  }
  EXPECT_TENSOR_EQ(mine->gate->e_score_correction_bias, whole->gate->e_score_correction_bias);
  EXPECT_GT(whole->gate->e_score_correction_bias.abs().sum().item<double>(), 0);
}
