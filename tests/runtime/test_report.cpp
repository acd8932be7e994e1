// What a run did (runtime/report.h): curves read back, compared, tabulated and plotted, and the
// ranks' measurements turned into bytes per step beside the predictions.

#include <filesystem>
#include <fstream>

#include "runtime/report.h"
#include "testing.h"

using namespace fivefold::runtime;
using fivefold::testing::throws_error_containing;

namespace {

// Writes a metrics.jsonl of training rows (step, loss, grad_norm) plus an eval row.
std::string write_metrics(const std::string& name, const std::vector<double>& losses) {
  const auto dir = std::filesystem::temp_directory_path() / ("fivefold-report-" + name);
  std::filesystem::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (size_t i = 0; i < losses.size(); ++i) {
    out << nlohmann::json{{"kind", "train"}, {"step", i + 1}, {"loss", losses[i]},
                          {"grad_norm", 2.0 * losses[i]}}
               .dump()
        << "\n";
  }
  out << R"({"kind":"eval","step":3,"eval_loss":1.0})" << "\n";
  return dir.string();
}

}  // namespace

TEST(Report, CurvesAreComparedTabulatedAndPlotted) {
  const auto a = read_curve(write_metrics("a", {4.0, 3.0, 2.02, 1.5}), "5D");
  const auto b = read_curve(write_metrics("b", {4.0, 3.0, 2.0}), "single");
  EXPECT_EQ(a.steps, (std::vector<int64_t>{1, 2, 3, 4}));
  const auto d = compare_curves(a, b);
  EXPECT_EQ(d.steps, 3);  // the steps both have
  EXPECT_NEAR(d.max_loss_relative, 0.01, 1e-12);
  EXPECT_NEAR(d.max_norm_relative, 0.01, 1e-12);
  EXPECT_EQ(d.worst_step, 3);
  const std::string table = curve_table(a, b, 10);
  EXPECT_NE(table.find("| 3 | 2.02000 | 2.00000 | 1.0e-02 |"), std::string::npos) << table;
  const std::string svg = svg_plot({a, b}, "loss");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find(">single</text>"), std::string::npos);
  EXPECT_NE(svg.find("<polyline"), svg.rfind("<polyline"));  // two curves
  EXPECT_TRUE(throws_error_containing([] { read_curve("/nonexistent/metrics.jsonl", "x"); },
                                      "cannot read"));
}

TEST(Report, MeasurementsBecomeBytesPerStep) {
  RankMeasurement r0, r1;
  r0.payload_bytes = {{"tp", 400}, {"dp+cp", 1000}};
  r1.payload_bytes = {{"tp", 600}};
  r0.peak_resident_bytes = 100'000'000;
  r1.peak_resident_bytes = 300'000'000;
  const auto j = measurement_json({r0, r1}, 2);
  EXPECT_DOUBLE_EQ(j["per_step_bytes"]["tp"]["mean"].get<double>(), 250);  // (400 + 600) / 2 / 2
  EXPECT_DOUBLE_EQ(j["per_step_bytes"]["tp"]["max"].get<double>(), 300);
  EXPECT_EQ(j["per_step_bytes"]["dp+cp"]["ranks"].get<int64_t>(), 1);
  const std::string table = measurement_table({r0, r1}, 2);
  EXPECT_NE(table.find("| tp | 2 | 250 | 300 | - | - |"), std::string::npos) << table;
  // A prediction per rank (over the run, like the measurement) goes beside it, per step: mean and
  // largest over the ranks.
  r0.predicted_bytes = {{"tp", 400}};
  r1.predicted_bytes = {{"tp", 640}};
  EXPECT_NE(measurement_table({r0, r1}, 2).find("| tp | 2 | 250 | 300 | 260 | 320 |"),
            std::string::npos)
      << measurement_table({r0, r1}, 2);
  EXPECT_NE(table.find("smallest 100.0 MB, mean 200.0 MB, largest 300.0 MB"), std::string::npos);
  // ep's prediction is exact on the mean only (one rank receives what the router sends it): its
  // largest is marked as the balanced expectation, and the JSON says which statistics to check.
  r0.payload_bytes["ep"] = 700;
  r1.payload_bytes["ep"] = 500;
  r0.predicted_bytes["ep"] = 600;
  r1.predicted_bytes["ep"] = 600;
  const auto routed = measurement_json({r0, r1}, 2);
  EXPECT_EQ(routed["per_step_bytes"]["ep"]["exact"], nlohmann::json({"mean"}));
  EXPECT_EQ(routed["per_step_bytes"]["tp"]["exact"], nlohmann::json({"mean", "max"}));
  EXPECT_NE(measurement_table({r0, r1}, 2).find("| ep | 2 | 300 | 350 | 300 | ~300 |"),
            std::string::npos)
      << measurement_table({r0, r1}, 2);
  // The model state per rank, measured and predicted, when every rank knows both.
  EXPECT_FALSE(measurement_json({r0, r1}, 2).contains("state_bytes"));
  r0.state_bytes = 1'000'000;
  r1.state_bytes = 3'000'000;
  r0.predicted_state_bytes = 1'000'000;
  r1.predicted_state_bytes = 3'000'000;
  const auto state = measurement_json({r0, r1}, 2);
  EXPECT_EQ(state["state_bytes"], nlohmann::json({1'000'000, 3'000'000}));
  EXPECT_EQ(state["predicted_state_bytes"], nlohmann::json({1'000'000, 3'000'000}));
  EXPECT_NE(measurement_table({r0, r1}, 2)
                .find("AdamW moments after the last step): smallest 1.000 MB, mean 2.000 MB, "
                      "largest 3.000 MB; predicted"),
            std::string::npos)
      << measurement_table({r0, r1}, 2);
  // The matmul FLOPs per rank, exact on each rank or (ep) on their sum.
  r0.matmul_flops = 1'000'000'000;
  r1.matmul_flops = 3'000'000'000;
  r0.predicted_matmul_flops = 1'000'000'000;
  r1.predicted_matmul_flops = 3'000'000'000;
  EXPECT_EQ(measurement_json({r0, r1}, 2)["matmul_flops_exact"], "each");
  EXPECT_NE(measurement_table({r0, r1}, 2)
                .find("smallest 1.0000, mean 2.0000, largest 3.0000 GFLOP; predicted smallest"),
            std::string::npos)
      << measurement_table({r0, r1}, 2);
  r1.flops_exact_per_rank = false;
  const auto flops = measurement_json({r0, r1}, 2);
  EXPECT_EQ(flops["matmul_flops_exact"], "mean");
  EXPECT_EQ(flops["predicted_matmul_flops"], nlohmann::json({1'000'000'000, 3'000'000'000}));
  // This process's own peak is real and positive.
  EXPECT_GT(measure_rank({}).peak_resident_bytes, 1'000'000);
}

// The pipeline's links: each virtual stage receives unless first and sends unless last, so a
// rank at either end of a plain pipeline touches one boundary, one inside two, and interleaving
// v = 2 over pp 2 gives each rank three. Without pp or cp there are no such links.
