// Chapter 08: ring all-gather, ring all-reduce, and the cost formulas.

#include <numeric>

#include "08_collectives/ring.h"
#include "fivefold/error.h"

namespace fivefold::ch08 {

std::vector<int64_t> chunk_sizes(int64_t rows, int n) {
  FIVEFOLD_CHECK(n >= 1 && rows >= 0, "chunk_sizes: need n >= 1 and rows >= 0");
  std::vector<int64_t> sizes(n, rows / n);
  for (int64_t i = 0; i < rows % n; ++i) ++sizes[i];
  return sizes;
}

torch::Tensor ring_all_gather(dist::Communicator& comm, const torch::Tensor& chunk,
                              const std::vector<int64_t>& dim0_sizes) {
  const int n = comm.size(), r = comm.rank();
  FIVEFOLD_CHECK(static_cast<int>(dim0_sizes.size()) == n && dim0_sizes[r] == chunk.size(0),
                 "ring_all_gather: dim0_sizes must list every rank's rows (this rank has ",
                 chunk.size(0), ")");
  auto shape = chunk.sizes().vec();
  shape[0] = std::accumulate(dim0_sizes.begin(), dim0_sizes.end(), int64_t{0});
  torch::Tensor out = torch::empty(shape, chunk.options());
  std::vector<torch::Tensor> parts;  // views of `out`, one per rank
  int64_t offset = 0;
  for (int i = 0; i < n; ++i) {
    parts.push_back(out.narrow(0, offset, dim0_sizes[i]));
    offset += dim0_sizes[i];
  }
  parts[r].copy_(chunk);
  auto mod = [n](int i) { return ((i % n) + n) % n; };
  for (int t = 0; t < n - 1; ++t) {
    // Forward the chunk received last step (our own at t = 0); receive the next one.
    torch::Tensor incoming = torch::empty_like(parts[mod(r - t - 1)]);
    comm.send_recv(parts[mod(r - t)], (r + 1) % n, incoming, mod(r - 1));
    parts[mod(r - t - 1)].copy_(incoming);
  }
  return out;
}

torch::Tensor ring_all_reduce(dist::Communicator& comm, const torch::Tensor& tensor) {
  const auto sizes = chunk_sizes(tensor.size(0), comm.size());
  return ring_all_gather(comm, ring_reduce_scatter(comm, tensor), sizes);
}

int64_t ring_reduce_scatter_bytes(const torch::Tensor& tensor, int rank, int n) {
  const int64_t row_bytes =
      tensor.size(0) == 0 ? 0 : tensor.numel() / tensor.size(0) * tensor.element_size();
  return (tensor.size(0) - chunk_sizes(tensor.size(0), n)[rank]) * row_bytes;
}

int64_t ring_all_gather_bytes(const std::vector<int64_t>& dim0_sizes, int64_t row_bytes, int rank) {
  const int n = static_cast<int>(dim0_sizes.size());
  const int64_t rows = std::accumulate(dim0_sizes.begin(), dim0_sizes.end(), int64_t{0});
  return (rows - dim0_sizes[(rank + 1) % n]) * row_bytes;
}

double ring_time(double alpha, double beta, double bytes, int n, bool all_reduce) {
  const double one_pass = (n - 1) * (alpha + bytes / n / beta);
  return all_reduce ? 2 * one_pass : one_pass;
}

double bus_bandwidth(double algorithm_bandwidth, int n, bool all_reduce) {
  const double share = static_cast<double>(n - 1) / n;
  return algorithm_bandwidth * (all_reduce ? 2 * share : share);
}

}  // namespace fivefold::ch08
