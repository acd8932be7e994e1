// Chapter 08: the ring collectives equal the library's, for sizes that are empty, smaller than the
// ring, not divisible by it, and large; and each rank sends exactly the bytes the formulas say.
// Runs on the MPI backend (1-4 ranks) and on Gloo (3 ranks).

#include "08_collectives/ring.h"
#include "fivefold/comm_stats.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch08;
using fivefold::testing::world;
namespace dist = fivefold::dist;

namespace {
// Rank r's input: deterministic and different per rank; integers in float, so sums are exact in
// any order and the ring must match the library bit for bit.
torch::Tensor input_of(int rank, const std::string& name, std::vector<int64_t> shape) {
  return torch::randint(-50, 50, shape, fivefold::generator_for(rank, name)).to(torch::kFloat);
}
std::vector<int64_t> row_counts(int n) { return {0, 1, n - 1, 7, 3 * n + 1, 1000}; }
}  // namespace

TEST(Ring, ReduceScatterEqualsTheLibrarys) {
  auto comm = world();
  for (int64_t rows : row_counts(comm->size())) {
    auto x = input_of(comm->rank(), "rs" + std::to_string(rows), {rows, 3});
    const auto before = x.clone();
    SCOPED_TRACE(std::to_string(rows) + " rows");
    EXPECT_TENSOR_EQ(ring_reduce_scatter(*comm, x), comm->reduce_scatter(x));
    EXPECT_TENSOR_EQ(x, before);  // the ring works on its own buffers: the input is untouched
  }
}

TEST(Ring, AllGatherEqualsTheLibrarys) {
  auto comm = world();
  for (int64_t rows : row_counts(comm->size())) {
    const auto sizes = chunk_sizes(rows, comm->size());
    auto mine = input_of(comm->rank(), "ag" + std::to_string(rows), {sizes[comm->rank()], 2, 2});
    const auto before = mine.clone();
    SCOPED_TRACE(std::to_string(rows) + " rows");
    EXPECT_TENSOR_EQ(ring_all_gather(*comm, mine, sizes), comm->all_gather(mine, sizes));
    EXPECT_TENSOR_EQ(mine, before);
  }
}

TEST(Ring, AllReduceEqualsTheLibrarys) {
  auto comm = world();
  for (int64_t rows : row_counts(comm->size())) {
    auto x = input_of(comm->rank(), "ar" + std::to_string(rows), {rows, 5});
    auto expected = x.clone();
    comm->all_reduce(expected);
    const auto before = x.clone();
    SCOPED_TRACE(std::to_string(rows) + " rows");
    EXPECT_TENSOR_EQ(ring_all_reduce(*comm, x), expected);
    EXPECT_TENSOR_EQ(x, before);
  }
}

TEST(Ring, SendsExactlyTheFormulasBytes) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (int64_t rows : row_counts(n)) {
    auto x = input_of(r, "bytes", {rows, 4});
    dist::reset_comm_stats();
    auto mine = ring_reduce_scatter(*comm, x);
    auto rs = dist::comm_counts(comm->name(), dist::Op::SendRecv);
    EXPECT_EQ(rs.calls, n - 1);
    EXPECT_EQ(rs.payload_bytes, ring_reduce_scatter_bytes(x, r, n)) << rows << " rows";
    const auto sizes = chunk_sizes(rows, n);
    dist::reset_comm_stats();
    ring_all_gather(*comm, mine, sizes);
    auto ag = dist::comm_counts(comm->name(), dist::Op::SendRecv);
    EXPECT_EQ(ag.payload_bytes, ring_all_gather_bytes(sizes, 4 * 4, r)) << rows << " rows";
    // With N dividing the rows, each is (N − 1)/N of the data, and all-reduce twice that.
    if (rows % n == 0) {
      EXPECT_EQ(rs.payload_bytes * n, (n - 1) * x.numel() * 4);
      EXPECT_EQ((rs.payload_bytes + ag.payload_bytes) * n, 2 * (n - 1) * x.numel() * 4);
    }
  }
}

TEST(RingCost, AlphaBetaAndBusBandwidth) {
  // 8 ranks, 1 MB, alpha 10 µs, beta 10 GB/s: 7 steps of 10 µs + 125 KB / 10 GB/s = 12.5 µs.
  EXPECT_NEAR(ring_time(10e-6, 10e9, 1e6, 8, false), 7 * (10e-6 + 12.5e-6), 1e-15);
  EXPECT_NEAR(ring_time(10e-6, 10e9, 1e6, 8, true), 2 * 7 * (10e-6 + 12.5e-6), 1e-15);
  EXPECT_DOUBLE_EQ(bus_bandwidth(1.0, 8, true), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(bus_bandwidth(1.0, 8, false), 7.0 / 8);
  EXPECT_EQ(chunk_sizes(7, 3), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(chunk_sizes(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
}
