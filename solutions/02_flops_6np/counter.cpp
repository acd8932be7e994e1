// Measuring the FLOPs LibTorch really executes: a RecordFunction callback sees every dispatched
// aten operator with its inputs, on every thread (autograd's backward included). Only the leaf
// products are counted (mm, addmm, bmm, ...): composite operators such as matmul and linear
// dispatch to them, so counting those too would count twice.
//
// This file is always compiled with NDEBUG (CMakeLists.txt): LibTorch 1.13's RecordFunction has
// a debug-only member that the library (built with NDEBUG) never sets, so a debug build of this
// file would see every input list as invalid.

#include <ATen/record_function.h>

#include <atomic>
#include <cstring>

#include "02_flops_6np/flops.h"
#include "fivefold/error.h"

namespace fivefold::ch02 {
namespace {

std::atomic<double> g_flops{0.0};
std::atomic<bool> g_active{false};

void add(double flops) {
  double current = g_flops.load();
  while (!g_flops.compare_exchange_weak(current, current + flops)) {
  }
}

double dim(const c10::IValue& value, int64_t d) {
  return static_cast<double>(value.toTensor().size(d));
}

std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& fn) {
  const char* name = fn.name();
  // A product computed outside ATen records itself as "fivefold::mm" or "fivefold::bmm" with its
  // two operands (chapter 03's oneDNN kernel): counted as mm or bmm.
  const bool ours = std::strncmp(name, "fivefold::", 10) == 0;
  if (!ours && std::strncmp(name, "aten::", 6) != 0) return nullptr;
  const char* op = name + (ours ? 10 : 6);
  const auto inputs = fn.inputs();
  // [m, k] x [k, n]: 2·m·k·n. addmm/baddbmm/addmv carry the added tensor first.
  if (std::strcmp(op, "mm") == 0) {
    add(2 * dim(inputs[0], 0) * dim(inputs[0], 1) * dim(inputs[1], 1));
  } else if (std::strcmp(op, "addmm") == 0) {
    add(2 * dim(inputs[1], 0) * dim(inputs[1], 1) * dim(inputs[2], 1));
  } else if (std::strcmp(op, "bmm") == 0) {
    add(2 * dim(inputs[0], 0) * dim(inputs[0], 1) * dim(inputs[0], 2) * dim(inputs[1], 2));
  } else if (std::strcmp(op, "baddbmm") == 0) {
    add(2 * dim(inputs[1], 0) * dim(inputs[1], 1) * dim(inputs[1], 2) * dim(inputs[2], 2));
  } else if (std::strcmp(op, "mv") == 0) {
    add(2 * dim(inputs[0], 0) * dim(inputs[0], 1));
  } else if (std::strcmp(op, "addmv") == 0) {
    add(2 * dim(inputs[1], 0) * dim(inputs[1], 1));
  } else if (std::strcmp(op, "dot") == 0) {
    add(2 * dim(inputs[0], 0));
  }
  return nullptr;
}

}  // namespace

FlopCounter::FlopCounter() {
  FIVEFOLD_CHECK(!g_active.exchange(true), "FlopCounter: only one counter may be alive at a time");
  g_flops = 0.0;
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(on_operator)
                                      .needsInputs(true)
                                      .scopes({at::RecordScope::FUNCTION}));
}

FlopCounter::~FlopCounter() {
  at::removeCallback(handle_);
  g_active = false;
}

double FlopCounter::flops() const { return g_flops.load(); }

void FlopCounter::reset() { g_flops = 0.0; }

}  // namespace fivefold::ch02
