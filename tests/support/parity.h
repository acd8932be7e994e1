#pragma once
/// @file parity.h
/// @brief What the parity tests of the parallel chapters (11 onwards) share: the two optimizer
/// settings every layout is compared under, the cut of a batch into micro-batches, the
/// comparison of AdamW's state with one process's, and the copy of a model a resume starts from.

#include <cstdint>
#include <string>
#include <vector>

#include "03_transformer/data.h"
#include "03_transformer/train.h"
#include "fivefold/io.h"
#include "testing.h"

namespace fivefold::testing {

/// AdamW without clipping, one warm-up step of 10: a missing constant factor in the gradients
/// changes the curve (clipping that acts every step would remove it), and gradients() returns
/// them as backward left them.
inline ch03::TrainConfig no_clipping() {
  ch03::TrainConfig t;
  t.warmup_steps = 1;
  t.total_steps = 10;
  t.grad_clip = 0;
  return t;
}

/// The same with clipping at 0.5, which acts on every step: the global norm must be right.
inline ch03::TrainConfig clipping() {
  auto t = no_clipping();
  t.grad_clip = 0.5;
  return t;
}

/// The absolute tolerance for parameters after a few AdamW steps in two layouts. AdamW divides
/// each moment by the root of the second: for an element whose gradient is near zero, the fp32
/// rounding of a different summation order becomes a visible part of its update (up to a
/// fraction of lr per step). Measured: 1.3e-5 on one element of 1,344 after 3 steps (chapter 10's
/// gate_proj, with AMD EPYC's OpenBLAS kernels; 1e-5 had passed on other machines). An update
/// that is skipped, doubled or applied to the wrong slice misses by the order of lr (3e-3).
constexpr double kParameterAtol = 5e-5;

/// `b` cut into `m` micro-batches of rows (torch::tensor_split: the first ones one row longer
/// when m does not divide the rows).
inline std::vector<ch03::Batch> split(const ch03::Batch& b, int64_t m) {
  std::vector<ch03::Batch> out;
  const auto inputs = b.inputs.tensor_split(m), targets = b.targets.tensor_split(m);
  for (int64_t i = 0; i < m; ++i)
    out.push_back({inputs[static_cast<size_t>(i)], targets[static_cast<size_t>(i)]});
  return out;
}

/// A step's AdamW state (`got`, by parameter name) against one process's (`want`): the same
/// tensors, each within 1e-6 absolute and 1e-3 relative (fp32 sums in other orders, magnified by
/// the second moment's square root near zero). `label` says which comparison it is.
inline void expect_same_optimizer_state(const io::TensorMap& got, const io::TensorMap& want,
                                        const std::string& label = "") {
  ASSERT_EQ(got.size(), want.size()) << label;
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(label + name);
    ASSERT_TRUE(got.count(name) > 0);
    EXPECT_TENSOR_CLOSE(got.at(name), t, 1e-6, 1e-3);
  }
}

/// `to` given `from`'s parameters and buffers, by name (the same architecture): a resume test
/// hands a layout a copy of the single process's model, which goes on training its own.
inline void copy_weights(torch::nn::Module& to, const torch::nn::Module& from) {
  torch::NoGradGuard no_grad;
  const auto weights = from.named_parameters(), buffers = from.named_buffers();
  for (auto& item : to.named_parameters()) item.value().copy_(weights[item.key()]);
  for (auto& item : to.named_buffers()) item.value().copy_(buffers[item.key()]);
}

}  // namespace fivefold::testing
