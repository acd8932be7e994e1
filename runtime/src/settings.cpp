// The run's settings: their checks, and trainer_state.json's "run" object both ways.

#include <nlohmann/json.hpp>

#include "03_transformer/checkpoint.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "runtime/run.h"

namespace fivefold::runtime {

using namespace fivefold::ch03;

void RunConfig::validate() const {
  model.validate();
  train.validate();
  FIVEFOLD_CHECK(seq_len >= 1 && batch >= 1 && steps >= 1,
                 "run config: seq_len, batch and steps must be >= 1");
  const int64_t slices = placement.data_ranks * micro_batches;
  FIVEFOLD_CHECK(micro_batches >= 1 && placement.data_ranks >= 1 && batch % slices == 0,
                 "run config: the batch (", batch, " rows) must split into ", placement.data_ranks,
                 " data-parallel ranks x ", micro_batches, " micro-batches of equal rows");
  FIVEFOLD_CHECK(placement.data_rank >= 0 && placement.data_rank < placement.data_ranks &&
                     placement.processes >= placement.data_ranks,
                 "run config: inconsistent placement");
  FIVEFOLD_CHECK(save_every >= 0 && eval_every >= 0 && eval_batches >= 1 &&
                     exact_match_examples >= 0 && keep_checkpoints >= 1 && peak_gflops >= 0,
                 "run config: save_every, eval_every, exact_match_examples >= 0; eval_batches, "
                 "keep_checkpoints >= 1");
  FIVEFOLD_CHECK(data.val_fraction > 0 && data.val_fraction < 1 && data.synthetic_examples >= 10,
                 "run config: val_fraction must be in (0, 1), synthetic_examples >= 10");
  FIVEFOLD_CHECK(exact_match_examples == 0 || data.path.empty(),
                 "run config: exact-match evaluation needs the synthetic corpus (no --data)");
}

nlohmann::json run_to_json(const RunConfig& c) {
  const TrainConfig& t = c.train;
  return {{"model", config_to_json(c.model)},
          {"train",
           {{"lr", t.lr},
            {"min_lr", t.min_lr},
            {"warmup_steps", t.warmup_steps},
            {"total_steps", t.total_steps},
            {"weight_decay", t.weight_decay},
            {"beta1", t.beta1},
            {"beta2", t.beta2},
            {"eps", t.eps},
            {"grad_clip", t.grad_clip},
            {"decay_embeddings", t.decay_embeddings}}},
          {"data",
           {{"path", c.data.path},
            {"seed", c.data.seed},
            {"synthetic_examples", c.data.synthetic_examples},
            {"val_fraction", c.data.val_fraction}}},
          {"seq_len", c.seq_len},
          {"batch", c.batch},
          {"micro_batches", c.micro_batches},
          {"steps", c.steps},
          {"save_every", c.save_every},
          {"keep_checkpoints", c.keep_checkpoints},
          {"eval_every", c.eval_every},
          {"eval_batches", c.eval_batches},
          {"exact_match_examples", c.exact_match_examples}};
}

RunConfig run_from_json(const nlohmann::json& j) {
  RunConfig c;
  auto get = [](const nlohmann::json& object, const char* key, auto& field) {
    if (object.contains(key)) field = object[key].get<std::decay_t<decltype(field)>>();
  };
  if (j.contains("model")) c.model = config_from_json(j["model"]);
  if (j.contains("train")) {
    const auto& t = j["train"];
    get(t, "lr", c.train.lr);
    get(t, "min_lr", c.train.min_lr);
    get(t, "warmup_steps", c.train.warmup_steps);
    get(t, "total_steps", c.train.total_steps);
    get(t, "weight_decay", c.train.weight_decay);
    get(t, "beta1", c.train.beta1);
    get(t, "beta2", c.train.beta2);
    get(t, "eps", c.train.eps);
    get(t, "grad_clip", c.train.grad_clip);
    get(t, "decay_embeddings", c.train.decay_embeddings);
  }
  if (j.contains("data")) {
    const auto& d = j["data"];
    get(d, "path", c.data.path);
    get(d, "seed", c.data.seed);
    get(d, "synthetic_examples", c.data.synthetic_examples);
    get(d, "val_fraction", c.data.val_fraction);
  }
  get(j, "seq_len", c.seq_len);
  get(j, "batch", c.batch);
  get(j, "micro_batches", c.micro_batches);
  get(j, "steps", c.steps);
  get(j, "save_every", c.save_every);
  get(j, "keep_checkpoints", c.keep_checkpoints);
  get(j, "eval_every", c.eval_every);
  get(j, "eval_batches", c.eval_batches);
  get(j, "exact_match_examples", c.exact_match_examples);
  return c;
}

RunState load_run_state(const std::string& checkpoint) {
  const std::string path = checkpoint + "/trainer_state.json";
  const auto state = io::read_json(path);
  FIVEFOLD_CHECK(state.is_object() && state.contains("step") && state["step"].is_number_integer() &&
                     state.contains("run") && state["run"].is_object(),
                 "'", path,
                 "' is not a training state: it needs an integer 'step' and a 'run' "
                 "object");
  try {
    return {state["step"].get<int64_t>(), run_from_json(state["run"])};
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "': a setting in 'run' has the wrong type (" + e.what() + ")");
  }
}

}  // namespace fivefold::runtime
