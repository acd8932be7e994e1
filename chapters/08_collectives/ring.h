#pragma once
/// @file ring.h
/// @brief Chapter 08: the ring algorithms behind the collectives, built from send/recv. N ranks in
/// a ring, each sending only to its right neighbour (rank + 1) and receiving only from its left
/// (rank − 1): every link is busy at every step, and each rank sends (N − 1)/N of the data for a
/// reduce-scatter or an all-gather, 2(N − 1)/N for an all-reduce: the bandwidth-optimal volumes.
///
/// Chunks follow the Communicator's convention: the rows (dim 0) of a tensor split like
/// torch::tensor_split into N parts, the first n % N parts one row longer; chunk i is rank i's.

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "fivefold/dist.h"

namespace fivefold::ch08 {

/// Row counts of the N chunks of `rows` rows (tensor_split: the first rows % N get one more).
std::vector<int64_t> chunk_sizes(int64_t rows, int n);

/// Ring reduce-scatter (sum), from send_recv only: N − 1 steps; at step t this rank r sends its
/// running sum of chunk (r − t − 1) mod N to the right and adds the left neighbour's running sum
/// of chunk (r − t − 2) mod N into its own. After the last step chunk r is complete: every rank's
/// contribution has been added once. Returns chunk r of the sum over ranks of `tensor` (the same
/// shape on every rank). Equals comm.reduce_scatter(tensor). **Exercise** (README).
torch::Tensor ring_reduce_scatter(dist::Communicator& comm, const torch::Tensor& tensor);

/// Ring all-gather, from send_recv only: N − 1 steps; at step t rank r forwards chunk
/// (r − t) mod N to the right and receives chunk (r − t − 1) mod N from the left. `chunk` is this
/// rank's rows; `dim0_sizes` every rank's row count (the same list everywhere). Returns the
/// concatenation in rank order; equals comm.all_gather(chunk, dim0_sizes).
torch::Tensor ring_all_gather(dist::Communicator& comm, const torch::Tensor& chunk,
                              const std::vector<int64_t>& dim0_sizes);

/// Ring all-reduce (sum) = ring reduce-scatter, then ring all-gather of the reduced chunks.
/// Returns the sum over ranks of `tensor`; equals comm.all_reduce.
torch::Tensor ring_all_reduce(dist::Communicator& comm, const torch::Tensor& tensor);

/// Bytes this rank sends in ring_reduce_scatter of `tensor`: every chunk but its own,
/// S − |chunk r| (= (N − 1)/N·S when N divides the rows).
int64_t ring_reduce_scatter_bytes(const torch::Tensor& tensor, int rank, int n);

/// Bytes this rank sends in ring_all_gather: every chunk but its right neighbour's,
/// S − |chunk (r + 1) mod N|, S being the gathered size.
int64_t ring_all_gather_bytes(const std::vector<int64_t>& dim0_sizes, int64_t row_bytes, int rank);

/// Time of the ring algorithms in the alpha-beta model: N − 1 steps of alpha + (S/N)/beta for a
/// reduce-scatter or all-gather, twice that for an all-reduce. alpha in seconds, beta in bytes/s.
double ring_time(double alpha, double beta, double bytes, int n, bool all_reduce);

/// nccl-tests' bus bandwidth from the algorithm bandwidth S/t: x 2(N − 1)/N for all-reduce,
/// x (N − 1)/N for all-gather and reduce-scatter; what each link carries, comparable across N.
double bus_bandwidth(double algorithm_bandwidth, int n, bool all_reduce);

}  // namespace fivefold::ch08
