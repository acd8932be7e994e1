// Chapter 12: the formulas of context parallelism's communication.

#include "12_context_parallel/plan.h"

#include <algorithm>

#include "fivefold/error.h"

namespace fivefold::ch12 {

CpTraffic context_parallel_traffic(int64_t cp, int64_t rank, int64_t rows, int64_t seq,
                                   int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                                   CpLayout layout, CpAttention attention) {
  CpTraffic t;
  const int64_t per_token = rows * kv_heads * (key_dim + value_dim) * 4;
  // Every rank's key count, then every rank's key positions (int64).
  t.all_gather = {2, cp * 8 + seq * 8};
  if (attention == CpAttention::AllGather) {
    t.all_gather.calls += 1;
    t.all_gather.payload_bytes += per_token * seq;
    t.reduce_scatter = {1, per_token * seq};
    t.forward_payload_bytes = t.all_gather.payload_bytes;
    return t;
  }
  t.forward_payload_bytes = t.all_gather.payload_bytes;
  if (cp == 1) return t;  // the ring of one rank sends nothing
  const int64_t next = shard_size(seq, cp, (rank + 1) % cp, layout);
  // Forward and backward each pass on every block but the one of rank r + 1 (the last held);
  // backward passes every block's gradient, one hop each, cp hops in all.
  t.send_recv = {2 * (cp - 1) + cp, per_token * (2 * (seq - next) + seq)};
  t.forward_payload_bytes += per_token * (seq - next);
  return t;
}

int64_t attention_scores(int64_t cp, int64_t rank, int64_t seq, CpLayout layout,
                         CpAttention attention) {
  const auto queries = shard_positions(seq, cp, rank, layout);
  int64_t scores = 0;
  if (attention == CpAttention::Ring) {
    const int64_t tile = ring_tile(queries.size(0));
    for (int64_t holder = 0; holder < cp; ++holder)
      scores += visible_scores(queries, shard_positions(seq, cp, holder, layout), tile);
    return scores;
  }
  std::vector<torch::Tensor> every;  // the gathered keys' positions, rank 0's first
  for (int64_t j = 0; j < cp; ++j) every.push_back(shard_positions(seq, cp, j, layout));
  const auto keys = torch::cat(every);
  const int64_t block = kAllGatherBlock;
  for (int64_t first = 0; first < seq; first += block)
    scores += visible_scores(queries, keys.narrow(0, first, std::min(block, seq - first)), block);
  return scores;
}

int64_t cp_block_activation_bytes(const ch02::TransformerShape& shape, int64_t cp, int64_t rank,
                                  int64_t rows, int64_t seq, CpLayout layout,
                                  CpAttention attention) {
  FIVEFOLD_CHECK(
      shape.gated_mlp && !shape.layer_norm && !shape.biases && shape.learned_positions == 0,
      "activation memory: the formula is for Llama-shaped models (RMSNorm, SwiGLU, "
      "RoPE, no biases), the model this course trains");
  const int64_t mine = shard_size(seq, cp, rank, layout), n = rows * mine;
  const int64_t h = shape.d_model, heads = shape.n_heads, kv = shape.n_kv_heads, d = shape.head_dim,
                f = shape.d_ff;
  // Per token, in floats: the norms, the residual sum and the block's output, SwiGLU (chapter
  // 11); attention's q, output, LSE and o_proj's input; the ring's own keys and values.
  int64_t per_token = 8 * h + 4 * f + 2 + 3 * heads * d + heads;
  if (attention == CpAttention::Ring) per_token += 2 * kv * d;
  int64_t block = 4 * n * per_token;
  if (attention == CpAttention::AllGather) block += 4 * rows * kv * seq * 2 * d;
  block += 4 * mine * d;  // RoPE's cos and sin rows, [n_r, d/2] each
  block += 8 * seq;       // every rank's key positions
  return block;
}

int64_t cp_activation_bytes(const ch02::TransformerShape& shape, int64_t cp, int64_t rank,
                            int64_t rows, int64_t seq, CpLayout layout, CpAttention attention) {
  const int64_t block = cp_block_activation_bytes(shape, cp, rank, rows, seq, layout, attention);
  const int64_t n = rows * shard_size(seq, cp, rank, layout), h = shape.d_model;
  // The embedding's output; the final norm and log-softmax of the logits; the loss and nll's
  // total weight.
  return 4 * n * h + shape.n_layers * block + 4 * n * (3 * h + 1 + shape.vocab_size) + 8;
}

}  // namespace fivefold::ch12
