#pragma once
// The subcommands of `fivefold` that live outside fivefold.cpp, one function each.

namespace fivefold::commands {

/// `fivefold plan`: a transformer's parameters, FLOPs, time and each parallelism's terms.
int plan(int argc, char** argv);
/// `fivefold calibrate`: this machine's cluster description for the planner, measured.
int calibrate(int argc, char** argv);
/// `fivefold train`: the chapters' training run, on one process or in any layout (chapter 15).
int train(int argc, char** argv);
/// `fivefold generate`: continue a prompt from a checkpoint.
int generate(int argc, char** argv);
/// `fivefold eval`: loss, perplexity and exact match of a checkpoint, or the logits of a sequence.
int eval(int argc, char** argv);
/// `fivefold tokenize`: a text file into a .bin of token ids with a SentencePiece model.
int tokenize(int argc, char** argv);
/// `fivefold compare`: two runs' training curves side by side (table, SVG).
int compare(int argc, char** argv);

}  // namespace fivefold::commands
