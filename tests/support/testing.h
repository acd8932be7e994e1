#pragma once
/// @file testing.h
/// @brief What fivefold's GoogleTest suites share: the world communicator of the running job and
/// a tensor-closeness assertion with a readable report.
///
/// Distributed suites run as real processes (CTest starts them under `mpirun -np N`); every rank
/// runs every test in the same order. A failed assertion on any rank aborts the whole job at once,
/// so no rank is left waiting in a collective.

#include <gtest/gtest.h>

#include "fivefold/compare.h"
#include "fivefold/dist.h"

namespace fivefold::testing {

/// The world communicator of this test job.
dist::CommunicatorPtr world();

}  // namespace fivefold::testing

/// Expects |actual - expected| <= atol + rtol * |expected| everywhere; reports the worst element.
#define EXPECT_TENSOR_CLOSE(actual, expected, atol, rtol)                                          \
  do {                                                                                             \
    const auto fivefold_diff_ = ::fivefold::compare_tensors((actual), (expected), (atol), (rtol)); \
    EXPECT_TRUE(fivefold_diff_.close) << #actual " vs " #expected ": " << fivefold_diff_.report(); \
  } while (0)

/// Expects bit-identical tensors (same shape, dtype and values).
#define EXPECT_TENSOR_EQ(actual, expected)                                                         \
  do {                                                                                             \
    EXPECT_EQ((actual).scalar_type(), (expected).scalar_type());                                   \
    const auto fivefold_diff_ = ::fivefold::compare_tensors((actual), (expected), 0.0, 0.0);       \
    EXPECT_TRUE(fivefold_diff_.close) << #actual " vs " #expected ": " << fivefold_diff_.report(); \
  } while (0)
