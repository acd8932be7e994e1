// What a run did: curves compared and plotted, and each rank's measurements tabulated.
#include "runtime/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "fivefold/consolidate.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/svg.h"

namespace fivefold::runtime {

namespace fs = std::filesystem;

Curve read_curve(const std::string& metrics_path, const std::string& label) {
  const std::string path =
      fs::is_directory(metrics_path) ? metrics_path + "/metrics.jsonl" : metrics_path;
  std::ifstream in(path);
  FIVEFOLD_CHECK(in.good(), "cannot read '", path, "'");
  Curve curve;
  curve.label = label;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw Error("'" + path + "' line " + std::to_string(number) + " is not JSON: " + e.what());
    }
    if (row.value("kind", "") != "train") continue;
    FIVEFOLD_CHECK(row.contains("step") && row.contains("loss") && row.contains("grad_norm"),
                   "'", path, "' line ", number, ": a training row needs step, loss and grad_norm");
    curve.steps.push_back(row["step"].get<int64_t>());
    curve.loss.push_back(row["loss"].get<double>());
    curve.grad_norm.push_back(row["grad_norm"].get<double>());
  }
  FIVEFOLD_CHECK(!curve.steps.empty(), "'", path, "' has no training rows");
  return curve;
}

namespace {

double relative(double a, double reference) {
  return std::abs(a - reference) / std::max(std::abs(reference), 1e-30);
}

// Indices (into a, into b) of the steps both curves have, in step order.
std::vector<std::pair<size_t, size_t>> shared_steps(const Curve& a, const Curve& b) {
  std::vector<std::pair<size_t, size_t>> out;
  size_t j = 0;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    while (j < b.steps.size() && b.steps[j] < a.steps[i]) ++j;
    if (j < b.steps.size() && b.steps[j] == a.steps[i]) out.emplace_back(i, j);
  }
  return out;
}

}  // namespace

CurveDifference compare_curves(const Curve& curve, const Curve& reference) {
  const auto shared = shared_steps(curve, reference);
  FIVEFOLD_CHECK(!shared.empty(), "'", curve.label, "' and '", reference.label,
                 "' have no training step in common");
  CurveDifference d;
  d.steps = static_cast<int64_t>(shared.size());
  for (const auto& [i, j] : shared) {
    const double loss = relative(curve.loss[i], reference.loss[j]);
    if (loss > d.max_loss_relative || d.worst_step == 0) {
      d.max_loss_relative = std::max(d.max_loss_relative, loss);
      if (loss >= d.max_loss_relative) d.worst_step = curve.steps[i];
    }
    d.max_norm_relative =
        std::max(d.max_norm_relative, relative(curve.grad_norm[i], reference.grad_norm[j]));
  }
  return d;
}

std::string curve_table(const Curve& curve, const Curve& reference, int64_t rows) {
  const auto shared = shared_steps(curve, reference);
  FIVEFOLD_CHECK(!shared.empty(), "'", curve.label, "' and '", reference.label,
                 "' have no training step in common");
  const int64_t n = static_cast<int64_t>(shared.size());
  const int64_t shown = std::max<int64_t>(2, std::min(rows, n));
  std::ostringstream out;
  out << "| step | loss " << curve.label << " | loss " << reference.label
      << " | rel. diff | grad norm " << curve.label << " | grad norm " << reference.label << " |\n"
      << "|---:|---:|---:|---:|---:|---:|\n";
  int64_t last = -1;
  for (int64_t k = 0; k < shown; ++k) {
    const int64_t at = n == 1 ? 0 : k * (n - 1) / (shown - 1);
    if (at == last) continue;
    last = at;
    const auto [i, j] = shared[static_cast<size_t>(at)];
    char line[256];
    std::snprintf(line, sizeof(line), "| %lld | %.5f | %.5f | %.1e | %.4f | %.4f |\n",
                  static_cast<long long>(curve.steps[i]), curve.loss[i], reference.loss[j],
                  relative(curve.loss[i], reference.loss[j]), curve.grad_norm[i],
                  reference.grad_norm[j]);
    out << line;
  }
  return out.str();
}

std::string svg_plot(const std::vector<Curve>& curves, const std::string& title) {
  FIVEFOLD_CHECK(!curves.empty(), "svg_plot: no curves");
  svg::LineChart chart;
  chart.title = title;
  chart.x_label = "step";
  chart.y_label = "training loss";
  for (const Curve& c : curves) {
    svg::Series series;
    series.label = c.label;
    series.x.assign(c.steps.begin(), c.steps.end());
    series.y = c.loss;
    chart.series.push_back(series);
  }
  return svg::line_chart(chart);
}

RankMeasurement measure_rank(const dist::CommStats& stats) {
  RankMeasurement m;
  for (const auto& [name, ops] : stats) {
    int64_t bytes = 0;
    for (const auto& [op, counts] : ops) bytes += counts.payload_bytes;
    if (bytes > 0) m.payload_bytes[name] = bytes;
  }
  m.peak_resident_bytes = peak_resident_bytes();
  return m;
}

std::vector<RankMeasurement> gather_measurements(const dist::CommunicatorPtr& world,
                                                 const RankMeasurement& mine) {
  const nlohmann::json json = {{"bytes", mine.payload_bytes},
                               {"peak", mine.peak_resident_bytes},
                               {"predicted", mine.predicted_bytes},
                               {"state", mine.state_bytes},
                               {"predicted_state", mine.predicted_state_bytes},
                               {"flops", mine.matmul_flops},
                               {"predicted_flops", mine.predicted_matmul_flops},
                               {"flops_exact", mine.flops_exact_per_rank}};
  std::vector<RankMeasurement> all;
  for (const nlohmann::json& j : all_gather_json(json, *world)) {
    RankMeasurement m;
    m.payload_bytes = j["bytes"].get<std::map<std::string, int64_t>>();
    m.peak_resident_bytes = j["peak"].get<int64_t>();
    m.predicted_bytes = j["predicted"].get<std::map<std::string, int64_t>>();
    m.state_bytes = j["state"].get<int64_t>();
    m.predicted_state_bytes = j["predicted_state"].get<int64_t>();
    m.matmul_flops = j["flops"].get<int64_t>();
    m.predicted_matmul_flops = j["predicted_flops"].get<int64_t>();
    m.flops_exact_per_rank = j["flops_exact"].get<bool>();
    all.push_back(m);
  }
  return all;
}

nlohmann::json measurement_json(const std::vector<RankMeasurement>& ranks, int64_t steps) {
  FIVEFOLD_CHECK(steps >= 1, "measurement_json: steps must be >= 1");
  std::map<std::string, std::vector<int64_t>> by_group, predicted;
  nlohmann::json peaks = nlohmann::json::array();
  for (const auto& r : ranks) {
    for (const auto& [name, bytes] : r.payload_bytes) by_group[name].push_back(bytes);
    for (const auto& [name, bytes] : r.predicted_bytes) predicted[name].push_back(bytes);
    peaks.push_back(r.peak_resident_bytes);
  }
  // The mean and the largest of `bytes`, divided by `steps`.
  auto mean_and_max = [](const std::vector<int64_t>& bytes, int64_t per) {
    double sum = 0;
    int64_t most = 0;
    for (int64_t b : bytes) {
      sum += static_cast<double>(b);
      most = std::max(most, b);
    }
    const double n = static_cast<double>(per);
    return std::pair{sum / static_cast<double>(bytes.size()) / n, static_cast<double>(most) / n};
  };
  nlohmann::json groups = nlohmann::json::object();
  for (const auto& [name, bytes] : by_group) {
    const auto [mean, most] = mean_and_max(bytes, steps);
    groups[name] = {{"mean", mean}, {"max", most}, {"ranks", bytes.size()}};
  }
  for (const auto& [name, bytes] : predicted) {  // over the ranks predicted
    const auto [mean, most] = mean_and_max(bytes, steps);
    groups[name]["predicted_mean"] = mean;
    groups[name]["predicted_max"] = most;
    // ep's all-to-alls carry what the router chose: every row sent is received, so the mean
    // over the ranks is the formula's, but one rank's share is only the balanced expectation.
    groups[name]["exact"] = name == "ep" ? nlohmann::json{"mean"} : nlohmann::json{"mean", "max"};
    if (!groups[name].contains("ranks"))
      groups[name].update({{"mean", 0.0}, {"max", 0.0}, {"ranks", 0}});
  }
  nlohmann::json out = {{"per_step_bytes", groups}, {"peak_resident_bytes", peaks}};
  auto all_known = [&](int64_t RankMeasurement::*field) {
    nlohmann::json values = nlohmann::json::array();
    for (const auto& r : ranks) {
      if (r.*field < 0) return nlohmann::json();
      values.push_back(r.*field);
    }
    return values;
  };
  if (auto v = all_known(&RankMeasurement::state_bytes); !v.is_null()) out["state_bytes"] = v;
  if (auto v = all_known(&RankMeasurement::predicted_state_bytes); !v.is_null())
    out["predicted_state_bytes"] = v;
  if (auto v = all_known(&RankMeasurement::matmul_flops); !v.is_null()) out["matmul_flops"] = v;
  if (auto v = all_known(&RankMeasurement::predicted_matmul_flops); !v.is_null()) {
    out["predicted_matmul_flops"] = v;
    bool each = true;
    for (const auto& r : ranks) each = each && r.flops_exact_per_rank;
    out["matmul_flops_exact"] = each ? "each" : "mean";
  }
  return out;
}

std::string measurement_table(const std::vector<RankMeasurement>& ranks, int64_t steps) {
  const nlohmann::json j = measurement_json(ranks, steps);
  std::ostringstream out;
  if (j["per_step_bytes"].empty())
    out << "no communicator carried anything (one process)\n";
  else
    out << "| communicator | ranks using it | bytes per step, mean | bytes per step, max | "
           "predicted, mean | predicted, max |\n"
        << "|---|---:|---:|---:|---:|---:|\n";
  for (const auto& [name, g] : j["per_step_bytes"].items()) {
    char line[200];
    std::string predicted = "| - | - |";
    if (g.contains("predicted_mean")) {
      char cells[80];
      const bool max_exact = g["exact"].size() == 2;  // else '~': the balanced expectation
      std::snprintf(cells, sizeof(cells), "| %.0f | %s%.0f |", g["predicted_mean"].get<double>(),
                    max_exact ? "" : "~", g["predicted_max"].get<double>());
      predicted = cells;
    }
    std::snprintf(line, sizeof(line), "| %s | %lld | %.0f | %.0f %s\n", name.c_str(),
                  static_cast<long long>(g["ranks"].get<int64_t>()), g["mean"].get<double>(),
                  g["max"].get<double>(), predicted.c_str());
    out << line;
  }
  // Smallest, mean and largest over the ranks, in MB.
  auto spread = [](const std::vector<int64_t>& values) {
    const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
    double mean = 0;
    for (int64_t v : values) mean += static_cast<double>(v);
    mean /= static_cast<double>(values.size());
    char text[120];
    std::snprintf(text, sizeof(text), "smallest %.3f MB, mean %.3f MB, largest %.3f MB",
                  static_cast<double>(*lo) / 1e6, mean / 1e6, static_cast<double>(*hi) / 1e6);
    return std::string(text);
  };
  if (j.contains("state_bytes") && !j["state_bytes"].empty()) {
    out << "model state per rank (parameters, gradients and AdamW moments after the last step): "
        << spread(j["state_bytes"].get<std::vector<int64_t>>());
    if (j.contains("predicted_state_bytes"))
      out << "; predicted (chapter 09's ZeRO formulas on the rank's part) "
          << spread(j["predicted_state_bytes"].get<std::vector<int64_t>>());
    out << "\n";
  }
  if (j.contains("matmul_flops")) {
    // One step's, in GFLOP: smallest, mean and largest over the ranks.
    auto per_step = [](const nlohmann::json& flops) {
      std::vector<double> v;
      for (const auto& f : flops) v.push_back(f.get<double>());
      const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
      double mean = 0;
      for (double x : v) mean += x;
      char text[120];
      std::snprintf(text, sizeof(text), "smallest %.4f, mean %.4f, largest %.4f GFLOP", *lo / 1e9,
                    mean / static_cast<double>(v.size()) / 1e9, *hi / 1e9);
      return std::string(text);
    };
    out << "matmul FLOPs per rank in the first step (chapter 02's counter, forward and "
           "backward): "
        << per_step(j["matmul_flops"]);
    if (j.contains("predicted_matmul_flops")) {
      out << "; predicted " << (j["matmul_flops_exact"] == "each" ? "" : "(routed experts: "
                                                                          "balanced routing) ")
          << per_step(j["predicted_matmul_flops"]);
    }
    out << "\n";
  }
  const auto peaks = j["peak_resident_bytes"].get<std::vector<int64_t>>();
  if (!peaks.empty()) {
    const auto [lo, hi] = std::minmax_element(peaks.begin(), peaks.end());
    double mean = 0;
    for (int64_t p : peaks) mean += static_cast<double>(p);
    mean /= static_cast<double>(peaks.size());
    char line[160];
    std::snprintf(line, sizeof(line),
                  "peak resident memory per rank: smallest %.1f MB, mean %.1f MB, largest %.1f MB "
                  "(%zu ranks)\n",
                  static_cast<double>(*lo) / 1e6, mean / 1e6, static_cast<double>(*hi) / 1e6,
                  peaks.size());
    out << line;
  }
  return out.str();
}

}  // namespace fivefold::runtime
