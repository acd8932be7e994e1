// Every Communicator operation against the serial computation. Rank r's input is drawn from a
// generator seeded by (r, case name), so every rank can compute every other rank's input and hence
// the expected result locally. Runs on the MPI backend (1-4 ranks) and on Gloo (2-3 ranks).

#include <numeric>

#include "fivefold/comm_stats.h"
#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "testing.h"

using fivefold::Error;
using fivefold::testing::world;
using namespace fivefold::dist;

namespace {

// Rank r's input for a case: deterministic, different per rank.
torch::Tensor input_of(int rank, const std::string& name, std::vector<int64_t> shape,
                       torch::ScalarType dtype = torch::kFloat) {
  auto values = torch::randn(shape, fivefold::generator_for(static_cast<uint64_t>(rank), name));
  if (dtype == torch::kLong || dtype == torch::kInt) return (values * 100).round().to(dtype);
  return values.to(dtype);
}

// The sizes every collective is tried with: empty, one row, not divisible by the world, larger.
std::vector<int64_t> row_counts(int world_size) { return {0, 1, 7, 3 * world_size + 1, 1000}; }

std::vector<int64_t> tensor_split_sizes(int64_t rows, int parts) {
  std::vector<int64_t> sizes(parts, rows / parts);
  for (int64_t i = 0; i < rows % parts; ++i) sizes[i] += 1;
  return sizes;
}

}  // namespace

TEST(Communicator, AllReduceEqualsSerialReduction) {
  auto comm = world();
  const int n = comm->size();
  for (int64_t rows : row_counts(n)) {
    for (auto dtype : {torch::kFloat, torch::kDouble, torch::kLong}) {
      const std::string name = "all_reduce" + std::to_string(rows);
      std::vector<torch::Tensor> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, name, {rows, 3}, dtype));
      auto stacked = torch::stack(inputs);
      struct Case {
        ReduceOp op;
        torch::Tensor expected;
      };
      std::vector<Case> cases = {{ReduceOp::Sum, stacked.sum(0).to(dtype)},
                                 {ReduceOp::Max, std::get<0>(stacked.max(0))},
                                 {ReduceOp::Min, std::get<0>(stacked.min(0))}};
      if (dtype != torch::kLong) cases.push_back({ReduceOp::Average, stacked.mean(0)});
      for (const auto& c : cases) {
        auto tensor = inputs[comm->rank()].clone();
        comm->all_reduce(tensor, c.op);
        // fp32: the backend may add in another order; 1e-5 absolute covers it at these sizes.
        EXPECT_TENSOR_CLOSE(tensor, c.expected, 1e-5, 1e-6);
      }
    }
  }
}

TEST(Communicator, AllReduceLowPrecisionAndNonContiguous) {
  auto comm = world();
  const int n = comm->size();
  std::vector<torch::Tensor> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(input_of(r, "bf16", {16, 4}));
  auto expected = torch::stack(inputs).sum(0);
  auto bf16 = inputs[comm->rank()].to(torch::kBFloat16);
  comm->all_reduce(bf16);
  // bf16 keeps 8 bits of mantissa: inputs rounded, result rounded -> ~1% relative.
  EXPECT_TENSOR_CLOSE(bf16.to(torch::kFloat), expected, 0.05 * n, 0.02);

  auto matrix = inputs[comm->rank()].clone();
  auto transposed = matrix.t();  // a non-contiguous view: reduced in place through a copy
  comm->all_reduce(transposed);
  EXPECT_TENSOR_CLOSE(matrix, expected, 1e-5, 1e-6);
}

TEST(Communicator, AllGatherEqualAndUnequalParts) {
  auto comm = world();
  const int n = comm->size();
  for (int64_t rows : row_counts(n)) {
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < n; ++r)
      parts.push_back(input_of(r, "gather" + std::to_string(rows), {rows, 2}));
    EXPECT_TENSOR_EQ(comm->all_gather(parts[comm->rank()]), torch::cat(parts, 0));
  }
  // Unequal parts, some empty: the inverse of reduce_scatter's split.
  std::vector<int64_t> sizes;
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < n; ++r) {
    sizes.push_back(r % 3 == 1 ? 0 : r + 2);
    parts.push_back(input_of(r, "uneven", {sizes.back(), 3}, torch::kDouble));
  }
  EXPECT_TENSOR_EQ(comm->all_gather(parts[comm->rank()], sizes), torch::cat(parts, 0));
  // One-dimensional tensors gather too.
  auto one_d = torch::full({2}, static_cast<float>(comm->rank()));
  auto gathered = comm->all_gather(one_d);
  EXPECT_EQ(gathered.sizes(), torch::IntArrayRef({2 * n}));
  EXPECT_EQ(gathered[2 * n - 1].item<float>(), static_cast<float>(n - 1));
}

TEST(Communicator, ReduceScatterEqualsSplitOfSerialSum) {
  auto comm = world();
  const int n = comm->size();
  for (int64_t rows : row_counts(n)) {
    std::vector<torch::Tensor> inputs;
    for (int r = 0; r < n; ++r)
      inputs.push_back(input_of(r, "rs" + std::to_string(rows), {rows, 5}));
    auto total = torch::stack(inputs).sum(0);
    auto expected = torch::tensor_split(total, n, 0)[comm->rank()];
    EXPECT_TENSOR_CLOSE(comm->reduce_scatter(inputs[comm->rank()]), expected, 1e-5, 1e-6);
    EXPECT_TENSOR_CLOSE(comm->reduce_scatter(inputs[comm->rank()], ReduceOp::Average), expected / n,
                        1e-5, 1e-6);
  }
  // reduce_scatter then all_gather with the same split sizes gives back the all-reduce.
  auto x = input_of(comm->rank(), "roundtrip", {2 * n + 1, 3});
  auto part = comm->reduce_scatter(x);
  auto whole = comm->all_gather(part, tensor_split_sizes(2 * n + 1, n));
  auto reduced = x.clone();
  comm->all_reduce(reduced);
  EXPECT_TENSOR_CLOSE(whole, reduced, 1e-5, 1e-6);
}

TEST(Communicator, GatherAndScatterAlongAnyDimension) {
  // What a sequence, a vocabulary or a split weight needs: the collectives along dim 1, 2 or the
  // last, with uneven parts, against the serial concatenation and the split of the serial sum.
  auto comm = world();
  const int n = comm->size();
  for (int64_t dim : {1, 2, -1}) {
    std::vector<int64_t> sizes;
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < n; ++r) {
      sizes.push_back(r + 1);
      std::vector<int64_t> shape = {2, 3, 4, 5};
      shape[static_cast<size_t>(dim < 0 ? dim + 4 : dim)] = sizes.back();
      parts.push_back(input_of(r, "along" + std::to_string(dim), shape));
    }
    EXPECT_TENSOR_EQ(all_gather_along(*comm, parts[comm->rank()], dim, sizes),
                     torch::cat(parts, dim));
    const auto equal = input_of(comm->rank(), "along-equal", {2, 3, 4});
    std::vector<torch::Tensor> all;
    for (int r = 0; r < n; ++r) all.push_back(input_of(r, "along-equal", {2, 3, 4}));
    EXPECT_TENSOR_EQ(all_gather_along(*comm, equal, dim), torch::cat(all, dim));
    const auto total = torch::stack(all).sum(0);
    EXPECT_TENSOR_CLOSE(reduce_scatter_along(*comm, equal, dim),
                        torch::tensor_split(total, n, dim)[comm->rank()], 1e-5, 1e-6);
    // Uneven parts of the sum, the sizes the gather above took (its conjugate).
    std::vector<int64_t> shape = {2, 3, 4, 5};
    int64_t& extent = shape[static_cast<size_t>(dim < 0 ? dim + 4 : dim)];
    extent = n * (n + 1) / 2;
    std::vector<torch::Tensor> wholes;
    for (int r = 0; r < n; ++r) wholes.push_back(input_of(r, "along-uneven", shape));
    EXPECT_TENSOR_CLOSE(reduce_scatter_along(*comm, wholes[comm->rank()], dim, sizes),
                        torch::stack(wholes).sum(0).split_with_sizes(sizes, dim)[comm->rank()],
                        1e-5, 1e-6);
  }
  EXPECT_THROW(comm->reduce_scatter(torch::zeros({n + 1, 2}), std::vector<int64_t>(n, 1)), Error);
  EXPECT_THROW(comm->reduce_scatter(torch::zeros({n, 2}), std::vector<int64_t>(n + 1, 0)), Error);
}

TEST(Communicator, AllToAllWithSplitSizes) {
  auto comm = world();
  const int n = comm->size();
  const int me = comm->rank();
  // Rank r sends (r + j) % 3 rows to rank j (zero rows happen); all ranks know the table.
  auto rows_from_to = [](int from, int to) { return static_cast<int64_t>((from + to) % 3); };
  std::vector<torch::Tensor> inputs;
  for (int r = 0; r < n; ++r) {
    int64_t total = 0;
    for (int j = 0; j < n; ++j) total += rows_from_to(r, j);
    inputs.push_back(input_of(r, "a2a", {total, 4}));
  }
  std::vector<int64_t> send, recv;
  for (int j = 0; j < n; ++j) {
    send.push_back(rows_from_to(me, j));
    recv.push_back(rows_from_to(j, me));
  }
  std::vector<torch::Tensor> expected;
  for (int r = 0; r < n; ++r) {
    int64_t offset = 0;
    for (int j = 0; j < me; ++j) offset += rows_from_to(r, j);
    expected.push_back(inputs[r].narrow(0, offset, rows_from_to(r, me)));
  }
  EXPECT_TENSOR_EQ(comm->all_to_all(inputs[me], send, recv), torch::cat(expected, 0));
  // Everything empty is legal too.
  std::vector<int64_t> zeros(n, 0);
  EXPECT_EQ(comm->all_to_all(torch::empty({0, 4}), zeros, zeros).size(0), 0);
}

TEST(Communicator, BroadcastFromEveryRoot) {
  auto comm = world();
  for (int root = 0; root < comm->size(); ++root) {
    for (int64_t rows : row_counts(comm->size())) {
      const std::string name = "bcast" + std::to_string(rows);
      auto tensor = input_of(comm->rank(), name, {rows, 3});
      comm->broadcast(tensor, root);
      EXPECT_TENSOR_EQ(tensor, input_of(root, name, {rows, 3}));
    }
  }
}

// bf16 (chapter 14's parameters, gathered and broadcast in their own type) moves bit for bit on
// both backends (Gloo in LibTorch 1.13 has no bf16: it moves the bits as fp16).
TEST(Communicator, MovesBf16BitForBit) {
  auto comm = world();
  const int n = comm->size(), me = comm->rank();
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < n; ++r) parts.push_back(input_of(r, "bf16 move", {5, 3}, torch::kBFloat16));
  const auto gathered = comm->all_gather(parts[me]);
  ASSERT_EQ(gathered.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(gathered.equal(torch::cat(parts, 0)));
  std::vector<int64_t> sizes;
  std::vector<torch::Tensor> uneven;
  for (int r = 0; r < n; ++r) {
    sizes.push_back(r + 1);
    uneven.push_back(input_of(r, "bf16 uneven", {r + 1, 2}, torch::kBFloat16));
  }
  EXPECT_TRUE(comm->all_gather(uneven[me], sizes).equal(torch::cat(uneven, 0)));
  auto tensor = parts[me].clone();
  comm->broadcast(tensor, n - 1);
  EXPECT_TRUE(tensor.equal(parts[n - 1]));
  std::vector<int64_t> ones(n, 1);
  const auto rows = input_of(me, "bf16 a2a", {n, 4}, torch::kBFloat16);
  std::vector<torch::Tensor> expected;
  for (int r = 0; r < n; ++r)
    expected.push_back(input_of(r, "bf16 a2a", {n, 4}, torch::kBFloat16)[me].unsqueeze(0));
  EXPECT_TRUE(comm->all_to_all(rows, ones, ones).equal(torch::cat(expected, 0)));
}

TEST(Communicator, PointToPoint) {
  auto comm = world();
  const int n = comm->size();
  const int me = comm->rank();
  // A ring: everyone sends to the next rank and receives from the previous one at once.
  for (int64_t rows : {0L, 1L, 257L}) {
    auto outgoing = input_of(me, "ring" + std::to_string(rows), {rows, 2});
    auto incoming = torch::empty({rows, 2});
    comm->send_recv(outgoing, (me + 1) % n, incoming, (me + n - 1) % n);
    EXPECT_TENSOR_EQ(incoming,
                     input_of((me + n - 1) % n, "ring" + std::to_string(rows), {rows, 2}));
  }
  // Rank 0 sends a different tensor to each rank, with tags.
  if (me == 0) {
    for (int dst = 1; dst < n; ++dst) comm->send(input_of(dst, "p2p", {5}), dst, /*tag=*/dst);
  } else {
    auto received = torch::empty({5});
    comm->recv(received, 0, /*tag=*/me);
    EXPECT_TENSOR_EQ(received, input_of(me, "p2p", {5}));
  }
  comm->barrier();
}

TEST(Communicator, AsyncOperationsCompleteInIssueOrder) {
  auto comm = world();
  const int n = comm->size();
  const int me = comm->rank();
  std::vector<torch::Tensor> reduced;
  std::vector<Work> works;
  for (int i = 0; i < 6; ++i) {
    reduced.push_back(torch::full({1000}, static_cast<float>(me + i)));
    works.push_back(comm->all_reduce_async(reduced.back()));
  }
  Work gather = comm->all_gather_async(torch::full({2}, static_cast<float>(me)));
  Work bcast = comm->broadcast_async(torch::full({3}, static_cast<float>(me)), n - 1);
  Work to_all = comm->all_to_all_async(torch::full({n}, static_cast<float>(me)),
                                       std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1));
  // A synchronous operation waits for the queued ones, then runs.
  auto sync = torch::ones({4});
  comm->all_reduce(sync);
  EXPECT_TRUE(works.front().completed());
  EXPECT_TENSOR_EQ(sync, torch::full({4}, static_cast<float>(n)));
  // Waited for in reverse order: each result is still right.
  EXPECT_TENSOR_EQ(to_all.wait(), torch::arange(n).to(torch::kFloat));
  EXPECT_TENSOR_EQ(bcast.wait(), torch::full({3}, static_cast<float>(n - 1)));
  EXPECT_TENSOR_EQ(gather.wait(), torch::arange(n).to(torch::kFloat).repeat_interleave(2));
  const float rank_sum = n * (n - 1) / 2.0f;
  for (int i = 5; i >= 0; --i) {
    works[i].wait();
    EXPECT_TENSOR_EQ(reduced[i], torch::full({1000}, rank_sum + static_cast<float>(n * i)));
  }
  // Async point-to-point in a ring.
  auto incoming = torch::empty({3});
  auto exchange = comm->send_recv_async(torch::full({3}, static_cast<float>(me)), (me + 1) % n,
                                        incoming, (me + n - 1) % n);
  EXPECT_TENSOR_EQ(exchange.wait(), torch::full({3}, static_cast<float>((me + n - 1) % n)));
  auto reduce_scatter = comm->reduce_scatter_async(torch::ones({2 * n, 2}));
  EXPECT_TENSOR_EQ(reduce_scatter.wait(), torch::full({2, 2}, static_cast<float>(n)));
}

TEST(Communicator, StatisticsCountExactlyWhatWasIssued) {
  auto comm = world();
  const int n = comm->size();
  const int me = comm->rank();
  comm->barrier();
  reset_comm_stats();
  auto t = torch::zeros({64}, torch::kFloat);  // 256 bytes
  comm->all_reduce(t);
  comm->all_reduce_async(t).wait();
  auto gathered = comm->all_gather(torch::zeros({3, 2}, torch::kDouble));  // 48 bytes a rank
  auto part = comm->reduce_scatter(torch::zeros({4 * n}, torch::kFloat));  // 16n bytes in
  auto bcast = torch::zeros({10}, torch::kLong);
  comm->broadcast(bcast, 0);
  std::vector<int64_t> send(n, 2), recv(n, 2);
  comm->all_to_all(torch::zeros({2 * n, 5}, torch::kFloat), send, recv);  // 40 bytes a row-pair
  auto incoming = torch::empty({7}, torch::kFloat);
  comm->send_recv(torch::zeros({7}), (me + 1) % n, incoming, (me + n - 1) % n);
  comm->barrier();

  const double ring = (n - 1.0) / n;
  auto ar = comm_counts("world", Op::AllReduce);
  EXPECT_EQ(ar.calls, 2);
  EXPECT_EQ(ar.payload_bytes, 2 * 256);
  EXPECT_DOUBLE_EQ(ar.modelled_wire_bytes, 2 * 2 * ring * 256);
  auto ag = comm_counts("world", Op::AllGather);
  EXPECT_EQ(ag.calls, 1);
  EXPECT_EQ(ag.payload_bytes, 48 * n);
  EXPECT_DOUBLE_EQ(ag.modelled_wire_bytes, ring * 48 * n);
  auto rs = comm_counts("world", Op::ReduceScatter);
  EXPECT_EQ(rs.payload_bytes, 16 * n);
  EXPECT_DOUBLE_EQ(rs.modelled_wire_bytes, ring * 16 * n);
  auto bc = comm_counts("world", Op::Broadcast);
  EXPECT_EQ(bc.payload_bytes, 80);
  auto a2a = comm_counts("world", Op::AllToAll);
  EXPECT_EQ(a2a.payload_bytes, 2 * n * 5 * 4);
  EXPECT_DOUBLE_EQ(a2a.modelled_wire_bytes, (n - 1) * 2 * 5 * 4.0);  // rows to other ranks only
  auto sr = comm_counts("world", Op::SendRecv);
  EXPECT_EQ(sr.calls, 1);
  EXPECT_EQ(sr.payload_bytes, 28);
  EXPECT_DOUBLE_EQ(sr.modelled_wire_bytes, n > 1 ? 28.0 : 0.0);  // to itself: nothing on the wire
  EXPECT_EQ(comm_counts("world", Op::Barrier).calls, 1);
  EXPECT_EQ(comm_counts("world", Op::Send).calls, 0);
  EXPECT_NE(format_comm_stats(comm_stats()).find("all_reduce"), std::string::npos);

  if (n > 1) {  // send and recv count their own sides
    reset_comm_stats();
    if (me == 0) comm->send(torch::zeros({9}), 1);
    if (me == 1) {
      auto r = torch::empty({9});
      comm->recv(r, 0);
    }
    EXPECT_EQ(comm_counts("world", Op::Send).payload_bytes, me == 0 ? 36 : 0);
    EXPECT_EQ(comm_counts("world", Op::Recv).payload_bytes, me == 1 ? 36 : 0);
    EXPECT_DOUBLE_EQ(comm_counts("world", Op::Recv).modelled_wire_bytes, 0.0);
  }
}

TEST(Communicator, SplitGroupsByColorOrderedByKey) {
  auto comm = world();
  const int me = comm->rank();
  // Even and odd ranks, in reverse order of rank inside each group.
  auto half = comm->split(me % 2, -me, "parity");
  std::vector<int> expected;
  for (int r = comm->size() - 1; r >= 0; --r) {
    if (r % 2 == me % 2) expected.push_back(r);
  }
  ASSERT_EQ(half->size(), static_cast<int>(expected.size()));
  EXPECT_EQ(half->name(), "parity");
  EXPECT_EQ(expected[half->rank()], me);
  auto members = half->all_gather(torch::tensor({static_cast<int64_t>(me)}));
  for (int i = 0; i < half->size(); ++i) EXPECT_EQ(members[i].item<int64_t>(), expected[i]);
  // The child works independently of its parent, including async.
  auto t = torch::ones({3});
  half->all_reduce_async(t).wait();
  EXPECT_TENSOR_EQ(t, torch::full({3}, static_cast<float>(half->size())));
  // Splits of splits.
  auto single = half->split(half->rank(), 0, "single");
  EXPECT_EQ(single->size(), 1);
  auto x = torch::full({2}, 5.0f);
  single->all_reduce(x);
  EXPECT_TENSOR_EQ(x, torch::full({2}, 5.0f));
}

TEST(Communicator, BadArgumentsFailOnEveryRankBeforeCommunicating) {
  auto comm = world();
  const int n = comm->size();
  auto t = torch::ones({4});
  EXPECT_THROW(comm->broadcast(t, n), Error);
  EXPECT_THROW(comm->broadcast(t, -1), Error);
  EXPECT_THROW(comm->all_to_all(t, std::vector<int64_t>(n + 1, 0), std::vector<int64_t>(n, 0)),
               Error);
  EXPECT_THROW(comm->all_to_all(t, std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0)), Error);
  EXPECT_THROW(comm->all_gather(t, std::vector<int64_t>(n, 3)), Error);
  EXPECT_THROW(comm->all_gather(torch::tensor(1.0f)), Error);
  EXPECT_THROW(comm->reduce_scatter(torch::tensor(1.0f)), Error);
  EXPECT_THROW(comm->send(t, comm->rank()), Error);
  EXPECT_THROW(comm->send(t, n), Error);
  EXPECT_THROW(comm->recv(t, comm->rank()), Error);
  torch::Tensor undefined;
  EXPECT_THROW(comm->all_reduce(undefined), Error);
  // Nothing reached the wire, so the communicator is still in step on every rank.
  comm->all_reduce(t);
  EXPECT_TENSOR_EQ(t, torch::full({4}, static_cast<float>(n)));
}

TEST(Communicator, DestroyingDrainsQueuedOperations) {
  auto comm = world();
  auto child = comm->split(0, comm->rank(), "child");
  std::vector<torch::Tensor> tensors;
  std::vector<Work> works;
  for (int i = 0; i < 5; ++i) {
    tensors.push_back(torch::full({4096}, static_cast<float>(i)));
    works.push_back(child->all_reduce_async(tensors.back()));
  }
  child
      .reset();  // still queued or running: the destructor completes them before releasing MPI/Gloo
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(works[i].completed());
    EXPECT_TENSOR_EQ(tensors[i], torch::full({4096}, static_cast<float>(i * comm->size())));
  }
}
