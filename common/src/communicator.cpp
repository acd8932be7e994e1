// The backend-independent half of every Communicator: argument checks, statistics and the issue
// queue that makes operations asynchronous (the watchdog that turns a hang into an error:
// watchdog.cpp).

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "fivefold/comm_stats.h"
#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "fivefold/trace.h"
#include "internal.h"

namespace fivefold::dist {

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::Mpi: return "mpi";
    case Backend::Gloo: return "gloo";
    case Backend::Offline: return "offline";
  }
  return "?";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::AllReduce: return "all_reduce";
    case Op::AllGather: return "all_gather";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllToAll: return "all_to_all";
    case Op::Broadcast: return "broadcast";
    case Op::Send: return "send";
    case Op::Recv: return "recv";
    case Op::SendRecv: return "send_recv";
    case Op::Barrier: return "barrier";
  }
  return "?";
}


// ------------------------------------------------------------------------------------------------
// Work
// ------------------------------------------------------------------------------------------------
struct Work::State {
  std::mutex mutex;
  std::condition_variable done_changed;
  bool done = false;
  std::exception_ptr error;
  // Queued operations only: wait() adds the time it blocked to (communicator, op)'s counts.
  std::string communicator;
  Op op = Op::Barrier;
};

torch::Tensor Work::wait() {
  FIVEFOLD_CHECK(state_ != nullptr, "Work::wait() on an empty handle");
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(state_->mutex);
  state_->done_changed.wait(lock, [&] { return state_->done; });
  lock.unlock();
  if (!state_->communicator.empty()) {
    const std::chrono::duration<double> blocked = std::chrono::steady_clock::now() - start;
    record_comm_time(state_->communicator, state_->op, blocked.count());
    if (trace::recording() && blocked.count() > 0)
      trace::record(std::string("wait ") + op_name(state_->op) + " " + state_->communicator,
                    "comm", trace::now() - blocked.count(), blocked.count());
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return result_;
}

bool Work::completed() const {
  if (state_ == nullptr) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

// ------------------------------------------------------------------------------------------------
// The issue queue
// ------------------------------------------------------------------------------------------------
struct Communicator::Task {
  std::function<void()> body;
  detail::OpLabel label;
  std::shared_ptr<Work::State> state;
};

Communicator::Communicator(int rank, int size, std::string name, Backend backend)
    : rank_(rank), size_(size), name_(std::move(name)), backend_(backend) {}

Communicator::~Communicator() { drain_and_stop(); }

void Communicator::drain_and_stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();  // the worker drains the queue before it stops
}

void Communicator::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock,
                  [&] { return (!queue_.empty() && !busy_) || (stopping_ && queue_.empty()); });
    if (queue_.empty()) return;  // stopping and drained
    auto task = queue_.front();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    const double traced = trace::recording() ? trace::now() : -1;
    try {
      detail::WatchdogGuard guard(task->label);
      task->body();
    } catch (...) {
      error = std::current_exception();
    }
    if (traced >= 0)
      trace::record(std::string(op_name(task->label.op)) + " " + *task->label.communicator,
                    "comm", traced, trace::now() - traced, trace::kWorker,
                    {{"bytes", task->label.bytes}});
    // Drop the tensors the operation captured before the caller learns it is done: after
    // wait() returns, the only references to them are the caller's.
    task->body = nullptr;
    {
      std::lock_guard<std::mutex> state_lock(task->state->mutex);
      task->state->error = error;
      task->state->done = true;
    }
    task->state->done_changed.notify_all();
    lock.lock();
    queue_.pop_front();
    busy_ = false;
    changed_.notify_all();
  }
}

int Communicator::world_rank(int rank) const {
  return world_ranks_.empty() ? rank : world_ranks_.at(static_cast<size_t>(rank));
}

Work Communicator::enqueue(Op op, int64_t bytes, double wire_bytes, torch::Tensor result,
                           std::function<void()> body, int dst, int src) {
  record_comm(name_, op, bytes, wire_bytes);
  auto task = std::make_shared<Task>();
  task->body = std::move(body);
  task->label = detail::label_of(*this, op, bytes, dst, src);
  task->state = std::make_shared<Work::State>();
  task->state->communicator = name_;
  task->state->op = op;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
    queue_.push_back(task);
  }
  changed_.notify_all();
  return Work(task->state, std::move(result));
}

void Communicator::run_inline(Op op, int64_t bytes, double wire_bytes,
                              const std::function<void()>& body, int dst, int src) {
  record_comm(name_, op, bytes, wire_bytes);
  const auto start = std::chrono::steady_clock::now();
  struct Timed {  // the caller's time inside the operation, however it ends
    const std::string& name;
    Op op;
    int64_t bytes;
    std::chrono::steady_clock::time_point start;
    ~Timed() {
      const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - start;
      record_comm_time(name, op, spent.count());
      if (trace::recording())
        trace::record(std::string(op_name(op)) + " " + name, "comm",
                      trace::now() - spent.count(), spent.count(), trace::kMain,
                      {{"bytes", bytes}});
    }
  } timed{name_, op, bytes, start};
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return queue_.empty() && !busy_; });  // earlier async ops go first
  busy_ = true;
  lock.unlock();
  struct Release {
    Communicator* self;
    ~Release() {
      {
        std::lock_guard<std::mutex> guard(self->mutex_);
        self->busy_ = false;
      }
      self->changed_.notify_all();
    }
  } release{this};
  detail::WatchdogGuard guard(detail::label_of(*this, op, bytes, dst, src));
  body();
}

// ------------------------------------------------------------------------------------------------
// Argument checks (before anything reaches the wire) and the public operations
// ------------------------------------------------------------------------------------------------
namespace {

int64_t nbytes(const torch::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

void check_cpu(const torch::Tensor& t, const char* op) {
  FIVEFOLD_CHECK(t.defined(), op, ": tensor is undefined");
  FIVEFOLD_CHECK(t.device().is_cpu(), op, ": CPU tensors only on this backend, got ", t.device());
}

int64_t row_numel(const torch::Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

torch::Tensor rows_like(const torch::Tensor& t, int64_t rows) {
  auto shape = t.sizes().vec();
  if (shape.empty()) shape.push_back(1);
  shape[0] = rows;
  return torch::empty(shape, t.options());
}

// Neither MPI nor Gloo can reduce half or bfloat16: those are reduced in float32.
bool reduce_in_float(const torch::Tensor& t) {
  return t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kBFloat16;
}

}  // namespace

void Communicator::check_peer(int peer, const char* what) const {
  FIVEFOLD_CHECK(peer >= 0 && peer < size_, what, " on '", name_, "': rank ", peer,
                 " is outside 0..", size_ - 1);
}

namespace {
// Set by the synchronous wrappers: the operation runs at once on the calling thread.
thread_local bool t_issue_inline = false;

struct InlineScope {
  InlineScope() { t_issue_inline = true; }
  ~InlineScope() { t_issue_inline = false; }
};
}  // namespace

Work Communicator::issue(Op op, int64_t bytes, double wire_bytes, torch::Tensor result,
                         std::function<void()> body, int dst, int src) {
  if (!t_issue_inline)
    return enqueue(op, bytes, wire_bytes, std::move(result), std::move(body), dst, src);
  t_issue_inline = false;  // nested operations (split's all_gather) decide for themselves
  run_inline(op, bytes, wire_bytes, body, dst, src);
  auto state = std::make_shared<Work::State>();
  state->done = true;
  return Work(state, std::move(result));
}

Work Communicator::all_reduce_async(torch::Tensor tensor, ReduceOp op) {
  check_cpu(tensor, "all_reduce");
  const double n = size_;
  auto body = [this, tensor, op]() mutable {
    if (tensor.numel() == 0) return;
    torch::Tensor work = reduce_in_float(tensor) ? tensor.to(torch::kFloat) : tensor.contiguous();
    do_all_reduce(work, op == ReduceOp::Average ? ReduceOp::Sum : op);
    if (op == ReduceOp::Average) work.div_(size_);
    if (!work.is_same(tensor)) tensor.copy_(work);
  };
  return issue(Op::AllReduce, nbytes(tensor), 2 * (n - 1) / n * nbytes(tensor), tensor,
               std::move(body), -1, -1);
}

Work Communicator::all_gather_async(torch::Tensor tensor, std::vector<int64_t> dim0_sizes) {
  check_cpu(tensor, "all_gather");
  FIVEFOLD_CHECK(tensor.dim() >= 1, "all_gather on '", name_, "': needs at least one dimension");
  if (dim0_sizes.empty()) dim0_sizes.assign(size_, tensor.size(0));
  FIVEFOLD_CHECK(static_cast<int>(dim0_sizes.size()) == size_, "all_gather on '", name_,
                 "': ", dim0_sizes.size(), " sizes given for ", size_, " ranks");
  FIVEFOLD_CHECK(dim0_sizes[rank_] == tensor.size(0), "all_gather on '", name_, "': rank ", rank_,
                 " holds ", tensor.size(0), " rows but dim0_sizes says ", dim0_sizes[rank_]);
  const int64_t rows = std::accumulate(dim0_sizes.begin(), dim0_sizes.end(), int64_t{0});
  torch::Tensor out = rows_like(tensor, rows);
  const double n = size_;
  auto body = [this, tensor, out, dim0_sizes]() mutable {
    do_all_gather(tensor.contiguous(), out, dim0_sizes);
  };
  return issue(Op::AllGather, nbytes(out), (n - 1) / n * nbytes(out), out, std::move(body), -1, -1);
}

Work Communicator::reduce_scatter_async(torch::Tensor tensor, ReduceOp op,
                                        std::vector<int64_t> dim0_sizes) {
  check_cpu(tensor, "reduce_scatter");
  FIVEFOLD_CHECK(tensor.dim() >= 1, "reduce_scatter on '", name_,
                 "': needs at least one dimension");
  if (dim0_sizes.empty()) dim0_sizes = fivefold::split_sizes(tensor.size(0), size_);  // seed.h
  FIVEFOLD_CHECK(static_cast<int>(dim0_sizes.size()) == size_, "reduce_scatter on '", name_,
                 "': ", dim0_sizes.size(), " sizes given for ", size_, " ranks");
  const int64_t rows = std::accumulate(dim0_sizes.begin(), dim0_sizes.end(), int64_t{0});
  FIVEFOLD_CHECK(rows == tensor.size(0), "reduce_scatter on '", name_, "': parts of ", rows,
                 " rows in all for a tensor of ", tensor.size(0));
  const std::vector<int64_t> sizes = std::move(dim0_sizes);
  torch::Tensor out = rows_like(tensor, sizes[rank_]);
  const double n = size_;
  auto body = [this, tensor, out, sizes, op]() mutable {
    const bool widen = reduce_in_float(tensor);
    torch::Tensor in = widen ? tensor.to(torch::kFloat) : tensor.contiguous();
    torch::Tensor work = widen ? torch::empty(out.sizes(), in.options()) : out;
    do_reduce_scatter(in, work, sizes, op == ReduceOp::Average ? ReduceOp::Sum : op);
    if (op == ReduceOp::Average) work.div_(size_);
    if (widen) out.copy_(work);
  };
  return issue(Op::ReduceScatter, nbytes(tensor), (n - 1) / n * nbytes(tensor), out,
               std::move(body), -1, -1);
}

Work Communicator::all_to_all_async(torch::Tensor tensor, std::vector<int64_t> send_sizes,
                                    std::vector<int64_t> recv_sizes) {
  check_cpu(tensor, "all_to_all");
  FIVEFOLD_CHECK(tensor.dim() >= 1, "all_to_all on '", name_, "': needs at least one dimension");
  FIVEFOLD_CHECK(
      static_cast<int>(send_sizes.size()) == size_ && static_cast<int>(recv_sizes.size()) == size_,
      "all_to_all on '", name_, "': need ", size_, " send and receive sizes, got ",
      send_sizes.size(), " and ", recv_sizes.size());
  int64_t sent = 0, received = 0;
  for (int i = 0; i < size_; ++i) {
    FIVEFOLD_CHECK(send_sizes[i] >= 0 && recv_sizes[i] >= 0, "all_to_all on '", name_,
                   "': negative size");
    sent += send_sizes[i];
    received += recv_sizes[i];
  }
  FIVEFOLD_CHECK(sent == tensor.size(0), "all_to_all on '", name_, "': send sizes add up to ", sent,
                 " rows but the tensor has ", tensor.size(0));
  const int64_t row_bytes = row_numel(tensor) * static_cast<int64_t>(tensor.element_size());
  const double wire = static_cast<double>((sent - send_sizes[rank_]) * row_bytes);
  torch::Tensor out = rows_like(tensor, received);
  auto body = [this, tensor, out, send_sizes, recv_sizes]() mutable {
    do_all_to_all(tensor.contiguous(), out, send_sizes, recv_sizes);
  };
  return issue(Op::AllToAll, nbytes(tensor), wire, out, std::move(body), -1, -1);
}

Work Communicator::broadcast_async(torch::Tensor tensor, int root) {
  check_cpu(tensor, "broadcast");
  check_peer(root, "broadcast");
  const double n = size_;
  auto body = [this, tensor, root]() mutable {
    if (tensor.numel() == 0) return;
    torch::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
    do_broadcast(work, root);
    if (!work.is_same(tensor)) tensor.copy_(work);
  };
  return issue(Op::Broadcast, nbytes(tensor), (n - 1) / n * nbytes(tensor), tensor, std::move(body),
               -1, -1);
}

Work Communicator::send_async(torch::Tensor tensor, int dst, int tag) {
  check_cpu(tensor, "send");
  check_peer(dst, "send");
  FIVEFOLD_CHECK(dst != rank_, "send on '", name_, "': rank ", rank_, " cannot send to itself");
  auto body = [this, tensor, dst, tag] { do_send(tensor.contiguous(), dst, tag); };
  return issue(Op::Send, nbytes(tensor), static_cast<double>(nbytes(tensor)), torch::Tensor(),
               std::move(body), dst, -1);
}

Work Communicator::recv_async(torch::Tensor tensor, int src, int tag) {
  check_cpu(tensor, "recv");
  check_peer(src, "recv");
  FIVEFOLD_CHECK(src != rank_, "recv on '", name_, "': rank ", rank_,
                 " cannot receive from itself");
  auto body = [this, tensor, src, tag]() mutable {
    torch::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
    do_recv(work, src, tag);
    if (!work.is_same(tensor)) tensor.copy_(work);
  };
  return issue(Op::Recv, nbytes(tensor), 0.0, tensor, std::move(body), -1, src);
}

Work Communicator::send_recv_async(torch::Tensor send_tensor, int dst, torch::Tensor recv_tensor,
                                   int src, int tag) {
  check_cpu(send_tensor, "send_recv");
  check_cpu(recv_tensor, "send_recv");
  check_peer(dst, "send_recv");
  check_peer(src, "send_recv");
  FIVEFOLD_CHECK((dst == rank_) == (src == rank_), "send_recv on '", name_,
                 "': sending to itself requires receiving from itself");
  const bool self = dst == rank_;
  auto body = [this, send_tensor, dst, recv_tensor, src, tag, self]() mutable {
    if (self) {
      recv_tensor.copy_(send_tensor);
      return;
    }
    torch::Tensor work = recv_tensor.is_contiguous() ? recv_tensor : recv_tensor.contiguous();
    do_send_recv(send_tensor.contiguous(), dst, work, src, tag);
    if (!work.is_same(recv_tensor)) recv_tensor.copy_(work);
  };
  const double wire = self ? 0.0 : static_cast<double>(nbytes(send_tensor));
  return issue(Op::SendRecv, nbytes(send_tensor), wire, recv_tensor, std::move(body), dst, src);
}

// The synchronous operations: the asynchronous ones, issued inline and waited for.
void Communicator::all_reduce(torch::Tensor& tensor, ReduceOp op) {
  InlineScope now;
  all_reduce_async(tensor, op).wait();
}

torch::Tensor Communicator::all_gather(const torch::Tensor& tensor) {
  InlineScope now;
  return all_gather_async(tensor).wait();
}

torch::Tensor Communicator::all_gather(const torch::Tensor& tensor,
                                       const std::vector<int64_t>& dim0_sizes) {
  FIVEFOLD_CHECK(!dim0_sizes.empty(), "all_gather on '", name_, "': dim0_sizes is empty");
  InlineScope now;
  return all_gather_async(tensor, dim0_sizes).wait();
}

torch::Tensor Communicator::reduce_scatter(const torch::Tensor& tensor, ReduceOp op) {
  InlineScope now;
  return reduce_scatter_async(tensor, op).wait();
}

torch::Tensor Communicator::reduce_scatter(const torch::Tensor& tensor,
                                           const std::vector<int64_t>& dim0_sizes, ReduceOp op) {
  FIVEFOLD_CHECK(!dim0_sizes.empty(), "reduce_scatter on '", name_, "': dim0_sizes is empty");
  InlineScope now;
  return reduce_scatter_async(tensor, op, dim0_sizes).wait();
}

torch::Tensor all_gather_along(Communicator& comm, const torch::Tensor& tensor, int64_t dim,
                               const std::vector<int64_t>& sizes) {
  const auto rows = tensor.movedim(dim, 0).contiguous();
  const auto gathered = sizes.empty() ? comm.all_gather(rows) : comm.all_gather(rows, sizes);
  return gathered.movedim(0, dim).contiguous();
}

torch::Tensor reduce_scatter_along(Communicator& comm, const torch::Tensor& tensor, int64_t dim,
                                   const std::vector<int64_t>& sizes, ReduceOp op) {
  const auto rows = tensor.movedim(dim, 0).contiguous();
  const auto part =
      sizes.empty() ? comm.reduce_scatter(rows, op) : comm.reduce_scatter(rows, sizes, op);
  return part.movedim(0, dim).contiguous();
}

torch::Tensor Communicator::all_to_all(const torch::Tensor& tensor,
                                       const std::vector<int64_t>& send_sizes,
                                       const std::vector<int64_t>& recv_sizes) {
  InlineScope now;
  return all_to_all_async(tensor, send_sizes, recv_sizes).wait();
}

void Communicator::broadcast(torch::Tensor& tensor, int root) {
  InlineScope now;
  broadcast_async(tensor, root).wait();
}

void Communicator::send(const torch::Tensor& tensor, int dst, int tag) {
  InlineScope now;
  send_async(tensor, dst, tag).wait();
}

void Communicator::recv(torch::Tensor& tensor, int src, int tag) {
  InlineScope now;
  recv_async(tensor, src, tag).wait();
}

void Communicator::send_recv(const torch::Tensor& send_tensor, int dst, torch::Tensor& recv_tensor,
                             int src, int tag) {
  InlineScope now;
  send_recv_async(send_tensor, dst, recv_tensor, src, tag).wait();
}

void Communicator::barrier() {
  InlineScope now;
  issue(
      Op::Barrier, 0, 0.0, torch::Tensor(), [this] { do_barrier(); }, -1, -1);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key, const std::string& name) {
  FIVEFOLD_CHECK(color >= 0, "split on '", name_, "': color must be >= 0, got ", color);
  // Everyone learns everyone's (color, key); then each rank knows its group's members in order.
  torch::Tensor mine =
      torch::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)}, torch::kInt64)
          .view({1, 2});
  torch::Tensor all = all_gather(mine);
  auto table = all.accessor<int64_t, 2>();
  std::vector<std::tuple<int64_t, int, int>> group;  // (key, old rank, old rank)
  for (int r = 0; r < size_; ++r) {
    if (table[r][0] == color) group.emplace_back(table[r][1], r, r);
  }
  std::sort(group.begin(), group.end());
  std::vector<int> members;
  for (const auto& entry : group) members.push_back(std::get<1>(entry));
  auto child = do_split(members, color, name);
  child->world_ranks_.clear();  // its members' places in the world, for messages
  for (int member : members) child->world_ranks_.push_back(world_rank(member));
  return child;
}

// ------------------------------------------------------------------------------------------------
// Offline: a rank's place without the other ranks
// ------------------------------------------------------------------------------------------------
namespace {

class OfflineCommunicator final : public Communicator {
 public:
  OfflineCommunicator(int rank, int size, std::string name)
      : Communicator(rank, size, std::move(name), Backend::Offline) {}
  ~OfflineCommunicator() override { drain_and_stop(); }

 protected:
  [[noreturn]] void refuse(const char* what) const {
    throw Error(std::string(what) + " on '" + name() +
                "': an offline communicator (rank " + std::to_string(rank()) + " of " +
                std::to_string(size()) + ", no other processes) cannot communicate");
  }
  void do_all_reduce(torch::Tensor&, ReduceOp) override { refuse("all_reduce"); }
  void do_all_gather(const torch::Tensor&, torch::Tensor&, const std::vector<int64_t>&) override {
    refuse("all_gather");
  }
  void do_reduce_scatter(const torch::Tensor&, torch::Tensor&, const std::vector<int64_t>&,
                         ReduceOp) override {
    refuse("reduce_scatter");
  }
  void do_all_to_all(const torch::Tensor&, torch::Tensor&, const std::vector<int64_t>&,
                     const std::vector<int64_t>&) override {
    refuse("all_to_all");
  }
  void do_broadcast(torch::Tensor&, int) override { refuse("broadcast"); }
  void do_send(const torch::Tensor&, int, int) override { refuse("send"); }
  void do_recv(torch::Tensor&, int, int) override { refuse("recv"); }
  void do_send_recv(const torch::Tensor&, int, torch::Tensor&, int, int) override {
    refuse("send_recv");
  }
  void do_barrier() override { refuse("barrier"); }
  std::shared_ptr<Communicator> do_split(const std::vector<int>&, int,
                                         const std::string&) override {
    refuse("split");
  }
};

}  // namespace

CommunicatorPtr offline_communicator(int rank, int size, const std::string& name) {
  FIVEFOLD_CHECK(size >= 1 && rank >= 0 && rank < size, "offline_communicator: rank ", rank,
                 " of ", size);
  return std::make_shared<OfflineCommunicator>(rank, size, name);
}

// ------------------------------------------------------------------------------------------------
// Ending the job
// ------------------------------------------------------------------------------------------------
void abort_job(int code, const std::string& reason) {
  // One write, so that lines from ranks aborting together do not interleave.
  const std::string line = "[rank " + std::to_string(detail::global_rank()) +
                           "] fivefold: aborting the job: " + reason + "\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  detail::forget_rendezvous();
  detail::abort_backend(code);
  std::_Exit(code);
}

}  // namespace fivefold::dist
