// A cluster description file, read with the settings' own strict TOML reader (fivefold/cli.h).
#include "runtime/cluster.h"

#include <sstream>

#include "fivefold/cli.h"
#include "fivefold/error.h"

namespace fivefold::runtime {

namespace {

// Every key: its name and where it goes, with the unit the file gives it in.
struct Key {
  const char* name;
  const char* help;
  double scale;  // file unit -> the planner's (bytes, FLOP/s, seconds)
  double ch15::Cluster::*real = nullptr;
  double ch15::Link::*link = nullptr;
  ch15::Link ch15::Cluster::*which = nullptr;
  bool optional = false;  // absent: 0
};

const std::vector<Key>& keys() {
  using C = ch15::Cluster;
  using L = ch15::Link;
  static const std::vector<Key> table = {
      {"memory-gb", "memory per device, GB (1e9 bytes)", 1e9, &C::memory_bytes},
      {"peak-tflops-bf16", "datasheet dense bf16 TFLOP/s (MFU)", 1e12, &C::peak_flops_bf16},
      {"peak-tflops-fp32", "datasheet dense fp32 TFLOP/s (MFU)", 1e12, &C::peak_flops_fp32},
      {"matmul-tflops-bf16", "bf16 TFLOP/s the step's products sustain", 1e12,
       &C::matmul_flops_bf16},
      {"matmul-tflops-fp32", "fp32 TFLOP/s the step's products sustain", 1e12,
       &C::matmul_flops_fp32},
      {"attention-tflops-fp32",
       "fp32 TFLOP/s the causal attention kernel sustains (optional: the products' rate)", 1e12,
       &C::attention_flops_fp32, nullptr, nullptr, true},
      {"attention-tflops-bf16",
       "bf16 TFLOP/s the causal attention kernel sustains (optional: the products' rate)", 1e12,
       &C::attention_flops_bf16, nullptr, nullptr, true},
      {"product-latency-us-fp32",
       "microseconds each fp32 product costs besides its FLOPs (optional: none)", 1e-6,
       &C::product_latency_fp32, nullptr, nullptr, true},
      {"product-latency-us-bf16",
       "microseconds each bf16 product costs besides its FLOPs (optional: none)", 1e-6,
       &C::product_latency_bf16, nullptr, nullptr, true},
      {"memory-gbps",
       "GB/s a product streams its operands at (optional: every product costs its FLOPs)", 1e9,
       &C::memory_bandwidth, nullptr, nullptr, true},
      {"adamw-ns-per-parameter", "nanoseconds the optimizer's update takes per parameter", 1e-9,
       &C::optimizer_seconds_per_parameter},
      {"intra-node-gbps", "GB/s a device sends inside its node", 1e9, nullptr, &L::bandwidth,
       &C::intra_node},
      {"intra-node-latency-us", "microseconds a message takes inside a node", 1e-6, nullptr,
       &L::latency, &C::intra_node},
      {"inter-node-gbps", "GB/s a device sends to another node", 1e9, nullptr, &L::bandwidth,
       &C::inter_node},
      {"inter-node-latency-us", "microseconds a message takes between nodes", 1e-6, nullptr,
       &L::latency, &C::inter_node},
  };
  return table;
}

// The collectives a link may price on lines of their own, and the key each line's figures take:
// "intra-node-all-reduce-gbps", "intra-node-all-reduce-latency-us", ...
constexpr dist::Op kCollectives[] = {dist::Op::AllReduce, dist::Op::AllGather,
                                     dist::Op::ReduceScatter, dist::Op::AllToAll,
                                     dist::Op::SendRecv};
struct LinkClass {
  const char* prefix;
  ch15::Link ch15::Cluster::*link;
};
constexpr LinkClass kLinks[] = {{"intra-node", &ch15::Cluster::intra_node},
                                {"inter-node", &ch15::Cluster::inter_node}};

std::string collective_key(const LinkClass& link, dist::Op op, const char* figure) {
  std::string name = dist::op_name(op);
  for (char& ch : name) ch = ch == '_' ? '-' : ch;
  return std::string(link.prefix) + "-" + name + "-" + figure;
}

}  // namespace

ch15::Cluster read_cluster(const std::string& path) {
  ArgParser file("cluster file", "A cluster description (chapter 15's planner).");
  file.option("name", "", "what the cluster is");
  file.option("devices", "", "devices in all");
  file.option("devices-per-node", "", "devices that share a node's link");
  for (const Key& key : keys()) file.option(key.name, "", key.help);
  for (const LinkClass& link : kLinks)
    for (dist::Op op : kCollectives) {
      file.option(collective_key(link, op, "gbps"), "",
                  "GB/s of this collective's own line (with its latency)");
      file.option(collective_key(link, op, "latency-us"), "",
                  "microseconds a message of this collective's own line (with its GB/s)");
    }
  file.config_file("the cluster's TOML file", "cluster");
  const std::string at = "--cluster";
  const char* argv[] = {"cluster", at.c_str(), path.c_str()};
  file.parse(3, argv);
  ch15::Cluster cluster;
  cluster.name = file.str("name");
  for (const char* name : {"devices", "devices-per-node"})
    FIVEFOLD_CHECK(file.given(name), "cluster file '", path, "': no '", name, "' key");
  cluster.devices = file.integer("devices");
  cluster.devices_per_node = file.integer("devices-per-node");
  for (const Key& key : keys()) {
    if (key.optional && !file.given(key.name)) continue;
    FIVEFOLD_CHECK(file.given(key.name), "cluster file '", path, "': no '", key.name, "' key (",
                   key.help, ")");
    const double value = file.real(key.name) * key.scale;
    if (key.real)
      cluster.*key.real = value;
    else
      (cluster.*key.which).*key.link = value;
  }
  for (const LinkClass& link : kLinks)
    for (dist::Op op : kCollectives) {
      const std::string gbps = collective_key(link, op, "gbps");
      const std::string latency = collective_key(link, op, "latency-us");
      FIVEFOLD_CHECK(file.given(gbps) == file.given(latency), "cluster file '", path, "': give '",
                     gbps, "' and '", latency, "' together");
      if (file.given(gbps))
        (cluster.*link.link).by_collective[op] = {file.real(latency) * 1e-6, file.real(gbps) * 1e9};
    }
  try {
    cluster.validate();
  } catch (const Error& e) {
    throw Error("cluster file '" + path + "': " + e.what());
  }
  return cluster;
}

std::string cluster_toml(const ch15::Cluster& cluster) {
  std::ostringstream out;
  out.precision(8);
  out << "name = \"" << cluster.name << "\"\n";
  out << "devices = " << cluster.devices << "\n";
  out << "devices-per-node = " << cluster.devices_per_node << "\n";
  for (const Key& key : keys()) {
    const double value = key.real ? cluster.*key.real : (cluster.*key.which).*key.link;
    if (key.optional && value == 0) continue;
    out << key.name << " = " << value / key.scale << "\n";
  }
  for (const LinkClass& link : kLinks)
    for (const auto& [op, line] : (cluster.*link.link).by_collective) {
      out << collective_key(link, op, "gbps") << " = " << line.bandwidth / 1e9 << "\n";
      out << collective_key(link, op, "latency-us") << " = " << line.latency / 1e-6 << "\n";
    }
  return out.str();
}

}  // namespace fivefold::runtime
