#pragma once
/// @file seams.h
/// @brief Chapter 03's seams for what comes later: read them when the chapter that uses each gets
/// there, not before. Chapter 11's zero-bubble schedule puts the weight gradients of `linear` off
/// (WeightGradientStore, DeferWeightGradients) and runs a model in parts (ModelPart); chapter 10's
/// layers hold slices of the whole model's tensors (TensorShard, ShardedModule); the training
/// run's fast paths (runtime/fast.h) multiply `linear`'s matrices and compute RMSNorm another way
/// (MatmulKernel, NormKernel). Each is the smallest hook the model needs for it; model.h uses
/// them.

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fivefold::ch03 {

/// The weight gradients that backward put off: for each linear map y = x·Wᵀ it went through, W,
/// x and ∂L/∂y, so that ∂L/∂W = (∂L/∂y)ᵀ·x can be computed later (chapter 11's zero-bubble
/// schedule computes the input's gradient first, for the stage before, and the weights' later).
class WeightGradientStore {
 public:
  /// Adds every kept weight gradient to its weight's .grad (created if undefined), and empties.
  void flush();
  /// The linear maps whose weight gradient is pending.
  size_t size() const { return pending_.size(); }
  /// Keeps one (used by `linear`'s backward).
  void keep(torch::Tensor weight, torch::Tensor x, torch::Tensor grad_y);

 private:
  struct Pending {
    torch::Tensor weight, x, grad_y;
  };
  std::vector<Pending> pending_;
};

/// An input that `linear` does not keep for backward, because it can be made again when the
/// weight's gradient needs it (the input's gradient does not). Chapter 10's sequence parallelism
/// gathers each norm's output over the sequence before the split products: they keep this rank's
/// part instead, and gather it again in backward (Korthikanti et al. 2022).
class RemadeInput : public torch::CustomClassHolder {
 public:
  /// The input whole again, as forward read it. May communicate: every rank's backward asks in
  /// the same order.
  virtual torch::Tensor remake() = 0;
};

/// While alive, backward through `linear` on this thread computes the input's gradient only and
/// keeps what the weight's gradient needs in `store` (its weight gets no gradient until
/// store.flush()). Scopes do not nest.
class DeferWeightGradients {
 public:
  /// Puts off the weight gradients into `store` until this guard goes away.
  explicit DeferWeightGradients(WeightGradientStore& store);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;
};

/// The library that multiplies the matrices of `linear`: its three products (x·Wᵀ forward, ∂L/∂y·W
/// and (∂L/∂y)ᵀ·x backward) are each one call of mm. Unlike the other slots this one is
/// process-wide, as the choice of BLAS is: every linear map of every chapter (LinearImpl,
/// chapter 10's split linears, the experts) goes through `linear`, so one setting reaches them
/// all; the tiled attention of runtime/fast.h multiplies its heads with bmm. Unset, the products
/// are at::mm's (OpenBLAS on Debian); the training run's fast paths fill it (runtime/fast.h).
class MatmulKernel {
 public:
  virtual ~MatmulKernel() = default;
  /// a [m, k] · b [k, n] -> [m, n], as at::mm (either operand may be a transposed view).
  virtual torch::Tensor mm(const torch::Tensor& a, const torch::Tensor& b) const = 0;
  /// a [B, m, k] · b [B, k, n] -> [B, m, n], as at::bmm (each matrix may be a transposed view).
  virtual torch::Tensor bmm(const torch::Tensor& a, const torch::Tensor& b) const {
    return at::bmm(a, b);
  }
  /// The form mm reads an activation in: `linear` converts its input x (and backward ∂L/∂y) to it
  /// once, and keeps x so for backward (chapter 14's bf16 kernel rounds to bf16, halving what
  /// linear keeps). The identity here.
  virtual torch::Tensor operand(const torch::Tensor& t) const { return t; }
  /// The type `linear` hands its result y on in, for an input x of type `input` (x's own here;
  /// chapter 14's bf16 kernel: bf16, as autocast does). ∂L/∂x goes back in x's own type.
  virtual at::ScalarType result_type(at::ScalarType input) const { return input; }
};

/// Makes `kernel` the one `linear` multiplies with (nullptr: at::mm), for every thread; returns the
/// previous one. Set it before training, not while a step runs.
std::shared_ptr<const MatmulKernel> set_matmul_kernel(std::shared_ptr<const MatmulKernel> kernel);

/// The kernel `linear` multiplies with now (nullptr: at::mm).
const MatmulKernel* matmul_kernel();

/// `t` in the form the kernel set now multiplies it in (MatmulKernel::operand; t itself for
/// at::mm): what `linear` keeps of its input, and what the tiled attention converts its heads to
/// once.
torch::Tensor matmul_operand(const torch::Tensor& t);

/// `t` in fp32, or in its own type when that is wider: what a product's result (bf16 under
/// chapter 14's kernel) is widened to where fp32 is kept, such as the collectives that sum or
/// carry it (chapter 10's g, chapter 13's combine).
torch::Tensor at_least_fp32(const torch::Tensor& t);

/// The computation of an RMSNorm, x and weight -> the normalised x: the slot a faster
/// implementation of the same formula fills (the training run's fast paths, runtime/fast.h).
class NormKernel {
 public:
  virtual ~NormKernel() = default;
  /// x [..., dim], weight [dim] -> x / sqrt(mean(x²) + eps) · weight over the last dimension.
  virtual torch::Tensor normalize(const torch::Tensor& x, const torch::Tensor& weight,
                                  double eps) const = 0;
};

/// How a parameter a process holds is a slice of the single-device model's tensor of the same
/// name: part `index` of `count` along `dim` (parts sized by fivefold::split_sizes) of a tensor
/// whose size along `dim` is `full_size`. Chapter 10's layers hold their weights this way.
struct TensorShard {
  int64_t dim = 0;        ///< the dimension split (0: rows, 1: columns)
  int64_t index = 0;      ///< which part this process holds
  int64_t count = 1;      ///< into how many parts the tensor is split
  int64_t full_size = 0;  ///< the whole tensor's size along `dim`
};

/// A module whose parameters are slices of the whole model's (chapter 10's tensor-parallel layers).
/// The model initialises each such parameter as its slice of the full tensor (chapter 01), so any
/// layout starts from the single-device weights, and a parallel step gathers the slices back into
/// whole tensors for checkpoints.
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  /// The sliced parameters, by their name within the module ("weight").
  virtual std::map<std::string, TensorShard> shards() const = 0;
};

/// Which parts of the model this process holds: a range of layers, and the two ends. A pipeline
/// stage (chapter 11) holds some layers; the first the embedding, the last the final norm and the
/// output layer. Parameters keep their global names (model.layers.{i} with the global i), so
/// initialisation and checkpoints do not depend on the split.
struct ModelPart {
  int64_t first_layer = 0;  ///< first layer held
  int64_t last_layer = -1;  ///< one past the last layer held; -1: all the way to n_layers
  bool embedding = true;    ///< holds the token embedding
  /// Holds the final norm and the output layer. With tied embeddings the output layer reads the
  /// embedding table, so a part with the head holds model.embed_tokens too.
  bool head = true;
  /// Further ranges [first, last) held after [first_layer, last_layer), in increasing order: an
  /// interleaved pipeline stage (chapter 11) holds one range per virtual stage.
  std::vector<std::pair<int64_t, int64_t>> more_layers;
  /// last_layer resolved against `n_layers`; throws fivefold::Error for a range outside it.
  int64_t end(int64_t n_layers) const;
  /// Whether this is the whole model.
  bool whole(int64_t n_layers) const;
  /// The global indices of every layer held, in increasing order; throws fivefold::Error for
  /// ranges that overlap, run backwards or leave the model.
  std::vector<int64_t> layers(int64_t n_layers) const;
};

}  // namespace fivefold::ch03
