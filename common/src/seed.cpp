#include "fivefold/seed.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>

#include "fivefold/error.h"

namespace fivefold {

uint64_t seed_for(uint64_t global_seed, const std::string& name) {
  // FNV-1a over the name's bytes, from 1469598103934665603: the published offset basis with its
  // last digit lost (14695981039346656037, which io::file_fingerprint starts from). Still a
  // hash of the name; kept, since every initialisation the tests and checkpoints pin follows it.
  uint64_t hash = 1469598103934665603ull;
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

std::vector<int64_t> split_sizes(int64_t n, int64_t count) {
  FIVEFOLD_CHECK(count >= 1 && n >= 0, "split_sizes: cannot split ", n, " items into ", count,
                 " parts");
  std::vector<int64_t> sizes(static_cast<size_t>(count), n / count);
  for (int64_t i = 0; i < n % count; ++i) sizes[static_cast<size_t>(i)] += 1;
  return sizes;
}

int64_t split_offset(int64_t n, int64_t index, int64_t count) {
  FIVEFOLD_CHECK(index >= 0 && index <= count, "split_offset: part ", index, " of ", count,
                 " does not exist");
  // The first n % count parts hold one item more than the others.
  return index * (n / count) + std::min(index, n % count);
}

torch::Tensor shard(const torch::Tensor& full, int64_t dim, int64_t index, int64_t count) {
  FIVEFOLD_CHECK(count >= 1 && index >= 0 && index < count, "shard: part ", index, " of ", count,
                 " does not exist");
  const int64_t d = dim < 0 ? dim + full.dim() : dim;
  FIVEFOLD_CHECK(d >= 0 && d < full.dim(), "shard: dimension ", dim, " out of range for shape ",
                 full.sizes());
  const int64_t n = full.size(d);
  return full.narrow(d, split_offset(n, index, count), split_sizes(n, count)[index]);
}

}  // namespace fivefold
