// fivefold calibrate: this machine's cluster description, measured.
#include "runtime/calibrate.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <tuple>

#include "02_flops_6np/flops.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/plan.h"
#include "14_memory/precision.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"
#include "fivefold/timer.h"
#include "runtime/fast.h"
#include "runtime/layout.h"

namespace fivefold::runtime {

namespace {

// The slowest rank's value.
double slowest(double seconds, dist::Communicator& world) {
  auto t = torch::tensor({seconds}, torch::kDouble);
  world.all_reduce(t, dist::ReduceOp::Max);
  return t.item<double>();
}

// Each step's seconds, from the loop's hooks.
class StepClock : public RunObserver {
 public:
  void step_begins(int64_t) override { timer_.reset(); }
  void step_ended(int64_t, ch03::TrainingStep&, const ch03::StepResult&) override {
    seconds.push_back(timer_.seconds());
  }
  std::vector<double> seconds;

 private:
  Timer timer_;
};

// Each collective the chapters run, over `whole`'s ranks, at each size (`bytes` the whole
// tensor: an all-gather's result, a reduce-scatter's or an all-to-all's input; a send/receive is
// each rank sending to the next while receiving from the previous, the ring's step, as cp's ring
// and pp's sends run), the slowest rank's median over `world` (every group times at once, as a
// job's groups share the links); a line fitted to each collective and one to them all.
ch15::Link measure_link(dist::Communicator& whole, dist::Communicator& world,
                        const CalibrationOptions& options, nlohmann::json& measured) {
  using Samples = std::vector<std::array<double, 3>>;  // messages, wire bytes, seconds
  std::map<dist::Op, Samples> samples;
  // At each rank count k that divides the group's (groups of k consecutive ranks, all at once):
  // one line a collective fits every count, the ring's messages and wire bytes growing with k.
  for (int k = 2; k <= whole.size(); ++k) {
    if (whole.size() % k != 0) continue;
    auto split = k == whole.size() ? nullptr
                                   : whole.split(whole.rank() / k, whole.rank(),
                                                 "calibrate." + std::to_string(k));
    dist::Communicator& group = split ? *split : whole;
    const int n = group.size();
    for (int64_t bytes : options.sizes) {
      const int64_t elements = bytes / 4 / n * n;  // a multiple of the ranks
      auto buffer = torch::ones({elements}, torch::kFloat);
      auto part = torch::ones({elements / n}, torch::kFloat);
      auto received = torch::empty_like(buffer);
      const std::vector<int64_t> even(static_cast<size_t>(n), elements / n);
      auto time = [&](const std::function<void()>& op) {
        op();  // warm-up
        std::vector<double> each;
        for (int64_t i = 0; i < options.iterations; ++i) {
          world.barrier();
          Timer timer;
          op();
          each.push_back(timer.seconds());
        }
        return slowest(median(each), world);
      };
      const double total = 4.0 * static_cast<double>(elements), share = (n - 1.0) / n * total;
      nlohmann::json row = {{"bytes", total}, {"ranks", n}};
      auto add = [&](dist::Op op, double messages, double wire, double seconds) {
        samples[op].push_back({messages, wire, seconds});
        row[std::string(dist::op_name(op)) + "_s"] = seconds;
      };
      add(dist::Op::AllReduce, 2.0 * (n - 1), 2 * share, time([&] { group.all_reduce(buffer); }));
      add(dist::Op::AllGather, n - 1.0, share, time([&] { group.all_gather(part); }));
      add(dist::Op::ReduceScatter, n - 1.0, share, time([&] { group.reduce_scatter(buffer); }));
      add(dist::Op::AllToAll, n - 1.0, share, time([&] { group.all_to_all(buffer, even, even); }));
      add(dist::Op::SendRecv, 1.0, total, time([&] {
            group.send_recv(buffer, (group.rank() + 1) % n, received, (group.rank() + n - 1) % n);
          }));
      measured["messages"].push_back(row);
    }
  }
  // Least squares for seconds = latency·messages + wire / bandwidth.
  auto fit = [](const Samples& points, const std::string& what) {
    double mm = 0, mw = 0, ww = 0, mt = 0, wt = 0;
    for (const auto& [m, w, t] : points) {
      mm += m * m, mw += m * w, ww += w * w, mt += m * t, wt += w * t;
    }
    const double det = mm * ww - mw * mw;
    double latency = (mt * ww - wt * mw) / det, per_byte = (mm * wt - mw * mt) / det;
    if (!(latency >= 0) || !(per_byte > 0)) latency = 0, per_byte = wt / ww;  // through zero
    FIVEFOLD_CHECK(per_byte > 0, "fivefold calibrate: the ", what,
                   " times do not grow with their size; run it again on a quieter machine");
    return ch15::LinkLine{latency, 1 / per_byte};
  };
  Samples every;
  ch15::Link link;
  for (const auto& [op, points] : samples) {
    every.insert(every.end(), points.begin(), points.end());
    link.by_collective[op] = fit(points, dist::op_name(op));
    measured[dist::op_name(op)] = {{"latency_s", link.by_collective[op].latency},
                                   {"bandwidth_bytes_per_s", link.by_collective[op].bandwidth}};
  }
  const ch15::LinkLine common = fit(every, "message");  // for a collective without its own line
  link.latency = common.latency;
  link.bandwidth = common.bandwidth;
  measured["every"] = {{"latency_s", common.latency}, {"bandwidth_bytes_per_s", common.bandwidth}};
  return link;
}

// The products a step of `run` multiplies (chapter 10's rank_block at tp 1 for each block, and
// the head), each alone at its shape, in fp32 and bf16, on both kernels (the fast paths' oneDNN
// and at::mm), every rank at once (the slowest rank's time): each matrix by every token of the
// batch (a routed expert's by its k/E share), forward ([m, in]·[in, out]) and the two backward
// products (∂L/∂x = ∂L/∂y·W: [m, out]·[out, in]; ∂L/∂W = (∂L/∂y)ᵀ·x: [out, m]·[m, in]), at the
// batch and at a quarter of it. A line through each precision's on the kernel the run uses,
// seconds = latency + FLOPs / rate, gives what a product costs besides its FLOPs; a product of
// one row by a matrix larger than the caches, the memory's bandwidth.
void measure_products(const RunConfig& run, dist::Communicator& world, ch15::Cluster& c,
                      nlohmann::json& measured) {
  const ch03::ModelConfig& m = run.model;
  const int64_t tokens = run.batch * run.seq_len;
  const auto moe =
      ch07::has_routed_experts(m) ? ch07::MoeConfig::from_json(m.extensions) : ch07::MoeConfig{};
  std::vector<std::array<int64_t, 3>> shapes;  // rows, inner, columns
  auto add = [&](int64_t rows, int64_t in, int64_t out) {
    for (int64_t share : {1, 4}) {
      const int64_t r = std::max<int64_t>(1, rows / share);
      for (std::array<int64_t, 3> shape :
           {std::array<int64_t, 3>{r, in, out}, {r, out, in}, {out, r, in}})
        if (std::find(shapes.begin(), shapes.end(), shape) == shapes.end()) shapes.push_back(shape);
    }
  };
  for (int64_t layer = 0; layer < m.n_layers; ++layer)
    for (const ch10::RankMatrix& w : ch10::rank_block(m, layer, 1, 0, false).matrices)
      add(w.rows == ch10::RankMatrix::Rows::Expert
              ? tokens * moe.num_experts_per_tok / moe.n_routed_experts
              : tokens,
          w.in, w.out);
  add(tokens, m.d_model, m.vocab_size);  // the head
  const auto previous = ch03::set_matmul_kernel(nullptr);
  auto seconds_of = [&](int64_t rows, int64_t inner, int64_t cols) {  // fp32, bf16
    world.barrier();
    const ch14::ProductSpeed speed = ch14::measure_product_speed(rows, inner, cols);
    const double flops = 2.0 * static_cast<double>(rows * inner * cols);
    return std::make_pair(slowest(flops / (speed.fp32 * 1e9), world),
                          slowest(flops / (speed.bf16 * 1e9), world));
  };
  using Samples = std::vector<std::pair<double, double>>;  // FLOPs, seconds
  Samples fp32, bf16;
  for (bool fast : {true, false}) {
    ch03::set_matmul_kernel(fast ? fast_matmul_kernel() : nullptr);
    for (const auto& [rows, inner, cols] : shapes) {
      const auto [single, half] = seconds_of(rows, inner, cols);
      const double flops = 2.0 * static_cast<double>(rows * inner * cols);
      if (fast == run.fast) fp32.push_back({flops, single}), bf16.push_back({flops, half});
      measured["products"].push_back({{"kernel", fast ? "oneDNN" : "at::mm"},
                                      {"rows", rows},
                                      {"inner", inner},
                                      {"columns", cols},
                                      {"fp32_s", single},
                                      {"bf16_s", half}});
    }
  }
  ch03::set_matmul_kernel(run.fast ? fast_matmul_kernel() : nullptr);  // the run's, for the memory
  // Least squares for seconds = latency + FLOPs / rate (through zero where the latency comes out
  // negative); the worst product's distance from the line.
  auto fit = [&](const Samples& points, const char* precision) {
    double n = 0, f = 0, ff = 0, t = 0, ft = 0;
    for (const auto& [x, y] : points) n += 1, f += x, ff += x * x, t += y, ft += x * y;
    double per_flop = (n * ft - f * t) / (n * ff - f * f), latency = (t - per_flop * f) / n;
    if (!(latency >= 0)) latency = 0, per_flop = ft / ff;
    double worst = 0;
    for (const auto& [x, y] : points)
      worst = std::max(worst, std::abs(latency + x * per_flop - y) / y);
    measured["product_line"][precision] = {
        {"latency_s", latency}, {"rate", 1 / per_flop}, {"worst_error", worst}};
    return latency;
  };
  c.product_latency_fp32 = fit(fp32, "fp32");
  c.product_latency_bf16 = fit(bf16, "bf16");
  // The memory: one row by a 4096 x 4096 matrix (64 MB in fp32) streams the matrix.
  const int64_t n = 4096;
  const double seconds = seconds_of(1, n, n).first;
  const double streamed =
      seconds > c.product_latency_fp32 ? seconds - c.product_latency_fp32 : seconds;
  c.memory_bandwidth = 4.0 * static_cast<double>(n * n + 2 * n) / streamed;
  measured["memory_bandwidth_bytes_per_s"] = c.memory_bandwidth;
  ch03::set_matmul_kernel(previous);
}

}  // namespace

Calibration calibrate(const dist::CommunicatorPtr& world, const CalibrationOptions& options) {
  const int n = world->size();
  FIVEFOLD_CHECK(n >= 2,
                 "fivefold calibrate: a link needs two ranks: run it under mpirun -np N "
                 "(N >= 2, one rank a device)");
  Calibration out;
  ch15::Cluster& c = out.cluster;
  c.name = "this machine, " + std::to_string(n) + " ranks (fivefold calibrate)";
  c.devices = n;
  c.memory_bytes = static_cast<double>(available_memory()) / n;

  // The product rate: each rank trains the model alone, all at once.
  ch15::Workload work = workload_of(options.run);
  ch15::Cluster unit = c;  // any valid description: the FLOPs do not depend on it
  unit.peak_flops_fp32 = unit.peak_flops_bf16 = unit.matmul_flops_fp32 = unit.matmul_flops_bf16 = 1;
  unit.intra_node = unit.inter_node = {0, 1};
  unit.memory_bytes = 1;
  // A step costs its products at the rate and, once a step whatever its tokens, the optimizer's
  // update (and the loop's own work): two batches, the run's and half of it, give both.
  FIVEFOLD_CHECK(options.run.batch >= 2 && options.run.batch % 2 == 0,
                 "fivefold calibrate: --batch must be even (the step is timed at it and at half)");
  // What a step of `batch` rows multiplies on one device, as the planner counts it.
  auto one_device_flops = [&](int64_t batch, const char* precision) {
    ch15::Workload w = work;
    w.batch = batch;
    return ch15::estimate_step(w, ch15::resolve_layout({}, 1, w), unit,
                               ch14::parse_precision(precision))
        .flops;
  };
  // The causal attention kernel the run uses (the fast paths' tiled one, or chapter 03's), one
  // block's forward and backward at the run's shape, every rank at once; its rate as the planner
  // counts attention FLOPs (half the square of scores: the tiles' extra work is in the rate).
  auto time_attention = [&](const char* precision) {
    const ch03::ModelConfig& m = options.run.model;
    const int64_t rows = options.run.batch, seq = options.run.seq_len, hd = m.resolved_head_dim();
    torch::NoGradGuard outside;
    auto q = torch::randn({rows, m.n_heads, seq, hd});
    auto k = torch::randn({rows, m.n_kv_heads, seq, hd}), v = torch::randn_like(k);
    const auto positions = torch::arange(seq, torch::kLong);
    std::shared_ptr<const ch03::AttentionKernel> kernel;
    if (options.run.fast)
      kernel = std::make_shared<const TiledCausalAttentionKernel>();
    else
      kernel = std::make_shared<const ch03::CausalAttentionKernel>();
    const auto previous = ch03::set_matmul_kernel(nullptr);
    ch14::use_precision(ch14::parse_precision(precision), previous);
    std::vector<double> each;
    for (int64_t i = 0; i <= options.steps; ++i) {
      torch::AutoGradMode grad(true);
      auto qi = q.clone().requires_grad_(), ki = k.clone().requires_grad_(),
           vi = v.clone().requires_grad_();
      world->barrier();
      Timer timer;
      kernel->attend(qi, ki, vi, positions, positions, 1.0 / std::sqrt(hd)).output.sum().backward();
      if (i > 0) each.push_back(timer.seconds());  // the first: warm-up
    }
    ch03::set_matmul_kernel(previous);
    const double flops = static_cast<double>(one_device_flops(rows, precision).attention) /
                         static_cast<double>(m.n_layers);  // one block's
    return flops / slowest(median(each), *world);
  };
  auto timed_step = [&](const char* precision, int64_t batch) {
    RunConfig run = options.run;
    run.precision = precision;
    run.batch = batch;
    run.steps = run.train.total_steps = options.steps + 1;
    run.train.warmup_steps = 0;  // the learning rate does not change the time
    run.eval_every = 0;
    run.exact_match_examples = 0;
    run.progress = false;
    run.out_dir.clear();
    run.placement = {};
    run.build_model = ch07::make_model;  // what the trainer builds (chapter 15's apply_layout)
    StepClock clock;
    run.observers.push_back(&clock);
    world->barrier();
    run_training(run);
    clock.seconds.erase(clock.seconds.begin());  // warm-up
    const ch15::StepFlops flops = one_device_flops(batch, precision);
    return std::make_tuple(slowest(median(clock.seconds), *world),
                           static_cast<double>(flops.matrices + flops.head),
                           static_cast<double>(flops.attention));
  };
  // Each product on its own first: the latency a step's products cost besides their FLOPs
  // (products_a_step of them, as the planner counts them) leaves the step's rate to the fit.
  measure_products(options.run, *world, c, out.measured);
  const double products_a_step = [&] {
    ch15::Cluster counting = unit;  // every FLOP free, each product a second
    counting.matmul_flops_fp32 = counting.matmul_flops_bf16 = 1e300;
    counting.product_latency_fp32 = 1;
    return std::round(ch15::estimate_step(work, ch15::resolve_layout({}, 1, work), counting,
                                          ch14::Precision::Fp32)
                          .compute);
  }();
  out.measured["products_a_step"] = std::llround(products_a_step);
  double fixed = 0;
  for (const char* precision : {"fp32", "bf16"}) {
    // The attention kernel alone first: its seconds leave the step's products to the fit.
    const double attention_rate = time_attention(precision);
    const double latency =
        products_a_step *
        (std::string(precision) == "fp32" ? c.product_latency_fp32 : c.product_latency_bf16);
    const auto [full, full_flops, full_attention] = timed_step(precision, options.run.batch);
    const auto [half, half_flops, half_attention] = timed_step(precision, options.run.batch / 2);
    const double full_products = full - full_attention / attention_rate - latency;
    const double half_products = half - half_attention / attention_rate - latency;
    double rate = (full_flops - half_flops) / (full_products - half_products);
    double once = full_products - full_flops / rate;
    if (!(full_products > half_products) || once < 0) {  // noise: no fixed part
      rate = full_flops / full_products, once = 0;
    }
    FIVEFOLD_CHECK(rate > 0, "fivefold calibrate: the attention kernel alone took longer than ",
                   "the whole step; run it again on a quieter machine");
    if (std::string(precision) == "fp32") {
      c.matmul_flops_fp32 = c.peak_flops_fp32 = rate;
      c.attention_flops_fp32 = attention_rate;
      fixed = once;
    } else {
      c.matmul_flops_bf16 = c.peak_flops_bf16 = rate;
      c.attention_flops_bf16 = attention_rate;
    }
    out.measured["step"][precision] = {{"seconds", full},
                                       {"product_flops", full_flops},
                                       {"attention_flops", full_attention},
                                       {"half_batch_seconds", half},
                                       {"half_batch_product_flops", half_flops},
                                       {"attention_rate", attention_rate},
                                       {"rate", rate},
                                       {"once_a_step_s", once}};
  }
  const double parameters =
      static_cast<double>(ch02::count_parameters(options.run.model.shape()).total);
  c.optimizer_seconds_per_parameter = fixed / parameters;

  // The links: inside a node, the ranks that share a host; between nodes, one rank of each host.
  // On one host both are the link over every rank.
  const std::string host = [] {
    char name[256] = {};
    gethostname(name, sizeof name - 1);
    return std::string(name);
  }();
  std::vector<std::string> hosts;  // in order of first appearance
  int host_index = -1, local_index = 0;
  const auto names = all_gather_json(host, *world);
  for (int r = 0; r < n; ++r) {
    const std::string name = names[static_cast<size_t>(r)].get<std::string>();
    if (std::find(hosts.begin(), hosts.end(), name) == hosts.end()) hosts.push_back(name);
    if (r < world->rank() && name == host) ++local_index;
  }
  host_index = static_cast<int>(std::find(hosts.begin(), hosts.end(), host) - hosts.begin());
  const int per_host = n / static_cast<int>(hosts.size());
  FIVEFOLD_CHECK(per_host * static_cast<int>(hosts.size()) == n,
                 "fivefold calibrate: give every host the same number of ranks (", n, " ranks on ",
                 hosts.size(), " hosts)");
  c.devices_per_node = per_host;
  if (hosts.size() == 1) {
    c.intra_node = c.inter_node = measure_link(*world, *world, options, out.measured["link"]);
  } else {
    auto node = world->split(host_index, world->rank(), "calibrate.node");
    auto across = world->split(local_index, world->rank(), "calibrate.hosts");
    c.inter_node = measure_link(*across, *world, options, out.measured["inter_node"]);
    c.intra_node = per_host > 1 ? measure_link(*node, *world, options, out.measured["intra_node"])
                                : c.inter_node;  // no group stays inside a node of one device
  }
  out.measured["hosts"] = hosts.size();
  c.validate();
  return out;
}

}  // namespace fivefold::runtime
