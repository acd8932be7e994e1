#pragma once
/// @file fivefold.h
/// @brief Everything in fivefold_common, for programs that want one include.

#include "fivefold/blas.h"
#include "fivefold/cli.h"
#include "fivefold/comm_stats.h"
#include "fivefold/compare.h"
#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/memory.h"
#include "fivefold/mesh.h"
#include "fivefold/progress.h"
#include "fivefold/runtime.h"
#include "fivefold/seed.h"
#include "fivefold/timer.h"
