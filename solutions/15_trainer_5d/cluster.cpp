// Chapter 15: what a cluster charges: a collective on a link, a product on a device.
#include <algorithm>

#include "15_trainer_5d/planner.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

void Cluster::validate() const {
  FIVEFOLD_CHECK(devices >= 1 && devices_per_node >= 1, "cluster '", name,
                 "': devices and devices per node must be at least 1");
  FIVEFOLD_CHECK(memory_bytes > 0, "cluster '", name, "': give each device's memory");
  FIVEFOLD_CHECK(
      matmul_flops_fp32 > 0 && matmul_flops_bf16 > 0 && peak_flops_fp32 > 0 && peak_flops_bf16 > 0,
      "cluster '", name, "': give the peak and sustained matmul FLOP/s in fp32 and bf16");
  FIVEFOLD_CHECK(attention_flops_fp32 >= 0 && attention_flops_bf16 >= 0, "cluster '", name,
                 "': the attention kernel's FLOP/s cannot be negative (0: the products' rate)");
  FIVEFOLD_CHECK(product_latency_fp32 >= 0 && product_latency_bf16 >= 0 && memory_bandwidth >= 0,
                 "cluster '", name,
                 "': a product's latency and the memory's bandwidth cannot be "
                 "negative (0: not priced)");
  FIVEFOLD_CHECK(optimizer_seconds_per_parameter >= 0, "cluster '", name,
                 "': the optimizer's seconds per parameter cannot be negative");
  FIVEFOLD_CHECK(intra_node.bandwidth > 0 && inter_node.bandwidth > 0 && intra_node.latency >= 0 &&
                     inter_node.latency >= 0,
                 "cluster '", name, "': give both links' bandwidth (> 0) and latency (>= 0)");
  for (const Link* link : {&intra_node, &inter_node})
    for (const auto& [op, line] : link->by_collective)
      FIVEFOLD_CHECK(line.bandwidth > 0 && line.latency >= 0, "cluster '", name,
                     "': ", dist::op_name(op), "'s own line needs bandwidth > 0 and latency >= 0");
}

double Link::seconds(dist::Op op, double messages, double wire) const {
  const auto own = by_collective.find(op);
  const LinkLine line = own != by_collective.end() ? own->second : LinkLine{latency, bandwidth};
  return messages * line.latency + wire / line.bandwidth;
}

double Cluster::product_overhead(bool bf16, double rows, int64_t in, int64_t out) const {
  const double latency = bf16 ? product_latency_bf16 : product_latency_fp32;
  if (memory_bandwidth == 0) return latency;
  const double bytes =
      (bf16 ? 2.0 : 4.0) * (rows * in + static_cast<double>(in) * out + rows * out);
  const double flops = 2 * rows * static_cast<double>(in) * out;
  return latency + std::max(0.0, bytes / memory_bandwidth -
                                     flops / (bf16 ? matmul_flops_bf16 : matmul_flops_fp32));
}

}  // namespace fivefold::ch15
