#pragma once
// Chapter 14's tests: the process-wide matmul kernel put back after a test that changes it, and
// what one more block keeps, measured.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "14_memory/precision.h"
#include "fivefold/dist.h"
#include "fivefold/memory.h"

namespace fivefold::ch14::testing {

/// Puts the process-wide matmul kernel back to at::mm (fp32) when it goes out of scope, so that a
/// test that multiplies in bf16 leaves the next one in fp32.
struct Fp32Afterwards {
  ~Fp32Afterwards() { use_precision(Precision::Fp32, nullptr); }
};

/// What each block added keeps for backward, measured: for 1 .. `most` blocks, the model
/// `build(blocks)` gives (its kernels installed) computes the loss of `batch`, and the storage
/// alive then (fivefold::MemoryTracker) is taken; backward runs after (on every rank the same
/// collectives). Entry i is what block i + 1 added: the growth from i + 1 blocks to i + 2.
inline std::vector<int64_t> kept_per_block(const std::function<ch03::Transformer(int64_t)>& build,
                                           const ch03::Batch& batch, int64_t most = 2) {
  std::vector<int64_t> alive;
  for (int64_t blocks = 1; blocks <= most; ++blocks) {
    ch03::Transformer model = build(blocks);
    MemoryTracker memory;
    auto loss = ch03::loss_of(model, batch);
    alive.push_back(memory.current_bytes());
    loss.backward();
  }
  std::vector<int64_t> growth;
  for (size_t i = 1; i < alive.size(); ++i) growth.push_back(alive[i] - alive[i - 1]);
  return growth;
}

/// A dispatcher around another (chapter 13's), recording how many rows this rank's experts
/// received in the last dispatch: what a MoE block keeps under ep follows them.
class RecordingDispatcher : public ch07::TokenDispatcher {
 public:
  RecordingDispatcher(std::shared_ptr<ch07::TokenDispatcher> inner, int64_t* received)
      : inner_(std::move(inner)), received_(received) {}
  ch07::DispatchedTokens dispatch(const torch::Tensor& x, const torch::Tensor& experts,
                                  const torch::Tensor& kept, int64_t n_experts) override {
    auto dispatched = inner_->dispatch(x, experts, kept, n_experts);
    *received_ = dispatched.tokens.size(0);
    return dispatched;
  }
  torch::Tensor combine(const torch::Tensor& outputs, const ch07::DispatchedTokens& dispatched,
                        const torch::Tensor& gates, int64_t tokens, int64_t k) override {
    return inner_->combine(outputs, dispatched, gates, tokens, k);
  }

 private:
  std::shared_ptr<ch07::TokenDispatcher> inner_;
  int64_t* received_;
};

/// Puts a RecordingDispatcher around the dispatcher of block `layer`'s MoE layer in `model`, writing
/// the rows its experts receive to `received`.
inline void record_received_rows(ch03::Transformer& model, int64_t layer, int64_t* received) {
  auto moe = std::dynamic_pointer_cast<ch07::MoeImpl>(model->block(layer).mlp);
  moe->dispatcher = std::make_shared<RecordingDispatcher>(moe->dispatcher, received);
}

/// A world of 4 ranks as tp 2 inside cp 2: rank 2c + t is rank t of its tp group and rank c of its
/// cp group.
struct TensorInsideContext {
  dist::CommunicatorPtr tp, cp;
};
inline TensorInsideContext tp2_inside_cp2(const dist::CommunicatorPtr& world) {
  const int rank = world->rank();
  return {world->split(rank / 2, rank % 2, "tp"), world->split(rank % 2, rank / 2, "cp")};
}

}  // namespace fivefold::ch14::testing
