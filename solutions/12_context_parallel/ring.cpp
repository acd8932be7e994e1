// Chapter 12: ring attention and all-gather attention over the context-parallel ranks.

#include <algorithm>
#include <numeric>

#include "10_tensor_parallel/mappings.h"
#include "12_context_parallel/context_parallel.h"
#include "fivefold/error.h"

namespace fivefold::ch12 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every rank's key positions: how many each holds, then the positions themselves, in rank order.
struct KeyPositions {
  std::vector<int64_t> sizes;  // keys per rank
  torch::Tensor all;           // [Σ sizes], rank 0's first

  torch::Tensor of(int rank) const {
    const auto first =
        std::accumulate(sizes.begin(), sizes.begin() + rank, static_cast<int64_t>(0));
    return all.narrow(0, first, sizes[static_cast<size_t>(rank)]);
  }
};

KeyPositions gather_key_positions(const torch::Tensor& k_positions, dist::Communicator& cp) {
  KeyPositions p;
  auto sizes = cp.all_gather(torch::full({1}, k_positions.size(0), torch::kLong));
  p.sizes.assign(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + sizes.numel());
  p.all = cp.all_gather(k_positions.contiguous(), p.sizes);
  return p;
}

KeyPositions saved_key_positions(AutogradContext* ctx, const torch::Tensor& all) {
  KeyPositions p;
  p.all = all;
  for (const auto& size : ctx->saved_data["sizes"].toIntList()) p.sizes.push_back(size);
  return p;
}

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& q_positions,
                               const torch::Tensor& k_positions, double scale,
                               dist::CommunicatorPtr cp, bool overlap) {
    const int n = cp->size(), r = cp->rank();
    const int next = (r + 1) % n, previous = (r + n - 1) % n;
    const auto keys = gather_key_positions(k_positions, *cp);
    const int64_t d = k.size(3);
    // Keys and values travel together: one message per step, [batch, kv_heads, seq_r, d + v_dim].
    auto kv = torch::cat({k, v}, -1).contiguous();
    RunAccumulator total(q, q_positions, scale, ring_tile(q_positions.size(0)));
    for (int i = 0; i < n; ++i) {
      const int holder = (r - i + n) % n;  // whose keys this rank holds at step i
      // Start passing them on (and receiving the next ones) before computing with them.
      dist::Work arriving;
      torch::Tensor incoming;
      if (i + 1 < n) {
        const int from = (r - i - 1 + n) % n;
        incoming = torch::empty(
            {kv.size(0), kv.size(1), keys.sizes[static_cast<size_t>(from)], kv.size(3)},
            kv.options());
        arriving = cp->send_recv_async(kv, next, incoming, previous);
        if (!overlap) arriving.wait();  // (measuring only) the block is here before computing
      }
      // Only the pairs of position runs where some query sees some key (RunAccumulator).
      total.add(kv.narrow(-1, 0, d), kv.narrow(-1, d, kv.size(3) - d), keys.of(holder));
      if (i + 1 < n) kv = arriving.wait();
    }
    const auto result = total.result(v.size(3));
    ctx->save_for_backward({q, k, v, q_positions, keys.all, result.output, result.lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["sizes"] = c10::List<int64_t>(keys.sizes);
    ctx->saved_data["overlap"] = overlap;
    ch10::save_communicator(ctx, cp);
    ctx->mark_non_differentiable({result.lse});
    return {result.output, result.lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &q_positions = saved[3],
               &output = saved[5], &lse = saved[6];
    const auto keys = saved_key_positions(ctx, saved[4]);
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool overlap = ctx->saved_data["overlap"].toBool();
    auto cp = ch10::saved_communicator(ctx);
    const int n = cp->size(), r = cp->rank();
    const int next = (r + 1) % n, previous = (r + n - 1) % n;
    const int64_t d = k.size(3);
    const auto& grad_output = grads[0];
    auto delta = (grad_output * output).sum(-1);
    auto grad_q = torch::zeros_like(q);
    // The keys travel the ring again; with them, the gradient of their keys and values, to which
    // each rank adds its queries' share. After cp hops it is back with the keys' owner, complete.
    // This rank's share of a block is computed into a fresh buffer while the block's gradient so
    // far is still on its way from the previous rank; the two are added when it arrives.
    auto kv = torch::cat({k, v}, -1).contiguous();
    torch::Tensor grad_kv;
    dist::Work grad_arriving;
    for (int i = 0; i < n; ++i) {
      const int holder = (r - i + n) % n, from = (r - i - 1 + n) % n;
      auto shape = kv.sizes().vec();
      shape[2] = keys.sizes[static_cast<size_t>(from)];
      dist::Work arriving;
      if (i + 1 < n) {
        arriving = cp->send_recv_async(kv, next, torch::empty(shape, kv.options()), previous);
        if (!overlap) arriving.wait();
      }
      auto share = torch::zeros_like(kv);
      auto grad_k = share.narrow(-1, 0, d), grad_v = share.narrow(-1, d, kv.size(3) - d);
      add_block_gradients(q, kv.narrow(-1, 0, d), kv.narrow(-1, d, kv.size(3) - d), q_positions,
                          keys.of(holder), scale, ring_tile(q_positions.size(0)), grad_output, lse,
                          delta, grad_q, grad_k, grad_v);
      grad_kv = i == 0 ? share : grad_arriving.wait().add_(share);
      if (n > 1) {  // on to the next rank; what arrives is the gradient of the next block
        grad_arriving =
            cp->send_recv_async(grad_kv, next, torch::empty(shape, kv.options()), previous);
        if (!overlap) grad_arriving.wait();
      }
      if (i + 1 < n) kv = arriving.wait();
    }
    if (n > 1) grad_kv = grad_arriving.wait();  // this rank's own block, every rank's share in
    return {grad_q,
            grad_kv.narrow(-1, 0, d),
            grad_kv.narrow(-1, d, grad_kv.size(3) - d),
            {},
            {},
            {},
            {},
            {}};
  }
};

// [batch, heads, seq_r, w] on each rank -> [batch, heads, Σ seq_r, w], rank 0's first; backward:
// each rank's rows of the gradient summed over the ranks (a reduce-scatter with the same sizes).
class GatherSequence : public torch::autograd::Function<GatherSequence> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               std::vector<int64_t> sizes, dist::CommunicatorPtr cp) {
    ctx->saved_data["sizes"] = c10::List<int64_t>(sizes);
    ch10::save_communicator(ctx, cp);
    return dist::all_gather_along(*cp, x, 2, sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    std::vector<int64_t> sizes;
    for (const auto& size : ctx->saved_data["sizes"].toIntList()) sizes.push_back(size);
    // Every rank's queries read every rank's keys: the gradient of rank j's keys is the sum of
    // its rows over the ranks, summed where j gets its part (the gather's conjugate).
    auto cp = ch10::saved_communicator(ctx);
    return {dist::reduce_scatter_along(*cp, grads[0], 2, sizes), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

int64_t ring_tile(int64_t tokens) { return std::max<int64_t>(1, (tokens + 1) / 2); }

ch03::AttentionOutput ring_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& q_positions,
                                     const torch::Tensor& k_positions, double scale,
                                     const dist::CommunicatorPtr& cp, bool overlap) {
  auto out = RingAttention::apply(q, k, v, q_positions, k_positions, scale, cp, overlap);
  return {out[0], out[1]};
}

ch03::AttentionOutput all_gather_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const torch::Tensor& q_positions,
                                           const torch::Tensor& k_positions, double scale,
                                           const dist::CommunicatorPtr& cp, int64_t block) {
  const auto keys = gather_key_positions(k_positions, *cp);
  const int64_t d = k.size(3);
  auto kv = GatherSequence::apply(torch::cat({k, v}, -1), keys.sizes, cp);
  return blockwise_attention(q, kv.narrow(-1, 0, d), kv.narrow(-1, d, kv.size(3) - d), q_positions,
                             keys.all, scale, block);
}

ch03::AttentionOutput ContextParallelKernel::compute(const torch::Tensor& q, const torch::Tensor& k,
                                                     const torch::Tensor& v,
                                                     const torch::Tensor& q_positions,
                                                     const torch::Tensor& k_positions,
                                                     double scale) const {
  if (group_.attention == CpAttention::Ring) {
    return ring_attention(q, k, v, q_positions, k_positions, scale, group_.cp, group_.overlap);
  }
  return all_gather_attention(q, k, v, q_positions, k_positions, scale, group_.cp);
}

}  // namespace fivefold::ch12
