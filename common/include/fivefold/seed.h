#pragma once
/// @file seed.h
/// @brief Layout-independent initialisation: every parameter is drawn in full from a generator
/// seeded by (global seed, parameter name), then sliced to the local shard. Whatever the parallel
/// layout, rank r's shard is then bit-identical to the same slice of the single-device tensor.

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fivefold {

/// A 64-bit seed derived from the global seed and a parameter name (FNV-1a from its own offset
/// basis, then SplitMix64).
uint64_t seed_for(uint64_t global_seed, const std::string& name);

/// A CPU generator seeded with seed_for(global_seed, name).
at::Generator generator_for(uint64_t global_seed, const std::string& name);

/// The sizes of `count` parts of `n` items, the rule of torch::tensor_split and of the
/// Communicator's reduce_scatter: n / count each, and the first n % count parts one more (259
/// vocabulary rows over 2 ranks: 130, 129). Every layout splits by this one rule, so any rank can
/// compute any other rank's part without asking it.
std::vector<int64_t> split_sizes(int64_t n, int64_t count);

/// Where part `index` of `count` starts: the sum of the sizes before it.
int64_t split_offset(int64_t n, int64_t index, int64_t count);

/// Part `index` of `count` parts of `full` along `dim` (a view), sized by split_sizes.
torch::Tensor shard(const torch::Tensor& full, int64_t dim, int64_t index, int64_t count);

}  // namespace fivefold
