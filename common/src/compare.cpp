#include "fivefold/compare.h"

#include <sstream>

namespace fivefold {

TensorDiff compare_tensors(const torch::Tensor& actual, const torch::Tensor& expected, double atol,
                           double rtol, bool nan_equal) {
  TensorDiff diff;
  if (actual.sizes() != expected.sizes()) {
    diff.shape_mismatch = true;
    std::ostringstream where;
    where << "shape " << actual.sizes() << " vs expected " << expected.sizes();
    diff.where = where.str();
    return diff;
  }
  if (actual.numel() == 0) {
    diff.close = true;
    return diff;
  }
  auto a = actual.detach().to(torch::kCPU, torch::kDouble).contiguous().view(-1);
  auto e = expected.detach().to(torch::kCPU, torch::kDouble).contiguous().view(-1);
  auto both_nan = a.isnan() & e.isnan();
  auto abs_err = (a - e).abs().masked_fill(both_nan, 0.0);
  // A comparison with NaN is false, so NaN would pass `abs_err > tolerance`: count it explicitly.
  auto nan_bad = nan_equal ? (a.isnan() != e.isnan()) : (a.isnan() | e.isnan());
  auto bad = (abs_err > (atol + rtol * e.abs())) | nan_bad;
  auto rel_err = (abs_err / e.abs()).masked_fill(e == 0, 0.0).masked_fill(both_nan, 0.0);
  diff.bad_count = bad.sum().item<int64_t>();
  diff.close = diff.bad_count == 0;
  diff.max_abs_error = abs_err.max().item<double>();
  diff.max_rel_error = rel_err.max().item<double>();
  // Report the worst offender: the first bad element if any, else the largest absolute error.
  const int64_t flat = diff.bad_count > 0 ? bad.to(torch::kInt).argmax().item<int64_t>()
                                          : abs_err.argmax().item<int64_t>();
  diff.actual_value = a[flat].item<double>();
  diff.expected_value = e[flat].item<double>();
  std::ostringstream where;
  where << "[";
  int64_t rest = flat;
  std::vector<int64_t> index(actual.dim());
  for (int64_t d = actual.dim() - 1; d >= 0; --d) {
    index[d] = rest % actual.size(d);
    rest /= actual.size(d);
  }
  for (size_t d = 0; d < index.size(); ++d) where << (d ? ", " : "") << index[d];
  where << "]";
  diff.where = where.str();
  return diff;
}

std::string TensorDiff::report() const {
  std::ostringstream out;
  if (shape_mismatch) {
    out << "shapes differ: " << where;
    return out.str();
  }
  out << bad_count << " element(s) outside tolerance; max abs error " << max_abs_error
      << ", max rel error " << max_rel_error << "; at " << where << ": actual " << actual_value
      << ", expected " << expected_value;
  return out.str();
}

}  // namespace fivefold
