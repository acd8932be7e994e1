#pragma once
/// @file dist.h
/// @brief The Communicator: the one interface through which every chapter talks to other ranks.
///
/// Two backends implement it: MPI (OpenMPI; the CPU default under `mpirun`/`srun`) and c10d's Gloo
/// (CPU jobs without MPI, e.g. `torchrun --no-python`). Both share everything above the wire:
///
/// - **Ordering.** Operations on one communicator are issued in program order, as on a CUDA stream.
///   Every rank of a communicator must issue the same collectives in the same order.
/// - **Asynchrony.** Each communicator owns one *issue thread* that runs its queued asynchronous
///   operations in order; `*_async` returns a Work handle at once and the computing thread goes on
///   (this is what lets DDP overlap all-reduce with backward on a CPU). A synchronous call first
///   waits for the operations already queued, then runs inline on the caller's thread.
///   Exchanges in a ring (each rank sends to one neighbour and receives from the other) must use
///   send_recv(): a send queued before its matching receive can deadlock, as on NCCL without
///   ncclGroupStart/End.
/// - **Statistics.** Every operation is counted (calls and bytes, per communicator name and op),
///   whatever the backend: see comm_stats.h.
/// - **Failure.** A watchdog ends the whole job with a clear message when an operation has not
///   completed within the timeout (env FIVEFOLD_COMM_TIMEOUT, seconds, default 600); a peer that
///   dies ends the job through the launcher (MPI) or a connection error (Gloo). Never a hang.
///
/// Tensors must be CPU tensors; they are made contiguous as needed. All sizes along dim 0 may be 0.

#include <torch/torch.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fivefold::dist {

/// Reduction applied by all_reduce and reduce_scatter. Average = Sum / size.
enum class ReduceOp { Sum, Average, Max, Min };

/// The transport under a communicator.
enum class Backend { Mpi, Gloo, Offline };

/// "mpi", "gloo" or "offline".
const char* backend_name(Backend backend);

/// The operations, as counted in the statistics.
enum class Op {
  AllReduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Send,
  Recv,
  SendRecv,
  Barrier
};

/// "all_reduce", "all_gather", ... (snake case, as in the statistics tables).
const char* op_name(Op op);

/// Handle to an asynchronous operation. Copyable; all copies refer to the same operation.
class Work {
 public:
  Work() = default;
  /// Blocks until the operation has completed and rethrows its error, if any. Returns the
  /// operation's result tensor (the output of all_gather, reduce_scatter, all_to_all; the tensor
  /// operated on in place otherwise; undefined for send and barrier). Calling it again is cheap.
  torch::Tensor wait();
  /// True once the operation has finished (successfully or not).
  bool completed() const;

 private:
  friend class Communicator;
  struct State;
  Work(std::shared_ptr<State> state, torch::Tensor result)
      : state_(std::move(state)), result_(std::move(result)) {}
  std::shared_ptr<State> state_;  // shared with the worker thread: completion and error only
  torch::Tensor result_;          // the caller's alone, so its memory is the caller's to free
};

/// A group of ranks that communicate. Created by fivefold::Runtime (the world), by split(), or by
/// DeviceMesh (one per set of mesh dimensions).
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This rank's index in the communicator, 0 <= rank < size.
  int rank() const { return rank_; }
  /// Number of ranks in the communicator.
  int size() const { return size_; }
  /// The world rank of this communicator's rank `rank` (how logs and errors name a peer).
  int world_rank(int rank) const;
  /// Name used in logs and statistics ("world", "tp", "dp+cp", ...).
  const std::string& name() const { return name_; }
  /// The transport.
  Backend backend() const { return backend_; }

  /// @name Synchronous operations
  /// @{

  /// Reduces `tensor` over all ranks, in place. Every rank passes the same shape and dtype.
  void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  /// Concatenates every rank's `tensor` along dim 0 (equal shapes on every rank).
  /// Returns [size * n, ...] for input [n, ...].
  torch::Tensor all_gather(const torch::Tensor& tensor);
  /// Concatenates along dim 0 when ranks hold different numbers of rows: rank i holds
  /// `dim0_sizes[i]` rows (same list on every rank). The inverse of reduce_scatter's split.
  torch::Tensor all_gather(const torch::Tensor& tensor, const std::vector<int64_t>& dim0_sizes);
  /// Reduces `tensor` (same shape on every rank) and returns this rank's part of the result along
  /// dim 0. Parts follow torch::tensor_split: for n rows, the first n % size ranks get one extra
  /// row.
  torch::Tensor reduce_scatter(const torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum);
  /// Reduces `tensor` (same shape on every rank) and returns this rank's part along dim 0 when the
  /// parts differ in size: rank i's part has `dim0_sizes[i]` rows (same list on every rank,
  /// summing to the rows of `tensor`). The conjugate of all_gather with dim0_sizes.
  torch::Tensor reduce_scatter(const torch::Tensor& tensor, const std::vector<int64_t>& dim0_sizes,
                               ReduceOp op = ReduceOp::Sum);
  /// Sends rows [offset_j, offset_j + send_sizes[j]) of `tensor` (dim 0) to rank j and returns the
  /// rows received, concatenated in rank order; rank i sends this rank recv_sizes[i] rows.
  torch::Tensor all_to_all(const torch::Tensor& tensor, const std::vector<int64_t>& send_sizes,
                           const std::vector<int64_t>& recv_sizes);
  /// Copies root's `tensor` into every rank's `tensor` (same shape everywhere).
  void broadcast(torch::Tensor& tensor, int root);
  /// Sends `tensor` to rank `dst`. Blocks until the message is handed to the transport.
  void send(const torch::Tensor& tensor, int dst, int tag = 0);
  /// Receives into `tensor` (preallocated, right shape and dtype) from rank `src`.
  void recv(torch::Tensor& tensor, int src, int tag = 0);
  /// Sends `send_tensor` to `dst` while receiving `recv_tensor` from `src`: the deadlock-free
  /// exchange for rings and pipelines. `dst`/`src` may equal this rank only if both do.
  void send_recv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor, int src,
                 int tag = 0);
  /// Returns once every rank has entered the barrier.
  void barrier();
  /// @}

  /// @name Asynchronous operations
  /// Same semantics as the synchronous ones; the tensors must stay alive and untouched until
  /// Work::wait() returns. The result tensor (if any) is returned by wait().
  /// @{

  /// Asynchronous all_reduce (in place).
  Work all_reduce_async(torch::Tensor tensor, ReduceOp op = ReduceOp::Sum);
  /// Asynchronous all_gather; empty `dim0_sizes` means equal sizes.
  Work all_gather_async(torch::Tensor tensor, std::vector<int64_t> dim0_sizes = {});
  /// Asynchronous reduce_scatter; empty `dim0_sizes` means torch::tensor_split's parts.
  Work reduce_scatter_async(torch::Tensor tensor, ReduceOp op = ReduceOp::Sum,
                            std::vector<int64_t> dim0_sizes = {});
  /// Asynchronous all_to_all.
  Work all_to_all_async(torch::Tensor tensor, std::vector<int64_t> send_sizes,
                        std::vector<int64_t> recv_sizes);
  /// Asynchronous broadcast (in place).
  Work broadcast_async(torch::Tensor tensor, int root);
  /// Asynchronous send.
  Work send_async(torch::Tensor tensor, int dst, int tag = 0);
  /// Asynchronous receive into `tensor`.
  Work recv_async(torch::Tensor tensor, int src, int tag = 0);
  /// Asynchronous send_recv; wait() returns `recv_tensor`.
  Work send_recv_async(torch::Tensor send_tensor, int dst, torch::Tensor recv_tensor, int src,
                       int tag = 0);
  /// @}

  /// Splits this communicator like MPI_Comm_split: ranks with equal `color` form a new
  /// communicator, ordered by (`key`, old rank). Collective over this communicator.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);

 protected:
  /// Backends construct the base with their rank, size, name and kind.
  Communicator(int rank, int size, std::string name, Backend backend);

  /// Runs every queued operation to completion and stops the issue thread. Each backend's
  /// destructor calls it first: the queued operations still use the backend's transport, which
  /// the derived destructor is about to release (the base destructor would run too late).
  void drain_and_stop();

  /// @name Blocking primitives each backend implements
  /// Called on the issue thread or inline, one at a time per communicator, with contiguous tensors
  /// and validated arguments. Average never reaches the backend (it is Sum, then a division).
  /// @{
  virtual void do_all_reduce(torch::Tensor& tensor, ReduceOp op) = 0;  ///< in place
  /// out has sum(dim0_sizes) rows; rank i's rows are at offset sum(dim0_sizes[:i]).
  virtual void do_all_gather(const torch::Tensor& in, torch::Tensor& out,
                             const std::vector<int64_t>& dim0_sizes) = 0;
  /// out receives this rank's part; parts along dim 0 have `dim0_sizes` rows.
  virtual void do_reduce_scatter(const torch::Tensor& in, torch::Tensor& out,
                                 const std::vector<int64_t>& dim0_sizes, ReduceOp op) = 0;
  virtual void do_all_to_all(const torch::Tensor& in, torch::Tensor& out,
                             const std::vector<int64_t>& send_sizes,
                             const std::vector<int64_t>& recv_sizes) = 0;   ///< sizes in rows
  virtual void do_broadcast(torch::Tensor& tensor, int root) = 0;           ///< in place
  virtual void do_send(const torch::Tensor& tensor, int dst, int tag) = 0;  ///< blocking send
  virtual void do_recv(torch::Tensor& tensor, int src, int tag) = 0;        ///< blocking receive
  virtual void do_send_recv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor,
                            int src, int tag) = 0;  ///< simultaneous
  virtual void do_barrier() = 0;                    ///< barrier
  /// New communicator for this rank's `members` (ranks of this communicator, in new-rank order).
  virtual std::shared_ptr<Communicator> do_split(const std::vector<int>& members, int color,
                                                 const std::string& name) = 0;
  /// @}

 private:
  struct Task;
  Work issue(Op op, int64_t bytes, double wire_bytes, torch::Tensor result,
             std::function<void()> body, int dst, int src);
  Work enqueue(Op op, int64_t bytes, double wire_bytes, torch::Tensor result,
               std::function<void()> body, int dst, int src);
  void run_inline(Op op, int64_t bytes, double wire_bytes, const std::function<void()>& body,
                  int dst, int src);
  void worker_loop();
  void check_peer(int peer, const char* what) const;

  int rank_;
  int size_;
  std::string name_;
  Backend backend_;
  std::vector<int> world_ranks_;  // of each rank, when split from another; empty: the world's

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

/// Shared handle to a communicator (communicators are shared by the mesh, layers and tests).
using CommunicatorPtr = std::shared_ptr<Communicator>;

/// Communicator::all_gather along dimension `dim` of `tensor` (negative: from the end) instead of
/// dim 0: rank i holds `sizes[i]` of that dimension (empty: the same on every rank), and the
/// result holds their sum, rank 0's first. The collective concatenates along dim 0, so the
/// dimension moves there and back; the bytes sent are the same. The one way every chapter gathers
/// a sequence, a vocabulary or a weight split along some dimension.
torch::Tensor all_gather_along(Communicator& comm, const torch::Tensor& tensor, int64_t dim,
                               const std::vector<int64_t>& sizes = {});
/// Communicator::reduce_scatter along dimension `dim`: this rank's part of the reduction over
/// the ranks of `tensor` (the same shape on every rank): `sizes[rank]` of that dimension (empty:
/// torch::tensor_split's part). The conjugate of all_gather_along with the same sizes.
torch::Tensor reduce_scatter_along(Communicator& comm, const torch::Tensor& tensor, int64_t dim,
                                   const std::vector<int64_t>& sizes = {},
                                   ReduceOp op = ReduceOp::Sum);

/// A communicator that only knows its place: rank `rank` of `size`, named `name`. Every operation
/// on it, split included, throws fivefold::Error. For building one rank's part of a model on one
/// process (`fivefold train --plan`: the layers split over tp, the experts over ep) without the
/// other processes: constructors ask the group for its size and rank, never for data.
CommunicatorPtr offline_communicator(int rank, int size, const std::string& name);

/// Ends every process of the job at once with `code` (MPI_Abort under MPI, otherwise _exit).
/// Used by the watchdog and by the test harness when an assertion fails on one rank.
[[noreturn]] void abort_job(int code, const std::string& reason);

/// Seconds after which the watchdog aborts an unfinished operation (env FIVEFOLD_COMM_TIMEOUT).
double comm_timeout_seconds();

}  // namespace fivefold::dist
