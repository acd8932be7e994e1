#pragma once
/// @file testing.h
/// @brief What fivefold's GoogleTest suites share: the world communicator of the running job and
/// a tensor-closeness assertion with a readable report.
///
/// Distributed suites run as real processes (CTest starts them under `mpirun -np N`); every rank
/// runs every test in the same order. A failed assertion on any rank aborts the whole job at once,
/// so no rank is left waiting in a collective.

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fivefold/compare.h"
#include "fivefold/dist.h"

namespace fivefold::testing {

/// The world communicator of this test job.
dist::CommunicatorPtr world();

/// Success when `action` throws fivefold::Error with `fragment` in its message; the failure says
/// what happened instead. Use as EXPECT_TRUE(throws_error_containing([&] { ... }, "fragment")).
::testing::AssertionResult throws_error_containing(const std::function<void()>& action,
                                                   const std::string& fragment);

/// A fresh directory under the system's temporary directory, unique to this process and test,
/// removed with everything in it when the object goes away.
class ScratchDir {
 public:
  /// @param tag a word for the directory name, e.g. "io".
  explicit ScratchDir(const std::string& tag);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  /// The path of `name` inside the directory (not created).
  std::string path(const std::string& name) const;
  /// The directory itself.
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

}  // namespace fivefold::testing

/// Expects |actual - expected| <= atol + rtol * |expected| everywhere; reports the worst element.
/// Each argument is evaluated once; a NaN anywhere fails.
#define EXPECT_TENSOR_CLOSE(actual, expected, atol, rtol)                                          \
  do {                                                                                             \
    const auto fivefold_diff_ = ::fivefold::compare_tensors((actual), (expected), (atol), (rtol)); \
    EXPECT_TRUE(fivefold_diff_.close) << #actual " vs " #expected ": " << fivefold_diff_.report(); \
  } while (0)

/// Expects bit-identical tensors (same shape, dtype and values). Each argument is evaluated once;
/// a NaN anywhere fails (call compare_tensors with nan_equal to accept NaN in the same place).
/// The arguments are held by value (a reference count), so a tensor borrowed from a temporary
/// stays alive.
#define EXPECT_TENSOR_EQ(actual, expected)                                                         \
  do {                                                                                             \
    const torch::Tensor fivefold_actual_ = (actual);                                               \
    const torch::Tensor fivefold_expected_ = (expected);                                           \
    EXPECT_EQ(fivefold_actual_.scalar_type(), fivefold_expected_.scalar_type());                   \
    const auto fivefold_diff_ =                                                                    \
        ::fivefold::compare_tensors(fivefold_actual_, fivefold_expected_, 0.0, 0.0);               \
    EXPECT_TRUE(fivefold_diff_.close) << #actual " vs " #expected ": " << fivefold_diff_.report(); \
  } while (0)
