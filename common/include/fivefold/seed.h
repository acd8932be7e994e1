#pragma once
/// @file seed.h
/// @brief Layout-independent initialisation: every parameter is drawn in full from a generator
/// seeded by (global seed, parameter name), then sliced to the local shard. Whatever the parallel
/// layout, rank r's shard is then bit-identical to the same slice of the single-device tensor.

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace fivefold {

/// A 64-bit seed derived from the global seed and a parameter name (FNV-1a, then SplitMix64).
uint64_t seed_for(uint64_t global_seed, const std::string& name);

/// A CPU generator seeded with seed_for(global_seed, name).
at::Generator generator_for(uint64_t global_seed, const std::string& name);

/// Part `index` of `count` equal parts of `full` along `dim` (a view). Throws if the size along
/// `dim` is not divisible by `count`: parallel layers need equal shards.
torch::Tensor shard(const torch::Tensor& full, int64_t dim, int64_t index, int64_t count);

}  // namespace fivefold
