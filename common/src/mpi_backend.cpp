// The MPI backend: each operation is one MPI call on the communicator's MPI_Comm.
// Data that is only moved (gather, broadcast, all-to-all, send/recv) travels as MPI_BYTE; data that
// is reduced needs an MPI datatype, so half and bfloat16 are reduced in float32.

#include <mpi.h>

#include <climits>

#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "internal.h"

namespace fivefold::dist {
namespace {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(std::string(call) + " failed: " + std::string(text, length));
}

int as_count(int64_t n, const char* what) {
  FIVEFOLD_CHECK(n <= INT_MAX, what, ": ", n, " bytes exceed MPI's int count limit (2 GiB); ",
                 "split the tensor");
  return static_cast<int>(n);
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Average: break;  // handled above the backend
  }
  throw Error("MPI backend: unexpected reduce op");
}

// The MPI datatype for reducing `dtype` (half and bfloat16 arrive widened to float32).
MPI_Datatype mpi_type(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat: return MPI_FLOAT;
    case torch::kDouble: return MPI_DOUBLE;
    case torch::kInt: return MPI_INT32_T;
    case torch::kLong: return MPI_INT64_T;
    case torch::kShort: return MPI_INT16_T;
    case torch::kChar: return MPI_INT8_T;
    case torch::kByte: return MPI_UINT8_T;
    default: throw Error(std::string("MPI backend: cannot reduce dtype ") + c10::toString(dtype));
  }
}

int64_t nbytes(const torch::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

int64_t row_bytes(const torch::Tensor& t) {
  int64_t n = t.element_size();
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

// Byte counts and displacements for rows split by `sizes`.
void byte_layout(const std::vector<int64_t>& sizes, int64_t bytes_per_row, std::vector<int>& counts,
                 std::vector<int>& offsets, const char* what) {
  counts.resize(sizes.size());
  offsets.resize(sizes.size());
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    counts[i] = as_count(sizes[i] * bytes_per_row, what);
    offsets[i] = as_count(offset, what);
    offset += sizes[i] * bytes_per_row;
  }
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name, bool owned)
      : Communicator(comm_rank(comm), comm_size(comm), std::move(name), Backend::Mpi),
        comm_(comm),
        owned_(owned) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }

  ~MpiCommunicator() override {
    drain_and_stop();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owned_ && !finalized) MPI_Comm_free(&comm_);
  }

 protected:
  void do_all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, tensor.data_ptr(), as_count(tensor.numel(), "all_reduce"),
                            mpi_type(tensor.scalar_type()), mpi_op(op), comm_),
              "MPI_Allreduce");
  }

  void do_all_gather(const torch::Tensor& in, torch::Tensor& out,
                     const std::vector<int64_t>& dim0_sizes) override {
    std::vector<int> counts, offsets;
    byte_layout(dim0_sizes, row_bytes(out), counts, offsets, "all_gather");
    check_mpi(MPI_Allgatherv(in.data_ptr(), as_count(nbytes(in), "all_gather"), MPI_BYTE,
                             out.data_ptr(), counts.data(), offsets.data(), MPI_BYTE, comm_),
              "MPI_Allgatherv");
  }

  void do_reduce_scatter(const torch::Tensor& in, torch::Tensor& out,
                         const std::vector<int64_t>& dim0_sizes, ReduceOp op) override {
    if (in.numel() == 0) return;
    const int64_t row_elements = in.numel() / in.size(0);
    std::vector<int> counts;
    for (int64_t rows : dim0_sizes)
      counts.push_back(as_count(rows * row_elements, "reduce_scatter"));
    check_mpi(MPI_Reduce_scatter(in.data_ptr(), out.data_ptr(), counts.data(),
                                 mpi_type(in.scalar_type()), mpi_op(op), comm_),
              "MPI_Reduce_scatter");
  }

  void do_all_to_all(const torch::Tensor& in, torch::Tensor& out,
                     const std::vector<int64_t>& send_sizes,
                     const std::vector<int64_t>& recv_sizes) override {
    std::vector<int> send_counts, send_offsets, recv_counts, recv_offsets;
    byte_layout(send_sizes, row_bytes(in), send_counts, send_offsets, "all_to_all");
    byte_layout(recv_sizes, row_bytes(out), recv_counts, recv_offsets, "all_to_all");
    check_mpi(
        MPI_Alltoallv(in.data_ptr(), send_counts.data(), send_offsets.data(), MPI_BYTE,
                      out.data_ptr(), recv_counts.data(), recv_offsets.data(), MPI_BYTE, comm_),
        "MPI_Alltoallv");
  }

  void do_broadcast(torch::Tensor& tensor, int root) override {
    check_mpi(
        MPI_Bcast(tensor.data_ptr(), as_count(nbytes(tensor), "broadcast"), MPI_BYTE, root, comm_),
        "MPI_Bcast");
  }

  void do_send(const torch::Tensor& tensor, int dst, int tag) override {
    check_mpi(
        MPI_Send(tensor.data_ptr(), as_count(nbytes(tensor), "send"), MPI_BYTE, dst, tag, comm_),
        "MPI_Send");
  }

  void do_recv(torch::Tensor& tensor, int src, int tag) override {
    MPI_Status status;
    const int expected = as_count(nbytes(tensor), "recv");
    check_mpi(MPI_Recv(tensor.data_ptr(), expected, MPI_BYTE, src, tag, comm_, &status),
              "MPI_Recv");
    check_received(status, expected, src);
  }

  void do_send_recv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor, int src,
                    int tag) override {
    MPI_Status status;
    const int expected = as_count(nbytes(recv_tensor), "send_recv");
    check_mpi(MPI_Sendrecv(send_tensor.data_ptr(), as_count(nbytes(send_tensor), "send_recv"),
                           MPI_BYTE, dst, tag, recv_tensor.data_ptr(), expected, MPI_BYTE, src, tag,
                           comm_, &status),
              "MPI_Sendrecv");
    check_received(status, expected, src);
  }

  void do_barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier"); }

  std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int color,
                                         const std::string& name) override {
    const int key =
        static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
    MPI_Comm child;
    check_mpi(MPI_Comm_split(comm_, color, key, &child), "MPI_Comm_split");
    return std::make_shared<MpiCommunicator>(child, name, true);
  }

 private:
  static int comm_rank(MPI_Comm comm) {
    int r = 0;
    MPI_Comm_rank(comm, &r);
    return r;
  }
  static int comm_size(MPI_Comm comm) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    return n;
  }
  void check_received(const MPI_Status& status, int expected, int src) const {
    int received = 0;
    MPI_Get_count(&status, MPI_BYTE, &received);
    FIVEFOLD_CHECK(received == expected, "recv on '", name(), "': expected ", expected,
                   " bytes from rank ", src, ", got ", received, " (shapes differ between ranks?)");
  }

  MPI_Comm comm_;
  bool owned_;
};

}  // namespace

namespace detail {

CommunicatorPtr start_mpi_world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    FIVEFOLD_CHECK(provided == MPI_THREAD_MULTIPLE,
                   "this MPI library does not provide MPI_THREAD_MULTIPLE (got level ", provided,
                   "); fivefold issues operations from one thread per communicator");
  }
  auto world = std::make_shared<MpiCommunicator>(MPI_COMM_WORLD, "world", false);
  return world;
}

std::pair<int, int> mpi_node_rank_and_size() {
  // The ranks that share this machine's memory: exact whatever the launcher said.
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int rank = 0, size = 1;
  MPI_Comm_rank(node, &rank);
  MPI_Comm_size(node, &size);
  MPI_Comm_free(&node);
  return {rank, size};
}

void stop_mpi() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

void abort_backend(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

}  // namespace detail
}  // namespace fivefold::dist
