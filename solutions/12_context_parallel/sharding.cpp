// Chapter 12 plumbing: which tokens of a sequence each context-parallel rank holds.

#include "03_transformer/data.h"
#include "07_moe/moe.h"
#include "12_context_parallel/context_parallel.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch12 {

CpLayout parse_cp_layout(const std::string& name) {
  if (name == "contiguous") return CpLayout::Contiguous;
  if (name == "zigzag") return CpLayout::Zigzag;
  throw Error("--cp-layout: '" + name + "' is not a layout; choose contiguous or zigzag");
}

CpAttention parse_cp_attention(const std::string& name) {
  if (name == "ring") return CpAttention::Ring;
  if (name == "allgather") return CpAttention::AllGather;
  throw Error("--cp-attention: '" + name + "' is not a kernel; choose ring or allgather");
}

void check_context_parallel(int64_t seq, int64_t cp, CpLayout layout) {
  FIVEFOLD_CHECK(cp >= 1, "--cp must be >= 1, got ", cp);
  if (cp == 1) return;  // one rank holds the whole sequence, whatever the layout
  if (layout == CpLayout::Contiguous) {
    FIVEFOLD_CHECK(seq >= cp, "--cp ", cp, " (contiguous): the sequence of ", seq,
                   " tokens has fewer tokens than ranks");
  } else {
    FIVEFOLD_CHECK(seq % (2 * cp) == 0, "--cp ", cp, " --cp-layout zigzag: the sequence of ", seq,
                   " tokens must split into 2 x cp = ", 2 * cp,
                   " equal chunks (each rank takes one from each end, so that every rank has "
                   "the same causal work); use a multiple of ",
                   2 * cp, " or --cp-layout contiguous");
  }
}

void check_context_parallel(const ch03::ModelConfig& config, int64_t seq, int64_t cp,
                            CpLayout layout) {
  check_context_parallel(seq, cp, layout);
  if (cp == 1 || !ch07::has_routed_experts(config)) return;
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  FIVEFOLD_CHECK(moe.aux_loss_alpha == 0 && moe.capacity_factor == 0, "--cp ", cp,
                 ": each rank routes its part of the sequence on its own, but the Switch "
                 "auxiliary loss and expert capacity need the whole sequence's routing statistics "
                 "(global statistics come with chapter 13): use aux_loss_alpha 0 and dropless "
                 "routing, or --cp 1");
}

torch::Tensor shard_positions(int64_t seq, int64_t cp, int64_t rank, CpLayout layout) {
  check_context_parallel(seq, cp, layout);
  FIVEFOLD_CHECK(0 <= rank && rank < cp, "shard_positions: rank ", rank, " of ", cp);
  const auto kLong = torch::TensorOptions(torch::kLong);
  if (layout == CpLayout::Contiguous || cp == 1) {
    const int64_t first = split_offset(seq, rank, cp);
    return torch::arange(first, first + split_sizes(seq, cp)[static_cast<size_t>(rank)], kLong);
  }
  // Zig-zag: chunk r from the start, chunk 2·cp − 1 − r from the end. Under the causal mask a
  // query at position i does i + 1 units of work: an early chunk is cheap and a late one dear,
  // and each rank's pair costs the same.
  const int64_t chunk = seq / (2 * cp);
  return torch::cat({torch::arange(rank * chunk, (rank + 1) * chunk, kLong),
                     torch::arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, kLong)});
}

int64_t shard_size(int64_t seq, int64_t cp, int64_t rank, CpLayout layout) {
  check_context_parallel(seq, cp, layout);
  FIVEFOLD_CHECK(0 <= rank && rank < cp, "shard_size: rank ", rank, " of ", cp);
  if (layout == CpLayout::Contiguous || cp == 1) return split_sizes(seq, cp)[static_cast<size_t>(rank)];
  return 2 * (seq / (2 * cp));  // two chunks (zig-zag)
}

ch03::Batch shard_batch(const ch03::Batch& batch, int64_t cp, int64_t rank, CpLayout layout) {
  const int64_t seq = batch.inputs.size(1);
  auto mine = shard_positions(seq, cp, rank, layout);
  ch03::Batch part;
  part.inputs = batch.inputs.index_select(1, mine);
  part.targets = batch.targets.index_select(1, mine);
  // A batch already cut (positions given) would be cut again: its own positions are kept.
  part.positions = batch.positions.defined() ? batch.positions.index_select(0, mine) : mine;
  // The ranks' means are averaged: weighting each by cp·n_r/n makes the average the mean over
  // all n tokens, also when the parts are unequal (contiguous, seq % cp != 0).
  part.loss_weight =
      batch.loss_weight * static_cast<double>(cp * mine.size(0)) / static_cast<double>(seq);
  return part;
}

}  // namespace fivefold::ch12
