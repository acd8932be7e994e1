#pragma once
/// @file compare.h
/// @brief Tensor comparison with a readable report: largest absolute and relative error and where.

#include <torch/torch.h>

#include <string>

namespace fivefold {

/// Outcome of comparing `actual` with `expected` under |a - e| <= atol + rtol * |e|.
struct TensorDiff {
  bool close = false;           ///< every element within tolerance (and shapes equal)
  bool shape_mismatch = false;  ///< shapes differ; nothing else is meaningful
  double max_abs_error = 0;     ///< max |a - e|
  double max_rel_error = 0;     ///< max |a - e| / |e| over elements with e != 0
  std::string where;            ///< index of the worst element, e.g. "[3, 17]"
  double actual_value = 0;      ///< a at that index
  double expected_value = 0;    ///< e at that index
  int64_t bad_count = 0;        ///< elements outside tolerance
  /// One-paragraph description for test failures.
  std::string report() const;
};

/// Compares two tensors (any dtype; computed in float64). A NaN is never close to anything, another
/// NaN included, unless `nan_equal` (then NaN in the same place counts as equal).
TensorDiff compare_tensors(const torch::Tensor& actual, const torch::Tensor& expected, double atol,
                           double rtol, bool nan_equal = false);

}  // namespace fivefold
