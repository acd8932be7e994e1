#pragma once
// The subcommands of `fivefold` that live outside fivefold.cpp, one function each.

namespace fivefold::commands {

/// `fivefold train`: chapter 03's single-process training run.
int train(int argc, char** argv);
/// `fivefold generate`: continue a prompt from a checkpoint.
int generate(int argc, char** argv);
/// `fivefold eval`: loss, perplexity and exact match of a checkpoint, or the logits of a sequence.
int eval(int argc, char** argv);

}  // namespace fivefold::commands
