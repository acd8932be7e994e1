#include "fivefold/seed.h"

#include <ATen/CPUGeneratorImpl.h>

#include "fivefold/error.h"

namespace fivefold {

uint64_t seed_for(uint64_t global_seed, const std::string& name) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the name's bytes
  for (unsigned char c : name) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  uint64_t z =
      hash ^ (global_seed + 0x9e3779b97f4a7c15ull);  // SplitMix64 finaliser mixes in the seed
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

at::Generator generator_for(uint64_t global_seed, const std::string& name) {
  return at::make_generator<at::CPUGeneratorImpl>(seed_for(global_seed, name));
}

torch::Tensor shard(const torch::Tensor& full, int64_t dim, int64_t index, int64_t count) {
  FIVEFOLD_CHECK(count >= 1 && index >= 0 && index < count, "shard: part ", index, " of ", count,
                 " does not exist");
  const int64_t d = dim < 0 ? dim + full.dim() : dim;
  FIVEFOLD_CHECK(d >= 0 && d < full.dim(), "shard: dimension ", dim, " out of range for shape ",
                 full.sizes());
  FIVEFOLD_CHECK(full.size(d) % count == 0, "shard: size ", full.size(d), " of dimension ", d,
                 " is not divisible into ", count, " equal parts");
  const int64_t part = full.size(d) / count;
  return full.narrow(d, index * part, part);
}

}  // namespace fivefold
