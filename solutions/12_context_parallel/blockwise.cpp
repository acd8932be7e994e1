// Chapter 12: attention one block of keys at a time, forward and backward.

#include <algorithm>
#include <cmath>

#include "03_transformer/heads.h"
#include "12_context_parallel/attention.h"
#include "fivefold/error.h"

namespace fivefold::ch12 {

namespace {

using ch03::expand_heads;  // grouped-query heads (03_transformer/heads.h)
using ch03::fold_heads;

// scale·q·kᵀ with the keys a query may not see (a later position) at −inf: [b, h, seq_q, seq_k].
torch::Tensor masked_scores(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                            double scale) {
  auto scores = torch::matmul(q, expand_heads(k, q.size(1)).transpose(-2, -1)) * scale;
  auto later = k_positions.unsqueeze(0) > q_positions.unsqueeze(1);  // [seq_q, seq_k]
  return scores.masked_fill(later, -INFINITY);
}

// exp(scores − lse) is each probability; a query that sees no key has lse −inf and every score
// −inf: subtracting 0 instead keeps its probabilities exp(−inf) = 0 rather than NaN.
torch::Tensor probabilities(const torch::Tensor& scores, const torch::Tensor& lse) {
  return (scores - lse.masked_fill(lse == -INFINITY, 0.0).unsqueeze(-1)).exp();
}

}  // namespace

ch03::AttentionOutput attend_block(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& q_positions,
                                   const torch::Tensor& k_positions, double scale) {
  auto scores = masked_scores(q, k, q_positions, k_positions, scale);
  auto lse = torch::logsumexp(scores, -1);  // −inf where a query sees none of these keys
  auto p = probabilities(scores, lse);
  return {torch::matmul(p, expand_heads(v, q.size(1))), lse};
}

bool block_visible(const torch::Tensor& q_positions, const torch::Tensor& k_positions) {
  if (q_positions.numel() == 0 || k_positions.numel() == 0) return false;
  return k_positions.min().item<int64_t>() <= q_positions.max().item<int64_t>();
}

BlockGradients attend_block_backward(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& q_positions,
                                     const torch::Tensor& k_positions, double scale,
                                     const torch::Tensor& grad_output, const torch::Tensor& lse,
                                     const torch::Tensor& delta) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  auto p = probabilities(masked_scores(q, k, q_positions, k_positions, scale), lse);
  auto values = expand_heads(v, heads);
  auto grad_v = torch::matmul(p.transpose(-2, -1), grad_output);
  // Softmax's backward with the row sums Σ_j p_j·(dO·v_j) = Σ_d dO·O precomputed (delta).
  auto grad_scores =
      p * (torch::matmul(grad_output, values.transpose(-2, -1)) - delta.unsqueeze(-1));
  auto grad_q = torch::matmul(grad_scores, expand_heads(k, heads)) * scale;
  auto grad_k = torch::matmul(grad_scores.transpose(-2, -1), q) * scale;
  return {grad_q, fold_heads(grad_k, kv_heads), fold_heads(grad_v, kv_heads)};
}

std::vector<std::pair<int64_t, int64_t>> position_runs(const torch::Tensor& positions,
                                                       int64_t tile) {
  FIVEFOLD_CHECK(tile > 0, "position_runs: a tile holds at least one position, got ", tile);
  std::vector<std::pair<int64_t, int64_t>> runs;
  const auto p = positions.contiguous();
  const auto* x = p.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    if (i > 0 && x[i] == x[i - 1] + 1 && runs.back().second < tile) {
      ++runs.back().second;
    } else {
      runs.emplace_back(i, 1);
    }
  }
  return runs;
}

int64_t visible_scores(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                       int64_t tile) {
  int64_t scores = 0;
  const auto q_runs = position_runs(q_positions, tile);
  for (const auto& [k_first, k_length] : position_runs(k_positions, tile)) {
    const auto keys = k_positions.narrow(0, k_first, k_length);
    for (const auto& [q_first, q_length] : q_runs) {
      if (block_visible(q_positions.narrow(0, q_first, q_length), keys))
        scores += q_length * k_length;
    }
  }
  return scores;
}

RunAccumulator::RunAccumulator(const torch::Tensor& q, const torch::Tensor& q_positions,
                               double scale, int64_t tile)
    : q_(q),
      q_positions_(q_positions),
      scale_(scale),
      tile_(tile),
      runs_(position_runs(q_positions, tile)) {
  partial_.resize(runs_.size());
}

void RunAccumulator::add(const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& k_positions) {
  for (const auto& [k_first, k_length] : position_runs(k_positions, tile_)) {
    const auto keys = k_positions.narrow(0, k_first, k_length);
    for (size_t i = 0; i < runs_.size(); ++i) {
      const auto [q_first, q_length] = runs_[i];
      const auto queries = q_positions_.narrow(0, q_first, q_length);
      if (!block_visible(queries, keys)) continue;  // every key after every query
      auto part = attend_block(q_.narrow(2, q_first, q_length), k.narrow(2, k_first, k_length),
                               v.narrow(2, k_first, k_length), queries, keys, scale_);
      partial_[i] = partial_[i].output.defined() ? merge_attention(partial_[i], part) : part;
    }
  }
}

ch03::AttentionOutput RunAccumulator::result(int64_t value_dim) const {
  std::vector<torch::Tensor> outputs, lses;
  for (size_t i = 0; i < runs_.size(); ++i) {
    if (partial_[i].output.defined()) {
      outputs.push_back(partial_[i].output);
      lses.push_back(partial_[i].lse);
      continue;
    }
    const int64_t length = runs_[i].second;  // saw no key at all
    outputs.push_back(torch::zeros({q_.size(0), q_.size(1), length, value_dim}, q_.options()));
    lses.push_back(torch::full({q_.size(0), q_.size(1), length}, -INFINITY, q_.options()));
  }
  if (outputs.empty()) {  // no queries
    return {torch::zeros({q_.size(0), q_.size(1), 0, value_dim}, q_.options()),
            torch::zeros({q_.size(0), q_.size(1), 0}, q_.options())};
  }
  return {torch::cat(outputs, 2), torch::cat(lses, 2)};
}

void add_block_gradients(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                         double scale, int64_t tile, const torch::Tensor& grad_output,
                         const torch::Tensor& lse, const torch::Tensor& delta,
                         torch::Tensor& grad_q, torch::Tensor& grad_k, torch::Tensor& grad_v) {
  const auto q_runs = position_runs(q_positions, tile);
  for (const auto& [k_first, k_length] : position_runs(k_positions, tile)) {
    const auto keys = k_positions.narrow(0, k_first, k_length);
    for (const auto& [q_first, q_length] : q_runs) {
      const auto queries = q_positions.narrow(0, q_first, q_length);
      if (!block_visible(queries, keys)) continue;
      const auto g = attend_block_backward(
          q.narrow(2, q_first, q_length), k.narrow(2, k_first, k_length),
          v.narrow(2, k_first, k_length), queries, keys, scale,
          grad_output.narrow(2, q_first, q_length), lse.narrow(2, q_first, q_length),
          delta.narrow(2, q_first, q_length));
      grad_q.narrow(2, q_first, q_length).add_(g.dq);
      grad_k.narrow(2, k_first, k_length).add_(g.dk);
      grad_v.narrow(2, k_first, k_length).add_(g.dv);
    }
  }
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class BlockwiseAttention : public torch::autograd::Function<BlockwiseAttention> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& q_positions,
                               const torch::Tensor& k_positions, double scale, int64_t block) {
    RunAccumulator total(q, q_positions, scale, block);  // query tiles as large as key blocks
    for (int64_t first = 0; first < k.size(2); first += block) {
      const int64_t length = std::min(block, k.size(2) - first);
      total.add(k.narrow(2, first, length), v.narrow(2, first, length),
                k_positions.narrow(0, first, length));
    }
    const auto result = total.result(v.size(3));
    ctx->save_for_backward({q, k, v, q_positions, k_positions, result.output, result.lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["block"] = block;
    ctx->mark_non_differentiable({result.lse});
    return {result.output, result.lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &q_positions = saved[3],
               &k_positions = saved[4], &output = saved[5], &lse = saved[6];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto& grad_output = grads[0];
    auto delta = (grad_output * output).sum(-1);  // [batch, heads, seq_q]
    auto grad_q = torch::zeros_like(q), grad_k = torch::zeros_like(k),
         grad_v = torch::zeros_like(v);
    for (int64_t first = 0; first < k.size(2); first += block) {
      const int64_t length = std::min(block, k.size(2) - first);
      auto grad_k_block = grad_k.narrow(2, first, length),
           grad_v_block = grad_v.narrow(2, first, length);
      add_block_gradients(q, k.narrow(2, first, length), v.narrow(2, first, length), q_positions,
                          k_positions.narrow(0, first, length), scale, block, grad_output, lse,
                          delta, grad_q, grad_k_block, grad_v_block);
    }
    return {grad_q, grad_k, grad_v, {}, {}, {}, {}};
  }
};

}  // namespace

ch03::AttentionOutput blockwise_attention(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const torch::Tensor& q_positions,
                                          const torch::Tensor& k_positions, double scale,
                                          int64_t block) {
  FIVEFOLD_CHECK(block > 0, "blockwise attention: the block must hold at least one key, got ",
                 block);
  FIVEFOLD_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(1) % k.size(1) == 0 &&
                     q_positions.size(0) == q.size(2) && k_positions.size(0) == k.size(2),
                 "blockwise attention: q ", q.sizes(), ", k ", k.sizes(), ", positions ",
                 q_positions.sizes(), " and ", k_positions.sizes(), " do not fit together");
  auto out = BlockwiseAttention::apply(q, k, v, q_positions, k_positions, scale, block);
  return {out[0], out[1]};
}

BlockwiseAttentionKernel::BlockwiseAttentionKernel(int64_t block) : block_(block) {
  FIVEFOLD_CHECK(block > 0, "blockwise attention: the block must hold at least one key, got ",
                 block);
}

ch03::AttentionOutput BlockwiseAttentionKernel::compute(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& q_positions, const torch::Tensor& k_positions, double scale) const {
  return blockwise_attention(q, k, v, q_positions, k_positions, scale, block_);
}

}  // namespace fivefold::ch12
