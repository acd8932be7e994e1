// Chapter 09: ZeRO-1 and ZeRO-2 reproduce single-device AdamW training, keep exactly the bytes the
// ZeRO formulas say, and send exactly what DDP sends. Every rank also runs the single-device
// reference (chapter 03's train_step on the whole global batch) and compares. 1, 2, 4 ranks on
// MPI; 2 on Gloo.

#include <cmath>

#include "03_transformer/train.h"
#include "09_data_parallel/zero.h"
#include "fivefold/comm_stats.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::ch09;
using fivefold::ch09::testing::global_batches;
using fivefold::ch09::testing::small_config;
using fivefold::ch09::testing::train_config;
using fivefold::ch09::testing::train_on_one_device;
using fivefold::testing::world;
namespace dist = fivefold::dist;

namespace {
Transformer zero(bool tied, int stage, int steps, ZeroMemory* memory = nullptr) {
  auto comm = world();
  Transformer model(small_config(tied));
  ZeroOptimizer optimizer(model.ptr(), comm, stage, train_config());
  for (int step = 0; step < steps; ++step) {
    optimizer.zero_grad();
    loss_of(model, global_batches().batch(step, comm->rank(), comm->size())).backward();
    optimizer.step(step);
  }
  if (memory) *memory = optimizer.memory();
  return model;
}
}  // namespace

TEST(Zero, Stages1And2MatchOneDeviceAfterThreeSteps) {
  for (bool tied : {false, true}) {
    auto expected = train_on_one_device(Transformer(small_config(tied)), 3);
    for (int stage : {1, 2}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (tied ? ", tied" : ""));
      auto got = zero(tied, stage, 3);
      auto want = expected->named_parameters();
      for (const auto& item : got->named_parameters()) {
        SCOPED_TRACE(item.key());
        // As for DDP: fp32 averaging order, magnified by Adam where gradients are near zero.
        EXPECT_TENSOR_CLOSE(item.value(), want[item.key()], 1e-5, 1e-5);
      }
    }
  }
}

TEST(Zero, KeepsExactlyTheBytesOfTheFormulas) {
  const int64_t n = world()->size();
  Transformer probe(small_config(false));
  int64_t psi = 0;
  for (const auto& p : probe->parameters()) psi += p.numel();
  const int64_t shard = (psi + n - 1) / n;  // Ψ/N, padded up to whole numbers
  ZeroMemory one, two;
  zero(false, 1, 1, &one);
  zero(false, 2, 1, &two);
  // fp32 (notes/09_data_parallel.md): stage 1 = 4Ψ + 4Ψ + 8Ψ/N, stage 2 = 4Ψ + 4Ψ/N + 8Ψ/N.
  for (const auto& [measured, stage] : {std::pair<ZeroMemory, int>{one, 1}, {two, 2}}) {
    const ZeroMemory formula = zero_memory_formula(psi, n, stage);
    EXPECT_EQ(measured.parameters, formula.parameters) << "stage " << stage;
    EXPECT_EQ(measured.gradients, formula.gradients) << "stage " << stage;
    EXPECT_EQ(measured.optimizer, formula.optimizer) << "stage " << stage;
  }
  EXPECT_EQ(one.gradients, 4 * psi);
  EXPECT_EQ(two.gradients, 4 * shard);
  EXPECT_EQ(two.optimizer, 8 * shard);
}

// What a step leaves allocated is what the formulas count and nothing beside (but a flag a
// parameter): stage 1 keeps its reduced shard in its own range of the full gradients (no [Ψ/N]
// beside them), stage 2 the shard alone (4Ψ/N; the full gradients, allocated before, go).
// Measured from the allocator.
TEST(Zero, AStepKeepsNothingTheFormulasDoNotCount) {
  const int64_t n = world()->size();
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto comm = world();
    Transformer model(small_config(false));
    ZeroOptimizer optimizer(model.ptr(), comm, stage, train_config());
    optimizer.zero_grad();
    loss_of(model, global_batches().batch(0, comm->rank(), comm->size())).backward();
    fivefold::MemoryTracker kept;
    optimizer.step(0);
    // Besides: one float a parameter, whether it has had a gradient (had_gradient_).
    const auto flags = static_cast<int64_t>(4 * model->parameters().size());
    EXPECT_EQ(kept.current_bytes(), flags + (stage == 1 ? 0 : 4 * optimizer.shard_numel()));
    EXPECT_EQ(optimizer.memory().gradients,
              zero_memory_formula(optimizer.numel(), n, stage).gradients);
  }
}

TEST(Zero, SendsWhatDdpSends) {
  const int64_t n = world()->size();
  Transformer probe(small_config(false));
  int64_t psi = 0;
  for (const auto& p : probe->parameters()) psi += p.numel();
  const int64_t shard = (psi + n - 1) / n;
  for (int stage : {1, 2}) {
    dist::reset_comm_stats();
    zero(false, stage, 1);
    const auto rs = dist::comm_counts(world()->name(), dist::Op::ReduceScatter);
    const auto ag = dist::comm_counts(world()->name(), dist::Op::AllGather);
    // Measured: reduce-scatter the gradients, all-gather the parameters, 4·(padded Ψ) payload
    // each. Modelled on the wire: (N−1)/N of each, 2(N−1)/N·4Ψ together, an all-reduce's worth:
    // the same as DDP.
    EXPECT_EQ(rs.calls, 1);
    EXPECT_EQ(ag.calls, 1);
    EXPECT_EQ(rs.payload_bytes, 4 * shard * n);
    EXPECT_EQ(ag.payload_bytes, 4 * shard * n);
    EXPECT_DOUBLE_EQ(rs.modelled_wire_bytes + ag.modelled_wire_bytes,
                     2.0 * static_cast<double>(n - 1) / n * 4.0 * static_cast<double>(shard * n));
  }
}

namespace {
// A model with a frozen parameter, one used only from step 2 on, and one never used.
struct OddNetImpl : torch::nn::Module {
  OddNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 3));
    late = register_parameter("late", torch::ones({3}));
    frozen = register_parameter("frozen", torch::ones({3}), /*requires_grad=*/false);
    unused = register_parameter("unused", torch::ones({4, 2}));
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_late) {
    auto y = b(torch::tanh(a(x))) * frozen;
    return use_late ? y * late : y;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor late, frozen, unused;
};
TORCH_MODULE(OddNet);

// Three steps on the global batch; `zero_stage` 0: torch's AdamW with make_optimizer's grouping.
OddNet train_odd(int zero_stage) {
  torch::manual_seed(3);
  OddNet net;
  auto t = train_config();
  std::unique_ptr<ZeroOptimizer> zero;
  std::unique_ptr<torch::optim::AdamW> adam;
  if (zero_stage > 0) {
    zero = std::make_unique<ZeroOptimizer>(net.ptr(), world(), zero_stage, t);
  } else {
    std::vector<torch::Tensor> decay, no_decay;
    for (auto& p : net->parameters()) (p.dim() == 2 ? decay : no_decay).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(
        decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(t.lr)
                                                                .betas({t.beta1, t.beta2})
                                                                .eps(t.eps)
                                                                .weight_decay(t.weight_decay)));
    groups.emplace_back(
        no_decay, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(t.lr)
                                                                   .betas({t.beta1, t.beta2})
                                                                   .eps(t.eps)
                                                                   .weight_decay(0.0)));
    adam = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(t.lr));
  }
  auto generator = fivefold::generator_for(1, "odd");
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({8, 6}, generator);
    const int rank = zero ? world()->rank() : 0, size = zero ? world()->size() : 1;
    if (zero) {
      zero->zero_grad();
      net->forward(x.chunk(size)[rank], step > 0).pow(2).mean().backward();
      zero->step(step);
    } else {
      adam->zero_grad();
      net->forward(x, step > 0).pow(2).mean().backward();
      clip_gradients(net->parameters(), t.grad_clip);
      for (auto& group : adam->param_groups())
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(t, step));
      adam->step();
    }
  }
  return net;
}
}  // namespace

TEST(Zero, FrozenLateAndUnusedParametersBehaveAsWithTorchsAdamW) {
  auto reference = train_odd(0);
  for (int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto got = train_odd(stage);
    EXPECT_TENSOR_EQ(got->unused, reference->unused);  // never stepped: no decay either
    EXPECT_TENSOR_EQ(got->frozen, reference->frozen);
    EXPECT_TENSOR_CLOSE(got->late, reference->late, 1e-6, 1e-5);  // 2 steps, not 3
    EXPECT_TENSOR_CLOSE(got->a->weight, reference->a->weight, 1e-6, 1e-5);
    EXPECT_TENSOR_CLOSE(got->b->bias, reference->b->bias, 1e-6, 1e-5);
  }
}

TEST(Zero, FormulaByHand) {
  // The paper's example in fp32 bytes: Ψ = 7.5e9 over N_d = 64.
  const int64_t psi = 7'500'000'000;
  EXPECT_EQ(zero_memory_formula(psi, 64, 0).optimizer, 8 * psi);
  const auto three = zero_memory_formula(psi, 64, 3);
  EXPECT_EQ(three.parameters + three.gradients + three.optimizer, 16 * ((psi + 63) / 64));
  const auto one = zero_memory_formula(psi, 64, 1);
  EXPECT_EQ(one.parameters + one.gradients + one.optimizer, 8 * psi + 8 * ((psi + 63) / 64));
}
