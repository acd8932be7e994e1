// The training run on several processes (runtime/run.h): the evaluation shares its held-out
// batches and exact-match examples out over the processes, each evaluating only its share, and
// every process reports the figures one process gets from the same whole model, bit for bit.
// Shown to fail with every process evaluating everything again, as before (the share counts).

#include <memory>
#include <utility>

#include "03_transformer/evaluate.h"
#include "09_data_parallel/step.h"
#include "runtime/run.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::runtime;
using fivefold::testing::world;

namespace {

// What the attention layers ran without gradients (an evaluation: training runs with them),
// around chapter 03's kernel: calls on whole held-out batches of `rows` rows, and prompts fed to
// the generation (one row, more than one token: the first call of each example's generation,
// later tokens come one at a time).
struct Calls {
  int64_t batches = 0, prompts = 0;
};

class CountingKernel : public CausalAttentionKernel {
 public:
  CountingKernel(std::shared_ptr<Calls> calls, int64_t rows)
      : calls_(std::move(calls)), rows_(rows) {}

 protected:
  AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                          double scale) const override {
    if (!torch::GradMode::is_enabled()) {
      if (q.size(0) == rows_) ++calls_->batches;
      if (q.size(0) == 1 && q.size(2) > 1) ++calls_->prompts;
    }
    return CausalAttentionKernel::compute(q, k, v, q_positions, k_positions, scale);
  }

 private:
  std::shared_ptr<Calls> calls_;
  int64_t rows_;
};

// After the last training step, before the run's evaluation: this process alone evaluates the
// same whole model (ch03's functions), then the counts start again from zero.
class OneProcessEvaluation : public RunObserver {
 public:
  OneProcessEvaluation(const RunConfig& c, std::shared_ptr<Calls> calls)
      : c_(c), calls_(std::move(calls)) {}
  void step_ended(int64_t step, TrainingStep& trainer, const StepResult&) override {
    if (step + 1 != c_.steps) return;
    auto data = load_datasets(c_.data, c_.seq_len);
    const BatchSampler held_out(data.second, c_.seq_len, c_.batch, c_.data.seed + 1);
    loss = evaluate_loss(trainer.full_model(), held_out, c_.eval_batches);
    exact =
        exact_match(trainer.full_model(), c_.data.seed, Split::HeldOut, c_.exact_match_examples);
    *calls_ = Calls{};
  }
  LossReport loss;
  ExactMatchReport exact;

 private:
  RunConfig c_;
  std::shared_ptr<Calls> calls_;
};

// How many of 0 .. count-1 are this process's: rank, rank + size, ...
int64_t share(int64_t count, int rank, int size) {
  return count > rank ? (count - rank + size - 1) / size : 0;
}

}  // namespace

TEST(SharedEvaluation, EachProcessEvaluatesItsShareAndAllReportTheOneProcesssFigures) {
  auto comm = world();
  RunConfig c;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.d_ff = 64;
  c.train.warmup_steps = 1;
  c.data.synthetic_examples = 300;
  c.seq_len = 16;
  c.batch = 8;
  c.steps = 2;
  c.eval_batches = 5;          // not a multiple of 2 or 4 ranks: shares of 3 and 2, or 2, 1, 1, 1
  c.exact_match_examples = 7;  // likewise
  c.fast = false;              // chapter 03's kernel, counted
  c.peak_gflops = 100;
  c.progress = false;
  c.placement = {comm->rank(), comm->size(), comm->size(), comm->rank() == 0, 0, comm};
  auto calls = std::make_shared<Calls>();
  c.make_step = [&](Transformer model, const TrainConfig& train) {
    model->set_attention_kernel(std::make_shared<CountingKernel>(calls, c.batch));
    return std::make_unique<fivefold::ch09::DataParallelStep>(std::move(model), comm, 0, train);
  };
  OneProcessEvaluation one(c, calls);
  c.observers = {&one};

  const RunResult got = run_training(c);

  EXPECT_EQ(got.eval.loss, one.loss.loss);  // exactly: the same sums, added in the same order
  EXPECT_EQ(got.eval.tokens, one.loss.tokens);
  EXPECT_EQ(got.exact.total, one.exact.total);
  EXPECT_EQ(got.exact.correct, one.exact.correct);
  const int64_t layers = c.model.n_layers;
  EXPECT_EQ(calls->batches, layers * share(c.eval_batches, comm->rank(), comm->size()))
      << "held-out batches this process evaluated, times the layers";
  EXPECT_EQ(calls->prompts, layers * share(c.exact_match_examples, comm->rank(), comm->size()))
      << "examples this process generated for, times the layers";
}
