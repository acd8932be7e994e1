#pragma once
/// @file cluster.h
/// @brief A cluster description (chapter 15's planner) read from a TOML file: one top-level
/// `key = value` per line, strictly (an unknown key, a table or a value of the wrong kind is
/// refused with the file and line, as `--config` refuses them). Presets in
/// chapters/15_trainer_5d/presets/clusters/.
///
///     name = "H100 SXM, NVLink 4, 400 Gb/s InfiniBand"
///     devices = 16384                 # in all (fivefold plan --devices overrides it)
///     devices-per-node = 8
///     memory-gb = 80                  # per device, 1e9 bytes
///     peak-tflops-bf16 = 989          # dense, the datasheet's: for MFU
///     peak-tflops-fp32 = 67
///     matmul-tflops-bf16 = 750        # what the step's products sustain: for time
///     matmul-tflops-fp32 = 50
///     adamw-ns-per-parameter = 0.0084 # the update streams 28 bytes a parameter at 3.35 TB/s
///     attention-tflops-bf16 = 500     # optional: the causal attention kernel's own rate
///     attention-tflops-fp32 = 40      # (absent: the products')
///     memory-gbps = 3350              # optional: what a product streams its operands at
///     product-latency-us-bf16 = 5     # optional: what each product costs besides its FLOPs
///     product-latency-us-fp32 = 5
///     intra-node-gbps = 450           # GB/s one device sends inside its node
///     intra-node-latency-us = 3
///     inter-node-gbps = 50            # GB/s one device sends to other nodes
///     inter-node-latency-us = 5
///     # optional: a collective's own line (all-reduce, all-gather, reduce-scatter, all-to-all,
///     # send-recv), both figures together; `fivefold calibrate` writes one for each it times
///     intra-node-all-reduce-gbps = 300
///     intra-node-all-reduce-latency-us = 8

#include <string>

#include "15_trainer_5d/planner.h"

namespace fivefold::runtime {

/// The cluster `path` describes. Throws fivefold::Error naming the file (and line) for an
/// unreadable file, malformed TOML, an unknown key, a missing key or an impossible value.
ch15::Cluster read_cluster(const std::string& path);

/// The TOML text read_cluster reads back as `cluster`.
std::string cluster_toml(const ch15::Cluster& cluster);

}  // namespace fivefold::runtime
