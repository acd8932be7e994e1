#pragma once
// What chapter 15's tests share.

#include "15_trainer_5d/trainer_5d.h"

namespace fivefold::ch15::testing {

/// A layout of the given sizes (dp 0: from the world size), the other settings their defaults.
inline Layout sizes(int64_t dp, int64_t tp, int64_t pp, int64_t cp, int64_t ep = 1,
                    int zero = 0) {
  Layout l;
  l.dp = dp;
  l.tp = tp;
  l.pp = pp;
  l.cp = cp;
  l.ep = ep;
  l.zero = zero;
  return l;
}

}  // namespace fivefold::ch15::testing
