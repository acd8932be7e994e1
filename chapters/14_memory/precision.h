#pragma once
/// @file precision.h
/// @brief Chapter 14: mixed precision. The matrix products, which are almost all of a step's
/// FLOPs, run in bf16: each operand rounded to bf16 (8 bits of mantissa, fp32's range), multiplied
/// by oneDNN's bf16 GEMM with fp32 accumulation, the product handed on in bf16 (as PyTorch's
/// autocast does: SwiGLU then runs over bf16). RMSNorm, the attention kernels and the collectives
/// that sum or carry a product's result widen it to fp32 first; the weights themselves (the
/// master copy AdamW updates), the residual stream, softmax and the loss, the gradients and their
/// reduction across ranks, AdamW's moments and the checkpoints stay fp32. bf16 has fp32's exponent,
/// so no gradient underflows and no loss scaling is needed (fp16, with 5 exponent bits, needs it).

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "03_transformer/model.h"

namespace fivefold::ch14 {

/// What the matrix products compute in.
enum class Precision {
  Fp32,  ///< every product in fp32 (chapter 03's training)
  Bf16,  ///< the products in bf16 (operands and results), fp32 where the header says
};

/// "fp32" or "bf16"; throws fivefold::Error for anything else, naming the choices.
Precision parse_precision(const std::string& name);
/// The name parse_precision reads.
std::string to_string(Precision precision);
/// Bytes a number takes in `precision`: 2 in bf16, 4 in fp32 (a parameter kept in it, a rounded
/// operand, an element on the wire).
inline int64_t bytes_per_number(Precision precision) {
  return precision == Precision::Bf16 ? 2 : 4;
}

/// `linear`'s products (x·Wᵀ forward; ∂L/∂y·W and (∂L/∂y)ᵀ·x backward) and the tiled attention's
/// batched ones in bf16: a and b rounded to bf16, multiplied (oneDNN, fp32 accumulation), the
/// result returned in bf16. The weights' gradients are such products too: `linear` widens them
/// into .grad in fp32, where the optimizer and the reductions read them.
class Bf16MatmulKernel : public ch03::MatmulKernel {
 public:
  torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const override;
  torch::Tensor bmm(const torch::Tensor& a, const torch::Tensor& b) const override;
  /// t rounded to bf16: what `linear` keeps of its input for backward (half the bytes of fp32),
  /// rounded once instead of at each product that reads it. The maps that read one input (q, k
  /// and v; gate and up; MLA's q_a_proj and kv_a_proj, with the query latent rounded between
  /// them) share its rounding: the last two on this thread are reused while they are alive and
  /// their inputs unchanged.
  torch::Tensor operand(const torch::Tensor& t) const override;
  at::ScalarType result_type(at::ScalarType input) const override { return torch::kBFloat16; }
};

/// Makes `linear` multiply in `precision`, for the whole process (ch03::set_matmul_kernel): Bf16
/// installs Bf16MatmulKernel; Fp32 installs `fp32` (the fast paths' kernel, or null for at::mm).
void use_precision(Precision precision, std::shared_ptr<const ch03::MatmulKernel> fp32);

/// GFLOP/s of an n x n product, measured now: fp32 on the kernel `linear` uses now, and bf16.
struct ProductSpeed {
  double fp32 = 0;  ///< GFLOP/s in fp32
  double bf16 = 0;  ///< GFLOP/s in bf16 (Bf16MatmulKernel, the roundings included)
};

/// Times both on a [rows, inner] x [inner, cols] product (best of 10 after 2 warm-up products):
/// the trainer measures its model's own MLP product before it trains in bf16, and warns when
/// bf16 is the slower. Small products are: the roundings are passes over memory that a product
/// of few FLOPs does not pay back; and on a CPU without a fast bf16 path (AVX-512 BF16 or AMX)
/// every product is.
ProductSpeed measure_product_speed(int64_t rows, int64_t inner, int64_t cols);

}  // namespace fivefold::ch14
