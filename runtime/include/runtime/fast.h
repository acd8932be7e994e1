#pragma once
/// @file fast.h
/// @brief Fast paths for the training step: the same mathematics as chapter 03's modules, computed
/// with fewer passes over memory and fewer operations. No chapter teaches them; each fills a slot
/// chapter 03's code already has (the attention kernel, a block's MLP, the norm's kernel,
/// `linear`'s matmul kernel, TrainConfig::make_adamw, an attention layer's position encoding), is
/// tested against the lesson's version
/// (tests/runtime/test_fast.cpp), and is installed by the training run unless `RunConfig::fast` is
/// off (`fivefold train --lesson-kernels`). Read after chapter 12, whose blockwise attention the
/// tiled kernel shares.

#include <torch/torch.h>

#include <cstdint>

#include <memory>
#include <vector>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"
#include "04_rope/rope.h"
#include "14_memory/plan.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"

namespace fivefold::runtime {

/// Causal attention one tile of queries at a time, each tile against only the keys it can see:
/// the masked half of the score matrix is never computed (at seq 256 with tiles of 128, 3 of the
/// 4 blocks are), and neither the full score matrix nor the probabilities are kept for
/// backward, which recomputes each tile's probabilities from its log-sum-exp (as chapter 12's
/// blockwise attention does). The softmax is written as max, exp, sum over the visible scores and
/// one division of the output rows, so forward touches each score four times and backward four.
/// The same layout as CausalAttentionKernel (keys at consecutive positions, queries the last of
/// them); any other is refused with fivefold::Error.
class TiledCausalAttentionKernel : public ch03::AttentionKernel {
 public:
  /// The tile the training run's kernel uses.
  static constexpr int64_t kDefaultTile = 128;
  /// Queries per tile (> 0).
  explicit TiledCausalAttentionKernel(int64_t tile = kDefaultTile);
  /// The scores it computes per row and query head for `seq` queries over as many keys (backward
  /// computes each once more): each tile of t queries ending at position e against keys 0 .. e,
  /// Σ t·(e + 1): chapter 12's visible_scores of those positions in tiles of `tile`. One tile
  /// (seq <= tile) is the whole seq x seq square.
  int64_t scores(int64_t seq) const;
  ch03::AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& q_positions,
                                const torch::Tensor& k_positions, double scale) const override;
  /// On a MatmulKernel (chapter 14's bf16 one among them) the kernel rounds q, k and v to the
  /// products' operands itself: bf16 ones are laid out as they are, not widened and rounded back.
  bool takes_narrow_inputs() const override { return ch03::matmul_kernel() != nullptr; }

 private:
  int64_t tile_;
};

/// RMSNorm as one pass forward (per row: Σx², then x·rstd·w) and one backward
/// (∂x = rstd·(g − x·rstd²·mean(g·x)) with g = ∂y·w; ∂w = Σ_rows ∂y·x·rstd), on ATen's threads
/// (parallel.h), instead of the six operations forward and about a dozen backward that autograd
/// records for the formula. x in float32 or float64; the weight in x's type or a narrower one (a
/// bf16 weight, chapter 14's master weights, is read widened; its gradient returns in its own
/// type). With the AVX-512 loops (`avx512_loops`) and x in fp32, sixteen numbers at a time, each
/// sum in sixteen running parts; elsewhere plain loops, whose sums run one number after another (a
/// compiler keeps a float sum's order).
class FusedRMSNormKernel : public ch03::NormKernel {
 public:
  torch::Tensor normalize(const torch::Tensor& x, const torch::Tensor& weight,
                          double eps) const override;
};

/// torch::optim::AdamW with each parameter's update done in one pass over its elements
/// (decay, both moments, bias corrections and the step), instead of the seven tensor operations of
/// LibTorch's loop. The state is AdamW's own (AdamWParamState under the same keys), so
/// adamw::state_by_name, adamw::load_state and every step that holds a torch::optim::AdamW work
/// unchanged. amsgrad is not supported (refused). The training run makes chapter 03's
/// make_optimizer build it (TrainConfig::make_adamw = fused_adamw).
class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  /// One AdamW step of every parameter with a gradient, as torch::optim::AdamW::step computes
  /// it; the closure, if given, is evaluated first and its loss returned.
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// Bytes of tensor storage one block of chapter 03's Llama keeps from forward to backward with the
/// fast paths installed (the tiled attention and the fused RMSNorm), for `batch` rows of `seq`
/// tokens, in fp32 or bf16 (chapter 14's Bf16MatmulKernel). Chapter 14's
/// ch14::block_activation_bytes counts the lesson's kernels; here, per token: each norm keeps its
/// input and 1/rms (the residual after attention, the block's output: 2d + 2), the four linear
/// maps' inputs (2d + h·hd + f), SwiGLU's gate and up (2f: swiglu; chapter 10's split MLP, which
/// the trainer builds for tp > 1, keeps silu(gate) too, 3f), and the tiled attention q
/// scaled, k and v at h heads, its output and its log-sum-exp (4·h·hd + h); no score, no
/// probability, no mask. In bf16 the linear maps' inputs and the attention's q, k and v are
/// kept at 2 bytes. Plus RoPE's cos and sin, 4s·hd. With chapter 14's recomputation (`mode`):
/// Full keeps the block's input alone, 4bsd; Selective checkpoints the attention core, which
/// keeps its inputs as the tiled kernel inside takes them (q and k, v at their own h_kv heads, in
/// bf16 as the products hand them on) instead of what the tiled kernel kept (its output, its
/// log-sum-exp, q, k and v rounded and at every query head).
/// On a rank of tp (`tp`): its heads and part of d_ff (chapter 10's rank_shape), and with sequence
/// parallelism the norms' inputs and 1/rms for its own tokens only. On a rank of cp (`cp`, alone
/// or with tp): its s_r tokens, chapter 12's kernel in the tiled one's place, which keeps q in
/// fp32 (not rounded), the ring its own keys and values at their h_kv heads in fp32, all-gather
/// every rank's (4b·s·h_kv·2hd), and every rank's key positions (8s); under recomputation the
/// one-device count at s_r tokens. Measured by the runtime's tests, on every rank of tp 1, 2
/// and 4, cp 2 and 4 and tp 2 x cp 2.
int64_t block_activation_bytes(const ch02::TransformerShape& shape, int64_t batch, int64_t seq,
                               ch14::Precision precision = ch14::Precision::Fp32,
                               ch14::Recompute mode = ch14::Recompute::None,
                               const ch14::TensorParallelShare& tp = {},
                               const ch14::ContextParallelShare& cp = {});

/// The same for block `layer` (from 0) of `config`: a Llama-shaped block as above; a
/// DeepSeek-V3-shaped one (chapter 06's MLA, chapter 07's MoE) as chapter 14's
/// ch14::deepseek_block_activation_bytes counts it for the lesson's kernels, less, per token,
/// what the fused norms do not keep (2 floats a number of the two norms on the residual stream,
/// the rank's own tokens, and of the two latents' norms, whose kv_a_layernorm input no longer
/// holds kv_a_proj's rotary part alive: 4(4d) + 4(2(q_lora + d_c) + r)), and without
/// recomputation or cp, the tiled kernel in the lesson's place: no probabilities 4b·h·s², no mask
/// s², no whole kv_b_proj output for a single row (4h·n a token); its own contiguous v and its
/// log-sum-exp, 4h(dv + 1) a token; in bf16 q, k and v rounded, 2h(2(n + r) + dv) bytes fewer a
/// token (h: the rank's heads under tp); a dense layer's MLP on swiglu at tp 1 keeps no
/// silu(gate) (d_ff numbers a token fewer, in any mode but Full); under selective recomputation
/// in bf16 (without cp) the checkpointed core keeps k and v rounded to bf16, as the tiled kernel
/// inside reads them, not widened, 2h(n + r + dv) bytes fewer a token; under ep a MoE block's term for
/// the rows the routing sent the rank's experts, as chapter 14 counts it (the fast paths do not
/// touch the experts). Measured by the runtime's tests on one device and on every rank of tp, cp,
/// tp x cp and ep, in fp32 and bf16.
int64_t block_activation_bytes(const ch03::ModelConfig& config, int64_t layer, int64_t batch,
                               int64_t seq, ch14::Precision precision = ch14::Precision::Fp32,
                               ch14::Recompute mode = ch14::Recompute::None,
                               const ch14::TensorParallelShare& tp = {},
                               const ch14::ContextParallelShare& cp = {},
                               const ch14::ExpertParallelShare& ep = {});

/// The products of `linear` on oneDNN's sgemm (libdnnl, which Debian's LibTorch links as well)
/// instead of OpenBLAS's: on the machine this project is measured on, oneDNN's kernels run the
/// step's products about twice as fast (bench_gemm_backends). float32 operands whose strides are
/// rows or columns of one buffer go to dnnl_sgemm with the matching transpose flag; anything else
/// (another dtype, an empty dimension, a build without libdnnl-dev) goes to at::mm. Each call
/// records itself as "fivefold::mm" (or "fivefold::bmm") with its operands, so chapter 02's
/// FlopCounter counts it. Like at::mm inside a custom autograd function, it records no graph of
/// its own.
class OneDnnMatmulKernel : public ch03::MatmulKernel {
 public:
  /// Whether this build has oneDNN (found at configure time); without it, mm is at::mm.
  static bool available();
  /// a [m, k] · b [k, n] -> a new contiguous [m, n].
  torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const override;
  /// a [B, m, k] · b [B, k, n] -> a new contiguous [B, m, n]: one sgemm per matrix, the B of
  /// them shared out over the threads (attention's heads: many small products).
  torch::Tensor bmm(const torch::Tensor& a, const torch::Tensor& b) const override;
};

/// A FusedAdamW over `groups`: a ch03::TrainConfig::make_adamw.
std::unique_ptr<torch::optim::AdamW> fused_adamw(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const torch::optim::AdamWOptions& defaults);

/// The kernel install_fast_paths gives `linear`: OneDnnMatmulKernel, checked against at::mm on
/// each transpose `linear` passes (a disagreement throws fivefold::Error), or nullptr (at::mm)
/// in a build without oneDNN.
std::shared_ptr<const ch03::MatmulKernel> fast_matmul_kernel();

/// GFLOP/s of an n x n float product on the kernel `linear` multiplies with now
/// (ch03::matmul_kernel, or at::mm; fivefold::measure_matmul_gflops): the peak that MFU is
/// measured against, so that a faster library raises the peak with the step.
double matmul_peak_gflops(int n);

/// A tile's softmax statistics per query, [b, h, T, 1] in fp32 at least: the max of its scores
/// and the sum of e = exp(s − max).
struct TileExp {
  torch::Tensor max;  ///< the max of each query's visible scores
  torch::Tensor sum;  ///< undefined unless asked for
};

/// e = exp(s − max) in place of a causal tile of attention scores s [b, h, T, end] (the tile's
/// queries at the last T of `end` key positions: query i sees keys 0 .. end − T + i), 0 at each
/// query's later keys; `future` is a [≥T, ≥T] bool mask whose strict upper triangle marks them.
/// Given `shift` ([b, h, T, 1]), e = exp(s − shift) instead and no max is computed (`shift` is
/// returned as `max`): with the queries' log-sum-exp, which the tiled attention's backward has from
/// forward, e is the softmax's probabilities themselves. With the AVX-512 loops (`avx512_loops`)
/// and a contiguous fp32 or bf16 tile, one loop per row computes s − max and exp in fp32 and rounds
/// e once to the tile's type; elsewhere (or after set_avx512_loops(false)) ATen's mask, max,
/// subtract and exp, each in the tile's type (s − shift computed in fp32, then rounded). Σe (of e
/// as stored) when `with_sum`.
TileExp causal_tile_exp(torch::Tensor& scores, const torch::Tensor& future, bool with_sum,
                        const torch::Tensor& shift = {});

/// Softmax's backward over a tile, in place: `grad` holds ∂L/∂p [b, h, T, n] and becomes
/// ∂L/∂s = p∘(∂L/∂p − δ), with p the tile's probabilities (its shape and type) and δ [b, h, T, 1]
/// each query's Σ_j p_j·∂L/∂p_j (dO·O in attention). With the AVX-512 loops and contiguous fp32
/// or bf16 tiles of one type, one loop in fp32 registers (δ read in fp32), each result rounded
/// once; elsewhere ATen's subtraction and product, each rounded to the tile's type (δ too).
void softmax_tile_backward(torch::Tensor& grad, const torch::Tensor& p, const torch::Tensor& delta);

/// SwiGLU's product h = silu(gate)·up (gate, up [..., f], one shape), keeping gate and up for
/// backward, which recomputes silu(gate) and its slope σ(g)·(1 + g·(1 − σ(g))) from them (ATen's
/// SiLU and product keep silu(gate) too: f numbers more a token). With the AVX-512 loops
/// (`avx512_loops`) and contiguous fp32 or bf16 inputs of one type, one loop forward and one
/// backward, in fp32 registers, each result rounded once to the inputs' type; elsewhere (or after
/// set_avx512_loops(false)) ATen's operations, which compute the same in fp32 at least.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up);

/// Chapter 03's SwiGLU MLP, down(silu(gate(x))·up(x)), on swiglu: the same three Linear modules
/// (so the same parameters, under the same names), one kept number fewer a feature.
class FusedSwiGLUMlpImpl : public ch03::FeedForwardLayer {
 public:
  /// Takes over `lesson`'s gate_proj, up_proj and down_proj.
  explicit FusedSwiGLUMlpImpl(const ch03::MlpImpl& lesson);
  /// x [batch, seq, d_model] -> [batch, seq, d_model].
  torch::Tensor forward(const torch::Tensor& x) override;
  ch03::Linear gate_proj{nullptr};  ///< d_model -> d_ff, through SiLU
  ch03::Linear up_proj{nullptr};    ///< d_model -> d_ff
  ch03::Linear down_proj{nullptr};  ///< d_ff -> d_model
};

/// Chapter 04's rotation of half-split pairs (apply_rope, RopeLayout::HalfSplit) of x [b, h, s, d]
/// (any dense layout with unit stride along d, as the heads' view of a product's rows), by cos and
/// sin [s, d/2] (fp32), returned contiguous in `type`, each number rounded once. Backward turns
/// the gradient back by the negated angles, into x's own layout and type (the rows of the product
/// that made x, contiguous again). With the AVX-512 loops (`avx512_loops`), x and `type` fp32 or
/// bf16, one loop each way in fp32 registers; elsewhere ATen's operations in fp32 at least. Keeps
/// cos and sin only.
torch::Tensor rotate_half_split(const torch::Tensor& x, const torch::Tensor& cos,
                                const torch::Tensor& sin, at::ScalarType type);

/// Chapter 04's RoPE (half-split pairs) for an attention layer on the tiled kernel: q and k rotated
/// by rotate_half_split, contiguous and already in the form the products multiply them in (bf16
/// under chapter 14's kernel), which the tiled kernel takes as they come. The lesson's RoPE hands
/// on fp32 [b, h, s, d] that the kernel then lays out and rounds itself, and its backward is a
/// dozen operations and a copy back to the rows' layout.
class FusedRotaryEmbedding : public ch03::PositionEncoding {
 public:
  /// The same angles as `lesson` (which must rotate half-split pairs: refused otherwise).
  explicit FusedRotaryEmbedding(std::shared_ptr<const ch04::RotaryEmbedding> lesson);
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& positions) const override;

 private:
  std::shared_ptr<const ch04::RotaryEmbedding> lesson_;
};

/// Whether this CPU runs the AVX-512 loops (F, BW, VL and DQ), which the project, built for the
/// x86-64 baseline, compiles beside ATen's.
bool avx512_available();

/// Whether causal_tile_exp, swiglu and FusedRMSNormKernel run their AVX-512 loops (true by
/// default: where the CPU has them); false puts ATen's operations (the norm's plain loops) in
/// their place, process-wide (bench_train_throughput --loops times the step both ways).
void set_avx512_loops(bool on);
/// Whether the loops run: set_avx512_loops's choice, on a CPU that has them.
bool avx512_loops();

/// What install_fast_paths replaced.
struct FastPaths {
  int64_t attention_kernels = 0;  ///< CausalAttentionKernel -> TiledCausalAttentionKernel
  int64_t norms = 0;              ///< RMSNorm modules given FusedRMSNormKernel
  int64_t mlps = 0;               ///< blocks' MlpImpl -> FusedSwiGLUMlpImpl
  int64_t rotary = 0;             ///< attention layers' RotaryEmbedding -> FusedRotaryEmbedding
  bool matmul = false;            ///< OneDnnMatmulKernel made `linear`'s (process-wide)
};

/// Installs the fast paths in every module of `model` that still runs the lesson's version: the
/// attention layers whose kernel is chapter 03's CausalAttentionKernel (a ring or all-gather
/// kernel of chapter 12 is left alone), every block whose MLP is chapter 03's MlpImpl (its
/// modules taken over by FusedSwiGLUMlpImpl; chapter 10's split MLP and chapter 07's experts are
/// left alone), every RMSNorm, and chapter 04's RoPE (half-split pairs) in the Llama attention
/// layers that get the tiled kernel (chapter 03's and chapter 10's; FusedRotaryEmbedding, one
/// per RotaryEmbedding; MLA's and YaRN's left alone); and, where oneDNN is available and no
/// MatmulKernel is set yet, OneDnnMatmulKernel for `linear` (process-wide: every model of the
/// process then multiplies with it). Before the first attention kernel and the matmul kernel,
/// it checks each against the lesson's version (causal_attention, the chapter's exercise; at::mm)
/// on a small input, so a kernel that disagrees stops the run here with fivefold::Error rather
/// than training on either.
FastPaths install_fast_paths(ch03::Transformer& model);

}  // namespace fivefold::runtime
