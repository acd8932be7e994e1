#pragma once
/// @file settings.h
/// @brief A run's settings in one table. Each row gives a setting's command-line flag (which is
/// also its key in a `--config` TOML file and in OUT/settings.toml), its help, its place in a
/// checkpoint's trainer_state.json, and what a resume does with it. `fivefold train` declares
/// and reads its flags from the table, checkpoints save and load the run through it
/// (run_to_json, run_from_json in run.h), and a resume checks and merges through it: a new
/// setting is one new row, not four edits.

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fivefold/cli.h"
#include "runtime/run.h"

namespace fivefold::runtime {

/// What `--resume` does with a setting.
enum class OnResume {
  Fixed,       ///< it changes what the run computes: the run keeps its own, a new value is refused
  Kept,        ///< how the run is carried out (micro-batches, evaluation, checkpoints): a value
               ///< given again applies, otherwise the run's own
  Invocation,  ///< this invocation's (output folder, progress, kernels, how many steps)
};

/// One row of the table.
struct Setting {
  std::string flag;  ///< `--flag` and its settings.toml key; "" for a saved setting with no flag
  /// Where trainer_state.json's "run" object keeps it, dots between levels ("train.lr"); "" when
  /// it is not saved on its own (a model flag: the whole model is saved as "model").
  std::string key;
  OnResume on_resume = OnResume::Fixed;  ///< what --resume does with it
  std::string help;  ///< what --help says of it
  std::function<void(ArgParser&)> declare;                 ///< declares the flag with its help
  std::function<void(const ArgParser&, RunConfig&)> read;  ///< the flag's value into the run
  std::function<std::string(const RunConfig&)> text;       ///< the value as it would be typed
  std::function<nlohmann::json(const RunConfig&)> save;    ///< the value saved under `key`
  std::function<void(const nlohmann::json&, RunConfig&)> load;  ///< and read back
};

/// Every setting of a run, in the order `--help` lists them.
const std::vector<Setting>& run_settings();

/// Declares every setting that has a flag, with the command line's defaults (those of RunConfig,
/// except that the command line trains with rotary positions, rope_theta 10000, into runs/ch03).
void declare_run_flags(ArgParser& args);

/// The run the parsed flags describe. Settings whose default follows another are filled in:
/// --decay-steps is --steps, --n-kv-heads is --n-heads, --exact-match is 100 on the synthetic
/// corpus and 0 with --data, and a warm-up as long as the decay becomes a tenth of it.
RunConfig run_from_flags(const ArgParser& args);

/// The run to continue: `saved`'s settings, except the Invocation ones and the Kept ones given
/// again, which are `requested`'s. A Fixed setting given with another value than the run's is
/// refused, naming each such flag. Everything outside the table (placement, step factory,
/// observers) is `requested`'s.
RunConfig resume_from_flags(const ArgParser& args, const RunConfig& requested,
                            const RunConfig& saved);

/// The same without a command line, as run_training resumes: `saved`'s Fixed settings, the rest
/// `requested`'s.
RunConfig resume_with(const RunConfig& saved, const RunConfig& requested);

}  // namespace fivefold::runtime
