// Chapter 10: sequence parallelism's all-gather / reduce-scatter along the sequence, as autograd
// functions, and the plumbing that carries a communicator into backward.

#include "10_tensor_parallel/mappings.h"

#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch10 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What an autograd context can hold: a communicator, wrapped as a TorchScript capsule.
struct CommunicatorHolder : torch::CustomClassHolder {
  explicit CommunicatorHolder(dist::CommunicatorPtr c) : comm(std::move(c)) {}
  dist::CommunicatorPtr comm;
};

class GatherFromSequenceParallel : public torch::autograd::Function<GatherFromSequenceParallel> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t seq,
                               dist::CommunicatorPtr tp) {
    save_communicator(ctx, tp);
    return all_gather_sequence(x, seq, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {reduce_scatter_sequence(grads[0], *saved_communicator(ctx)), torch::Tensor(),
            torch::Tensor()};
  }
};

class ReduceScatterToSequenceParallel
    : public torch::autograd::Function<ReduceScatterToSequenceParallel> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, dist::CommunicatorPtr tp) {
    save_communicator(ctx, tp);
    ctx->saved_data["seq"] = x.size(1);
    return reduce_scatter_sequence(x, *tp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_sequence(grads[0], ctx->saved_data["seq"].toInt(), *saved_communicator(ctx)),
            torch::Tensor()};
  }
};

class ScatterToSequenceParallel : public torch::autograd::Function<ScatterToSequenceParallel> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, dist::CommunicatorPtr tp) {
    save_communicator(ctx, tp);
    ctx->saved_data["seq"] = x.size(1);
    const auto part = sequence_part(x.size(1), tp->rank(), tp->size());
    return x.narrow(1, part.first, part.length).clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_gather_sequence(grads[0], ctx->saved_data["seq"].toInt(), *saved_communicator(ctx)),
            torch::Tensor()};
  }
};

}  // namespace

void save_communicator(AutogradContext* ctx, const dist::CommunicatorPtr& comm) {
  ctx->saved_data["communicator"] =
      c10::IValue::make_capsule(c10::make_intrusive<CommunicatorHolder>(comm));
}

dist::CommunicatorPtr saved_communicator(AutogradContext* ctx) {
  auto capsule = ctx->saved_data.at("communicator").toCapsule();
  return static_cast<CommunicatorHolder*>(capsule.get())->comm;
}

GatheredSequence::GatheredSequence(const torch::Tensor& part, int64_t seq, dist::CommunicatorPtr tp)
    : part_(ch03::matmul_operand(part).detach()), seq_(seq), tp_(std::move(tp)) {}

torch::Tensor GatheredSequence::remake() {
  if (!whole_.defined()) whole_ = all_gather_sequence(part_, seq_, *tp_);
  auto whole = whole_;
  if (--readers_ <= 0) whole_ = torch::Tensor();  // the last reader: let it go
  return whole;
}

SequencePart sequence_part(int64_t seq, int rank, int size) {
  FIVEFOLD_CHECK(rank >= 0 && rank < size, "sequence_part: rank ", rank, " of ", size);
  return {split_offset(seq, rank, size), split_sizes(seq, size)[static_cast<size_t>(rank)]};
}

torch::Tensor all_gather_sequence(const torch::Tensor& x, int64_t seq, dist::Communicator& tp) {
  FIVEFOLD_CHECK(x.dim() >= 2, "all_gather_sequence: x must be [batch, seq, ...], got ", x.sizes());
  const auto sizes = split_sizes(seq, tp.size());
  FIVEFOLD_CHECK(x.size(1) == sizes[static_cast<size_t>(tp.rank())], "all_gather_sequence: rank ",
                 tp.rank(), " holds ", x.size(1), " positions, its part of ", seq, " is ",
                 sizes[static_cast<size_t>(tp.rank())]);
  return dist::all_gather_along(tp, x, 1, sizes);
}

torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, dist::Communicator& tp) {
  FIVEFOLD_CHECK(x.dim() >= 2, "reduce_scatter_sequence: x must be [batch, seq, ...], got ",
                 x.sizes());
  return dist::reduce_scatter_along(tp, x, 1);
}

torch::Tensor gather_from_sequence_parallel(const torch::Tensor& x, int64_t seq,
                                            const dist::CommunicatorPtr& tp) {
  return GatherFromSequenceParallel::apply(x, seq, tp);
}

torch::Tensor reduce_scatter_to_sequence_parallel(const torch::Tensor& x,
                                                  const dist::CommunicatorPtr& tp) {
  return ReduceScatterToSequenceParallel::apply(x, tp);
}

torch::Tensor scatter_to_sequence_parallel(const torch::Tensor& x,
                                           const dist::CommunicatorPtr& tp) {
  return ScatterToSequenceParallel::apply(x, tp);
}

}  // namespace fivefold::ch10
