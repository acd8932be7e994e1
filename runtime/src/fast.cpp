// Fast paths for the single-device step (fast.h): the lesson's formulas, fewer passes over memory.

#include "runtime/fast.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/ScopeExit.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <typeinfo>
#include <vector>

#include "03_transformer/heads.h"
#include "06_mla/mla.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/plan.h"
#include "fivefold/blas.h"
#include "fivefold/error.h"
#include "runtime/parallel.h"

namespace fivefold::runtime {

using namespace fivefold::ch03;

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// a [b, h, m, k] · b [b, h, k, n], one product per head, in the kernel's result type: on the
// MatmulKernel set (oneDNN with the fast paths, bf16 under chapter 14's kernel), torch::matmul
// otherwise.
torch::Tensor head_products(const torch::Tensor& a, const torch::Tensor& b) {
  const MatmulKernel* kernel = matmul_kernel();
  if (kernel == nullptr) return torch::matmul(a, b);
  return kernel->bmm(a.flatten(0, 1), b.flatten(0, 1))
      .view({a.size(0), a.size(1), a.size(2), b.size(3)});
}

// The scores of a tile of queries q_tile [b, h, T, d] (already scaled) against the keys it can
// see, keys [b, h, end, d]: the tile's queries are the last T positions before `end`, so only the
// tile's diagonal block [T, T] (the last T keys) has keys after a query, which causal_tile_exp
// masks.
torch::Tensor tile_scores(const torch::Tensor& q_tile, const torch::Tensor& keys) {
  return head_products(q_tile, keys.transpose(-2, -1));  // [b, h, T, end]
}

class TiledCausalAttention : public torch::autograd::Function<TiledCausalAttention> {
 public:
  // q [b, h, sq, d], k [b, hk, sk, d], v [b, hk, sk, dv]; query i sits at position sk - sq + i.
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale, int64_t tile) {
    const int64_t heads = q.size(1), seq_q = q.size(2), offset = k.size(2) - seq_q;
    // The output and the log-sum-exp in fp32 at least, whatever q's type (bf16 when chapter 14's
    // products hand q, k and v on: takes_narrow_inputs).
    const auto type = at::promote_types(q.scalar_type(), torch::kFloat);
    // The operands laid out and converted once to the kernel's form (bf16 under chapter 14's
    // kernel); q is scaled in fp32 (a bf16 product with the scale would round the scale too),
    // then rounded. (The scale inside the tiles' exponential instead, one copy of q fewer, moved
    // the bf16 parity matrix past its tolerance: chapter 14's notes §6.)
    auto qs = matmul_operand(
        q.to(type, /*non_blocking=*/false, /*copy=*/true, c10::MemoryFormat::Contiguous)
            .mul_(scale));
    auto keys = matmul_operand(expand_heads(k, heads).contiguous());
    auto values = matmul_operand(expand_heads(v, heads).contiguous());
    auto out = torch::empty({q.size(0), heads, seq_q, v.size(3)}, q.options().dtype(type));
    auto lse = torch::empty({q.size(0), heads, seq_q}, q.options().dtype(type));
    // A full tile's future keys (its diagonal block's strict upper triangle); the top-left corner
    // serves a shorter last tile.
    const auto future = torch::ones({tile, tile}, torch::kBool).triu(1);
    for (int64_t first = 0; first < seq_q; first += tile) {
      const int64_t t = std::min(tile, seq_q - first), end = offset + first + t;
      auto e = tile_scores(qs.narrow(2, first, t), keys.narrow(2, 0, end));
      // Softmax as max, exp and a sum (in the output's type); the division by the sum waits for
      // the output's rows.
      const auto [max, sum] = causal_tile_exp(e, future, /*with_sum=*/true);
      out.narrow(2, first, t).copy_(head_products(e, values.narrow(2, 0, end))).div_(sum);
      lse.narrow(2, first, t).copy_((max + sum.log()).squeeze(-1));
    }
    ctx->save_for_backward({qs, keys, values, out, lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["tile"] = tile;
    ctx->saved_data["kv_heads"] = k.size(1);
    // Each input's own type, for its gradient (under RoPE q and k arrive in fp32, v in bf16).
    ctx->saved_data["q_type"] = q.scalar_type();
    ctx->saved_data["k_type"] = k.scalar_type();
    ctx->saved_data["v_type"] = v.scalar_type();
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &qs = saved[0], &keys = saved[1], &values = saved[2], &out = saved[3],
               &lse = saved[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t tile = ctx->saved_data["tile"].toInt();
    const int64_t kv_heads = ctx->saved_data["kv_heads"].toInt();
    const int64_t seq_q = qs.size(2), offset = keys.size(2) - seq_q;
    const auto grad_out = grads[0].contiguous();
    // Softmax's backward needs Σ_j p_j·(dO·v_j) per query, which is dO·O.
    const auto delta = (grad_out * out).sum(-1, /*keepdim=*/true);  // [b, h, sq, 1]
    auto grad_q = torch::empty(qs.sizes(), grad_out.options());
    auto grad_keys = torch::zeros(keys.sizes(), grad_out.options());
    auto grad_values = torch::zeros(values.sizes(), grad_out.options());
    const auto future = torch::ones({tile, tile}, torch::kBool).triu(1);
    // The probabilities themselves, p = exp(s − lse), from forward's log-sum-exp: no max, no sum
    // (FlashAttention's backward). ∂L/∂v = pᵀ·dO and ∂L/∂s = p∘(dO·vᵀ − δ).
    const auto dout = matmul_operand(grad_out);
    for (int64_t first = 0; first < seq_q; first += tile) {
      const int64_t t = std::min(tile, seq_q - first), end = offset + first + t;
      const auto q_tile = qs.narrow(2, first, t), k_seen = keys.narrow(2, 0, end);
      const auto v_seen = values.narrow(2, 0, end), dout_tile = dout.narrow(2, first, t);
      auto p = tile_scores(q_tile, k_seen);
      causal_tile_exp(p, future, /*with_sum=*/false, lse.narrow(2, first, t).unsqueeze(-1));
      grad_values.narrow(2, 0, end).add_(head_products(p.transpose(-2, -1), dout_tile));
      // ∂L/∂s in the products' type: both products below read it as it is.
      auto grad_scores = head_products(dout_tile, v_seen.transpose(-2, -1));
      softmax_tile_backward(grad_scores, p, delta.narrow(2, first, t));
      grad_q.narrow(2, first, t).copy_(head_products(grad_scores, k_seen)).mul_(scale);
      grad_keys.narrow(2, 0, end).add_(head_products(grad_scores.transpose(-2, -1), q_tile));
    }
    auto type_of = [&](const char* input) { return ctx->saved_data[input].toScalarType(); };
    return {grad_q.to(type_of("q_type")), fold_heads(grad_keys, kv_heads).to(type_of("k_type")),
            fold_heads(grad_values, kv_heads).to(type_of("v_type")), {}, {}};
  }
};

// AdamW on n elements: both moments, the decoupled decay and the step. This file compiles with
// -fno-math-errno (CMakeLists.txt): sqrt then need not set errno, and the compiler (GCC or
// clang) vectorises the loop, whose sqrt and division are its costly part.
template <typename T>
void adamw_span(T* __restrict__ w, T* __restrict__ m, T* __restrict__ v, const T* __restrict__ g,
                int64_t n, T b1, T b2, T c1, T c2, T keep, T size, T root, T eps) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = m[i] * b1 + g[i] * c1;
    v[i] = v[i] * b2 + g[i] * g[i] * c2;
    w[i] = w[i] * keep - size * m[i] / (std::sqrt(v[i]) / root + eps);
  }
}

}  // namespace

TiledCausalAttentionKernel::TiledCausalAttentionKernel(int64_t tile) : tile_(tile) {
  FIVEFOLD_CHECK(tile > 0, "TiledCausalAttentionKernel: a tile holds at least one query, got ",
                 tile);
}

int64_t TiledCausalAttentionKernel::scores(int64_t seq) const {
  int64_t total = 0;
  for (int64_t first = 0; first < seq; first += tile_) {
    const int64_t t = std::min(tile_, seq - first);
    total += t * (first + t);  // the forward loop's tile against keys 0 .. end
  }
  return total;
}

AttentionOutput TiledCausalAttentionKernel::compute(const torch::Tensor& q, const torch::Tensor& k,
                                                    const torch::Tensor& v,
                                                    const torch::Tensor& q_positions,
                                                    const torch::Tensor& k_positions,
                                                    double scale) const {
  const int64_t seq_q = q.size(2);
  FIVEFOLD_CHECK(q_positions.size(0) == seq_q && k_positions.size(0) == k.size(2) &&
                     CausalAttentionKernel::causal_layout(q_positions, k_positions),
                 "the tiled attention kernel needs keys at consecutive positions and queries at "
                 "the last of them; other layouts need another kernel (chapter 12)");
  FIVEFOLD_CHECK(q.size(1) % k.size(1) == 0, "attention: ", k.size(1),
                 " key/value heads do not divide ", q.size(1), " query heads");
  if (seq_q == 0) {
    return {torch::zeros({q.size(0), q.size(1), 0, v.size(3)}, q.options()),
            torch::zeros({q.size(0), q.size(1), 0}, q.options())};
  }
  auto result = TiledCausalAttention::apply(q, k, v, scale, tile_);
  return {result[0], result[1]};
}

FusedRotaryEmbedding::FusedRotaryEmbedding(std::shared_ptr<const ch04::RotaryEmbedding> lesson)
    : lesson_(std::move(lesson)) {
  FIVEFOLD_CHECK(lesson_ && lesson_->layout() == ch04::RopeLayout::HalfSplit,
                 "FusedRotaryEmbedding rotates half-split pairs only");
}

std::pair<torch::Tensor, torch::Tensor> FusedRotaryEmbedding::encode(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions) const {
  const auto [cos, sin] = lesson_->angles(positions);
  // The form the products multiply an activation in: what the kernel hands its results on in
  // (bf16 under chapter 14's kernel; fp32, or wider, otherwise).
  auto type = at::promote_types(q.scalar_type(), torch::kFloat);
  if (const MatmulKernel* kernel = matmul_kernel()) type = kernel->result_type(type);
  return {rotate_half_split(q, cos, sin, type), rotate_half_split(k, cos, sin, type)};
}

FusedSwiGLUMlpImpl::FusedSwiGLUMlpImpl(const MlpImpl& lesson) {
  gate_proj = register_module("gate_proj", lesson.gate_proj);
  up_proj = register_module("up_proj", lesson.up_proj);
  down_proj = register_module("down_proj", lesson.down_proj);
}

torch::Tensor FusedSwiGLUMlpImpl::forward(const torch::Tensor& x) {
  return down_proj(swiglu(gate_proj(x), up_proj(x)));
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    FIVEFOLD_CHECK(!o.amsgrad(), "FusedAdamW: amsgrad is not supported");
    const double lr = o.lr(), decay = 1.0 - o.lr() * o.weight_decay(), eps = o.eps();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      // LibTorch's AdamW keeps each parameter's state under its TensorImpl's address.
      auto& slot = state_[c10::guts::to_string(p.unsafeGetTensorImpl())];
      if (!slot) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
        fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Contiguous));
        slot = std::move(fresh);
      }
      auto& s = static_cast<torch::optim::AdamWParamState&>(*slot);
      s.step(s.step() + 1);
      const double correction1 = 1.0 - std::pow(beta1, static_cast<double>(s.step()));
      const double correction2 = 1.0 - std::pow(beta2, static_cast<double>(s.step()));
      const double step_size = lr / correction1, root2 = std::sqrt(correction2);
      const auto grad = p.grad().contiguous();
      FIVEFOLD_CHECK(p.is_contiguous() && s.exp_avg().is_contiguous() &&
                         s.exp_avg_sq().is_contiguous() && grad.scalar_type() == p.scalar_type(),
                     "FusedAdamW: parameters and their state must be contiguous, of one dtype");
      AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "fused_adamw", [&] {
        scalar_t* w = p.data_ptr<scalar_t>();
        scalar_t* m = s.exp_avg().data_ptr<scalar_t>();
        scalar_t* v = s.exp_avg_sq().data_ptr<scalar_t>();
        const scalar_t* g = grad.data_ptr<scalar_t>();
        const auto b1 = static_cast<scalar_t>(beta1), b2 = static_cast<scalar_t>(beta2);
        const auto c1 = static_cast<scalar_t>(1 - beta1), c2 = static_cast<scalar_t>(1 - beta2);
        const auto keep = static_cast<scalar_t>(decay), size = static_cast<scalar_t>(step_size);
        const auto root = static_cast<scalar_t>(root2), e = static_cast<scalar_t>(eps);
        parallel_chunks(0, p.numel(), 1 << 14, [=](int64_t begin, int64_t end) {
          adamw_span(w + begin, m + begin, v + begin, g + begin, end - begin, b1, b2, c1, c2, keep,
                     size, root, e);
        });
      });
    }
  }
  return loss;
}

std::unique_ptr<torch::optim::AdamW> fused_adamw(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const torch::optim::AdamWOptions& defaults) {
  return std::make_unique<FusedAdamW>(std::move(groups), defaults);
}

std::shared_ptr<const MatmulKernel> fast_matmul_kernel() {
  if (!OneDnnMatmulKernel::available()) return nullptr;
  // oneDNN's product against at::mm on each layout linear uses: x·Wᵀ, dy·W and dyᵀ·x.
  auto generator = at::detail::createCPUGenerator(23);
  const auto a = torch::randn({37, 19}, generator), b = torch::randn({29, 19}, generator);
  auto onednn = std::make_shared<const OneDnnMatmulKernel>();
  const double gap = std::max({(onednn->mm(a, b.t()) - a.mm(b.t())).abs().max().item<double>(),
                               (onednn->mm(a.t(), a) - a.t().mm(a)).abs().max().item<double>(),
                               (onednn->mm(a, a.t()) - a.mm(a.t())).abs().max().item<double>()});
  FIVEFOLD_CHECK(gap < 1e-4, "oneDNN's matrix product and at::mm differ by ", gap,
                 " on a test input (run with --lesson-kernels to multiply with at::mm alone)");
  return onednn;
}

double matmul_peak_gflops(int n) {
  const MatmulKernel* kernel = matmul_kernel();
  if (kernel == nullptr) return measure_matmul_gflops(n);
  return measure_matmul_gflops(
      n, [kernel](const torch::Tensor& a, const torch::Tensor& b) { return kernel->mm(a, b); });
}

int64_t block_activation_bytes(const ch02::TransformerShape& whole, int64_t batch, int64_t seq,
                               ch14::Precision precision, ch14::Recompute mode,
                               const ch14::TensorParallelShare& tp,
                               const ch14::ContextParallelShare& cp) {
  // On a rank of cp, its s_r tokens of every row; under recomputation the kernel is checkpointed,
  // and what the block keeps is the one-device count at s_r tokens, except that chapter 12's
  // kernel, which the checkpointed core runs here, takes q, k and v widened to fp32 (the tiled
  // kernel as they come).
  const int64_t s_r = cp.tokens(seq);
  if (cp.ranks > 1 && mode != ch14::Recompute::None) {
    int64_t widened = 0;
    if (mode == ch14::Recompute::Selective) {
      const auto mine =
          ch10::rank_shape(whole, static_cast<int>(tp.ranks), static_cast<int>(tp.rank));
      widened = batch * s_r * (4 - ch14::bytes_per_number(precision)) *
                (mine.n_heads + 2 * mine.n_kv_heads) * mine.head_dim;
    }
    return block_activation_bytes(whole, batch, s_r, precision, mode, tp) + widened;
  }
  // On a rank of tp, its heads (key/value heads: one, shared, when there are fewer than ranks)
  // and its part of d_ff; with sequence parallelism its own tokens of the residual stream.
  const ch02::TransformerShape shape =
      ch10::rank_shape(whole, static_cast<int>(tp.ranks), static_cast<int>(tp.rank));
  const int64_t own = tp.own(s_r);
  const int64_t d = shape.d_model, f = shape.d_ff, h = shape.n_heads, hd = shape.head_dim;
  const int64_t kv = shape.n_kv_heads;
  const int64_t rounded = ch14::bytes_per_number(precision);  // bytes a kept operand
  const int64_t tokens = batch * s_r;
  // Per token: the norms' inputs and 1/rms, for the rank's own tokens (2d + 2), and their
  // outputs as the linear maps keep them (rounded; under sequence parallelism the rank's part,
  // 2d); the attention's output and log-sum-exp over all its tokens; the other linear maps'
  // inputs rounded, and SwiGLU's gate and up (swiglu), which the products hand on in their own
  // type; chapter 10's split MLP (tp > 1) keeps silu(gate) too.
  const int64_t residual = 2 * d + 2, norm_outputs = 2 * d;
  int64_t fp32 = h * hd + h, operands = h * hd + (tp.ranks == 1 ? 3 : 4) * f;
  int64_t bytes = 4 * s_r * hd;  // RoPE's cos and sin rows for its positions
  if (cp.ranks == 1) {
    operands += 3 * h * hd;  // the tiled kernel's q, k and v, rounded, at every query head
  } else {
    // Chapter 12's kernel keeps q in fp32, the ring its own keys and values, all-gather every
    // rank's (at their own heads, fp32), and every rank's key positions.
    fp32 += h * hd;
    if (cp.attention == ch12::CpAttention::Ring)
      fp32 += 2 * kv * hd;
    else
      bytes += 4 * batch * seq * kv * 2 * hd;
    bytes += 8 * seq;  // every rank's key positions
  }
  const int64_t none = bytes + tokens * (4 * fp32 + rounded * operands) +
                       batch * own * (4 * residual + rounded * norm_outputs);
  if (mode == ch14::Recompute::Full) return 4 * batch * own * d;  // the block's input
  if (mode == ch14::Recompute::None) return none;
  // Selective: the checkpointed core keeps its inputs, q and k, v at their own heads, as the tiled
  // kernel inside takes them (rounded: bf16 as the products and the fused RoPE hand them on),
  // instead of what the tiled kernel kept: its output, its log-sum-exp and q, k, v rounded and at
  // every query head.
  return none - tokens * (4 * (h * hd + h) + rounded * 3 * h * hd - rounded * (h + 2 * kv) * hd);
}

int64_t block_activation_bytes(const ModelConfig& config, int64_t layer, int64_t batch, int64_t seq,
                               ch14::Precision precision, ch14::Recompute mode,
                               const ch14::TensorParallelShare& tp,
                               const ch14::ContextParallelShare& cp,
                               const ch14::ExpertParallelShare& ep) {
  if (config.extensions.is_null())
    return block_activation_bytes(config.shape(), batch, seq, precision, mode, tp, cp);
  const int64_t lesson =
      ch14::deepseek_block_activation_bytes(config, layer, batch, seq, mode, tp, cp, precision, ep);
  if (mode == ch14::Recompute::Full) return lesson;  // the block's input (and routing) alone
  const auto mla = ch06::MlaConfig::from_json(config.extensions);
  const int64_t d = config.d_model, h = config.n_heads / tp.ranks, n = mla.qk_nope_head_dim;
  const int64_t r = mla.qk_rope_head_dim, dv = mla.v_head_dim;
  const int64_t s_r = cp.tokens(seq), tokens = batch * s_r, own = batch * tp.own(s_r);
  // The fused norms keep their input and 1/rms, 2 floats a number fewer than the lesson's: the
  // two on the residual stream (the rank's own tokens), the latents' (whole on every tp rank),
  // and in fp32 kv_a_layernorm's input no longer holds kv_a_proj's rotary part (r) alive (in
  // bf16 the lesson's norm widens a copy of its own and holds none either).
  const bool bf16 = precision == ch14::Precision::Bf16;
  int64_t bytes = lesson - 4 * own * 4 * d -
                  4 * tokens * (2 * (mla.q_lora_rank + mla.kv_lora_rank) + (bf16 ? 0 : r));
  // A dense layer's MLP on swiglu (tp = 1) keeps no silu(gate).
  const bool dense = !ch07::MoeConfig::from_json(config.extensions).is_moe_layer(layer);
  if (dense && tp.ranks == 1) bytes -= ch14::bytes_per_number(precision) * tokens * config.d_ff;
  // Selective in bf16: the core keeps k and v as the tiled kernel inside reads them, rounded to
  // bf16 (2 bytes a number where the lesson's kernel keeps k and v widened to fp32: 2h(n + r + dv)
  // fewer a token); q reaches it in fp32 either way (its rotary part is).
  if (mode == ch14::Recompute::Selective && bf16 && cp.ranks == 1)
    bytes -= 2 * tokens * h * (n + r + dv);
  if (mode == ch14::Recompute::Selective || cp.ranks > 1) return bytes;  // no tiled kernel
  // The tiled kernel: no probabilities, no mask, no whole kv_b_proj output for one row; its own
  // contiguous v and its log-sum-exp; in bf16 q, k and v rounded.
  bytes += 4 * tokens * h * (dv + 1) - 4 * batch * h * seq * seq - seq * seq;
  if (batch == 1 && !bf16) bytes -= 4 * tokens * h * n;  // (bf16: the lesson's has none)
  if (bf16) bytes -= 2 * tokens * h * (2 * (n + r) + dv);
  return bytes;
}

FastPaths install_fast_paths(Transformer& model) {
  FastPaths installed;
  auto tiled = std::make_shared<const TiledCausalAttentionKernel>();
  auto norm = std::make_shared<const FusedRMSNormKernel>();
  std::map<const ch04::RotaryEmbedding*, std::shared_ptr<const FusedRotaryEmbedding>> rotary;
  bool checked = false;
  for (const auto& item : model->named_modules()) {
    auto* layer = dynamic_cast<AttentionLayer*>(item.value().get());
    if (layer != nullptr && dynamic_cast<const CausalAttentionKernel*>(layer->kernel.get())) {
      if (!checked) {
        // The tiled kernel against the lesson's on a small grouped-query input with two tiles,
        // in fp32 whatever `linear` multiplies with now (a bf16 run installs the fast paths in
        // the whole model it evaluates after its bf16 kernel is set).
        torch::NoGradGuard no_grad;
        const auto put_back = c10::make_scope_exit(
            [kernel = set_matmul_kernel(nullptr)] { set_matmul_kernel(kernel); });
        auto generator = at::detail::createCPUGenerator(17);
        auto q = torch::randn({1, 4, 5, 8}, generator), k = torch::randn({1, 2, 7, 8}, generator);
        auto v = torch::randn({1, 2, 7, 6}, generator);
        const auto want =
            layer->kernel->attend(q, k, v, position_range(2, 5), position_range(0, 7), 0.3);
        const auto got = TiledCausalAttentionKernel(3).attend(q, k, v, position_range(2, 5),
                                                              position_range(0, 7), 0.3);
        const double gap = std::max((want.output - got.output).abs().max().item<double>(),
                                    (want.lse - got.lse).abs().max().item<double>());
        FIVEFOLD_CHECK(gap < 1e-5, "the tiled attention kernel and causal_attention differ by ",
                       gap,
                       " on a test input: one of them is wrong (run with --lesson-kernels "
                       "to train on causal_attention alone)");
        checked = true;
      }
      layer->kernel = tiled;
      ++installed.attention_kernels;
      // RoPE fused for the layers whose q and k go from attend_heads to the tiled kernel alone.
      auto rope = std::dynamic_pointer_cast<const ch04::RotaryEmbedding>(layer->encoding);
      const auto& layer_type = typeid(*layer);
      const ch03::PositionEncoding* encoding = layer->encoding.get();
      if ((layer_type == typeid(AttentionImpl) ||
           layer_type == typeid(ch10::TensorParallelAttentionImpl)) &&
          rope && typeid(*encoding) == typeid(ch04::RotaryEmbedding) &&
          rope->layout() == ch04::RopeLayout::HalfSplit) {
        auto& fused = rotary[rope.get()];
        if (!fused) fused = std::make_shared<const FusedRotaryEmbedding>(rope);
        layer->encoding = fused;
        ++installed.rotary;
      }
    }
    auto* block = dynamic_cast<BlockImpl*>(item.value().get());
    const FeedForwardLayer* mlp = block != nullptr ? block->mlp.get() : nullptr;
    if (mlp != nullptr && typeid(*mlp) == typeid(MlpImpl)) {  // not a subclass, nor experts
      block->set_mlp(std::make_shared<FusedSwiGLUMlpImpl>(static_cast<const MlpImpl&>(*mlp)));
      ++installed.mlps;
    }
    auto* rms = dynamic_cast<RMSNormImpl*>(item.value().get());
    if (rms != nullptr && !rms->kernel) {
      rms->kernel = norm;
      ++installed.norms;
    }
  }
  if (matmul_kernel() == nullptr) {
    auto kernel = fast_matmul_kernel();
    installed.matmul = kernel != nullptr;
    set_matmul_kernel(std::move(kernel));
  }
  return installed;
}

}  // namespace fivefold::runtime
