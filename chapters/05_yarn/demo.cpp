// Chapter 05 demo: train a small RoPE model on pass-key retrieval at context L, then evaluate it
// at 2L, 4L and 8L with no scaling, Position Interpolation, NTK-aware base scaling, dynamic NTK
// and YaRN, each as is and after a short fine-tune at the longer length. Prints a table and
// writes an SVG plot.
//
//   ./build/bin/ch05_yarn_demo [--length 64] [--steps 1500] [--finetune 100] [--svg FILE]

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <vector>

#include "03_transformer/train.h"
#include "05_yarn/passkey.h"
#include "05_yarn/yarn.h"
#include "fivefold/cli.h"
#include "fivefold/io.h"
#include "fivefold/progress.h"
#include "fivefold/runtime.h"
#include "fivefold/svg.h"
#include "fivefold/timer.h"

using namespace fivefold;
using ch03::ModelConfig;
using ch03::Transformer;

namespace {

using Weights = std::map<std::string, torch::Tensor>;

void train(Transformer& model, int64_t length, int64_t steps, double lr, uint64_t stream,
           const std::string& label) {
  ch03::TrainConfig t;
  t.lr = lr;
  t.min_lr = lr / 10;
  t.warmup_steps = std::max<int64_t>(1, steps / 20);
  t.total_steps = steps;
  auto optimizer = ch03::make_optimizer(model, t);
  // About 2048 tokens a step whatever the length.
  const int64_t rows = std::max<int64_t>(1, 2048 / length);
  ProgressBar bar(steps, label);
  for (int64_t step = 0; step < steps; ++step) {
    const auto batch = ch05::passkey_batch(stream, step, rows, length);
    const auto r = ch03::train_step(model, *optimizer, t, {batch}, step);
    char status[48];
    std::snprintf(status, sizeof(status), "loss %.3f", r.loss);
    bar.update(step + 1, status);
  }
  bar.finish();
}

Weights copy_of(Transformer& model) {
  Weights w;
  for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().clone();
  return w;
}

void load(Transformer& model, const Weights& w) {
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) p.value().copy_(w.at(p.key()));
}

// One curve of the plot: accuracy at each evaluated length.
struct Curve {
  std::string name, colour;
  bool dashed;
  std::vector<double> accuracy;
};

std::string svg_plot(const std::vector<int64_t>& lengths, const std::vector<Curve>& curves,
                     int64_t trained) {
  svg::LineChart chart;
  chart.title = "Pass-key retrieval accuracy, trained at " + std::to_string(trained) + " tokens";
  chart.x_label = "evaluation length (tokens)";
  chart.y_label = "retrieval accuracy";
  chart.y_min = 0;
  chart.y_max = 1;
  for (size_t i = 0; i < lengths.size(); ++i)
    chart.x_ticks.emplace_back(static_cast<double>(i), std::to_string(lengths[i]));
  for (const Curve& c : curves) {
    svg::Series series{c.name, {}, c.accuracy, c.colour, c.dashed ? "6,4" : ""};
    for (size_t i = 0; i < c.accuracy.size(); ++i) series.x.push_back(static_cast<double>(i));
    chart.series.push_back(series);
  }
  return svg::line_chart(chart);
}

}  // namespace

int main(int argc, char** argv) {
  ArgParser args("ch05_yarn_demo",
                 "Trains a small RoPE model on pass-key retrieval at one length and measures "
                 "how no scaling, PI, NTK-aware, dynamic NTK and YaRN carry it to 2x, 4x and "
                 "8x.");
  args.option("length", "64", "training context L");
  args.option("steps", "1500", "training steps at L");
  args.option("finetune", "100", "fine-tuning steps at each longer length (0: none)");
  args.option("rows", "200", "evaluation rows per length");
  args.option("svg", "runs/ch05/retrieval.svg", "where to write the plot");
  try {
    if (!args.parse(argc, argv)) return 0;
    Runtime runtime;
    Timer timer;
    const int64_t L = args.integer("length"), finetune = args.integer("finetune");
    const int64_t rows = args.integer("rows");
    ModelConfig base;
    base.d_model = 64;
    base.n_layers = 2;
    base.n_heads = base.n_kv_heads = 2;  // head_dim 32: 16 rotated pairs
    base.d_ff = 192;
    base.rope_theta = 10000;
    base.max_position_embeddings = L;
    Transformer model = ch05::make_model(base);
    train(model, L, args.integer("steps"), 3e-3, /*stream=*/1, "train at " + std::to_string(L));
    const Weights trained = copy_of(model);
    const auto at_l = ch05::evaluate_passkey(model, 7, L, rows);
    std::printf("\nat the training length %lld: key perplexity %.2f, retrieval %.3f\n\n",
                static_cast<long long>(L), at_l.perplexity, at_l.accuracy);

    // Each method is a config: the same weights, other frequencies.
    const double d = static_cast<double>(base.resolved_head_dim());
    auto config_for = [&](const std::string& method, double s) {
      ModelConfig c = base;
      if (method == "PI") c.rope_scaling = {{"rope_type", "linear"}, {"factor", s}};
      if (method == "NTK-aware") c.rope_theta = base.rope_theta * std::pow(s, d / (d - 2));
      if (method == "dynamic") c.rope_scaling = {{"rope_type", "dynamic"}, {"factor", s}};
      if (method == "YaRN")
        c.rope_scaling = {
            {"rope_type", "yarn"}, {"factor", s}, {"original_max_position_embeddings", L}};
      return c;
    };
    const std::vector<std::string> methods = {"none", "PI", "NTK-aware", "dynamic", "YaRN"};
    const std::vector<const char*> colours = {"#888888", "#1f77b4", "#2ca02c", "#9467bd",
                                              "#d62728"};
    const std::vector<int64_t> lengths = {L, 2 * L, 4 * L, 8 * L};
    std::vector<Curve> curves;
    std::printf("%-10s %6s  %24s  %24s\n", "method", "length", "as is: ppl / retrieval",
                "fine-tuned: ppl / retrieval");
    for (size_t m = 0; m < methods.size(); ++m) {
      Curve plain{methods[m], colours[m], false, {at_l.accuracy}};
      Curve tuned{methods[m] + " + fine-tune", colours[m], true, {at_l.accuracy}};
      for (size_t i = 1; i < lengths.size(); ++i) {
        const int64_t n = lengths[i];
        const double s = static_cast<double>(n) / static_cast<double>(L);
        Transformer scaled = ch05::make_model(config_for(methods[m], s));
        load(scaled, trained);
        const auto before = ch05::evaluate_passkey(scaled, 7, n, rows);
        ch05::PasskeyReport after{0, 0};
        if (finetune > 0) {
          train(scaled, n, finetune, 1e-3, /*stream=*/100 + n,
                methods[m] + " fine-tune at " + std::to_string(n));
          after = ch05::evaluate_passkey(scaled, 7, n, rows);
        }
        std::printf("%-10s %6lld  %14.2f / %7.3f  %14.2f / %7.3f\n", methods[m].c_str(),
                    static_cast<long long>(n), before.perplexity, before.accuracy, after.perplexity,
                    after.accuracy);
        plain.accuracy.push_back(before.accuracy);
        tuned.accuracy.push_back(after.accuracy);
      }
      curves.push_back(plain);
      if (finetune > 0) curves.push_back(tuned);
    }
    const std::string svg = args.str("svg");
    if (std::filesystem::path(svg).has_parent_path())
      std::filesystem::create_directories(std::filesystem::path(svg).parent_path());
    io::write_file_atomic(svg, svg_plot(lengths, curves, L));
    std::printf(
        "\nkey perplexity: exp(mean loss) on the 4 answer digits (10 = guessing); "
        "retrieval: all 4 right. %.0f s. Plot: %s\n",
        timer.seconds(), svg.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ch05_yarn_demo: error: %s\n", e.what());
    return 1;
  }
}
