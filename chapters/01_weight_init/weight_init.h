#pragma once
/// @file weight_init.h
/// @brief Chapter 01: how to draw initial weights so that signals neither vanish nor explode with
/// depth, and how to draw them identically whatever the parallel layout.
///
/// For y = W x with W [out, in] drawn with zero mean and variance Var[w], independent of x:
///   Var[y] = fan_in · Var[w] · E[x²]                                      (He et al. 2015, eq. 7)
/// With x = f(y_prev) and y_prev ~ N(0, 1), keeping Var[y] = 1 needs
///   Var[w] = 1 / (fan_in · E[f(y)²]),  y ~ N(0, 1),
/// i.e. std = gain / sqrt(fan_in) with gain = 1 / sqrt(E[f(y)²]). See notes/01_weight_init.md.

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fivefold::ch01 {

/// The nonlinearity that follows a layer.
enum class Activation { Linear, ReLU, Tanh, SiLU };

/// E[f(y)²] for y ~ N(0, 1): the factor by which f scales the second moment of a unit-variance
/// input. Exact where a closed form exists, else within 1e-6 absolute (the test compares with an
/// independent integral and a 4-million-sample Monte Carlo estimate).
/// **Exercise** (chapters/01_weight_init/README.md, "The exercise").
double activation_second_moment(Activation activation);

/// The variance-preserving (He/Kaiming) standard deviation: weights drawn N(0, std²) for a layer
/// with `fan_in` inputs, each input f(y) of a unit-variance y, give outputs of unit variance
/// again (checked on one layer's measured variance and on the growth over 48 layers).
/// **Exercise**, together with activation_second_moment.
double variance_preserving_std(int64_t fan_in, Activation activation);

/// The gain that LibTorch's torch::nn::init uses for `activation` (linear 1, ReLU √2, tanh 5/3;
/// SiLU has none there: 1). Differs from 1/sqrt(E[f(y)²]) for tanh: 5/3 is a heuristic.
double libtorch_gain(Activation activation);

/// The initialisation schemes compared in this chapter.
enum class Scheme {
  LibTorchDefault,  ///< nn::Linear's default: U(±1/sqrt(fan_in)), std 1/sqrt(3·fan_in)
  Xavier,           ///< Glorot normal: std sqrt(2 / (fan_in + fan_out))
  Kaiming,          ///< variance-preserving normal: variance_preserving_std(fan_in, activation)
  Gpt2,             ///< N(0, 0.02²); residual output projections 0.02 / sqrt(2·n_layer)
  FixedStd,         ///< N(0, std²) for a given std (shows what a wrong fixed std does)
};

/// How to initialise one weight.
struct InitSpec {
  Scheme scheme = Scheme::Kaiming;             ///< which scheme
  Activation activation = Activation::Linear;  ///< the nonlinearity after the layer (Kaiming)
  double std = 0.02;                           ///< for Gpt2 (base std) and FixedStd
  int64_t n_layer = 1;                         ///< transformer blocks, for Gpt2's residual scaling
  bool residual_projection = false;            ///< a layer that writes into the residual stream
};

/// The standard deviation `spec` gives a weight [fan_out, fan_in].
double init_std(const InitSpec& spec, int64_t fan_in, int64_t fan_out);

/// The full weight [out_features, in_features] named `name`, drawn from the generator seeded by
/// (seed, name) (fivefold::generator_for). Normal for every scheme but LibTorchDefault (uniform).
torch::Tensor init_weight(const std::string& name, int64_t out_features, int64_t in_features,
                          const InitSpec& spec, uint64_t seed);

/// Part `index` of `count` of that weight along `dim` (0: output rows, as a column-parallel layer
/// holds; 1: input columns, as a row-parallel layer holds), parts sized by fivefold::split_sizes
/// (uneven when `count` does not divide): bit-identical to the same slice of init_weight, whatever
/// the layout.
torch::Tensor init_weight_shard(const std::string& name, int64_t out_features, int64_t in_features,
                                const InitSpec& spec, uint64_t seed, int64_t dim, int64_t index,
                                int64_t count);

/// Standard deviations measured layer by layer (index 0 = first layer).
struct DepthProfile {
  std::vector<double> activation_std;  ///< std of each layer's output
  std::vector<double> gradient_std;    ///< std of d(loss)/d(weight) of each layer
};

/// A plain deep network: y_1 = W_1 x, y_l = W_l f(y_{l-1}), x ~ N(0, 1) [batch, width], every
/// W_l [width, width] initialised by `spec` (named "mlp.{l}.weight"). The loss is sum(y_L · g) for
/// a fixed Gaussian g, so the gradients have a known scale at the top.
DepthProfile mlp_profile(int64_t depth, int64_t width, int64_t batch, const InitSpec& spec,
                         uint64_t seed);

/// A pre-norm residual stack: h_l = h_{l-1} + W_out relu(W_in rmsnorm(h_{l-1})), W_in [4w, w] by
/// `in_spec`, W_out [w, 4w] by `out_spec`; activation_std is the residual stream's std after each
/// block, gradient_std that of each block's W_in gradient (loss sum(h_L · g), g Gaussian).
/// Without scaling the stream's variance grows by a constant every block.
DepthProfile residual_profile(int64_t depth, int64_t width, int64_t batch, const InitSpec& in_spec,
                              const InitSpec& out_spec, uint64_t seed);

/// Applies `activation` (used by the demo and the tests).
torch::Tensor activate(const torch::Tensor& x, Activation activation);

/// A printable name: "linear", "relu", "tanh", "silu".
std::string activation_name(Activation activation);

}  // namespace fivefold::ch01
