#pragma once
// Chapter 14's tests: the process-wide matmul kernel put back after a test that changes it.

#include "14_memory/precision.h"

namespace fivefold::ch14::testing {

/// Puts the process-wide matmul kernel back to at::mm (fp32) when it goes out of scope, so that a
/// test that multiplies in bf16 leaves the next one in fp32.
struct Fp32Afterwards {
  ~Fp32Afterwards() { use_precision(Precision::Fp32, nullptr); }
};

}  // namespace fivefold::ch14::testing
