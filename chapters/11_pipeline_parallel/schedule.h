#pragma once
/// @file schedule.h
/// @brief Chapter 11: a pipeline schedule is data. For each of the p ranks, the ordered list of
/// what it does: forward, backward (or its two halves, the input gradient B and the weight
/// gradient W), send and receive, each for micro-batch j of virtual stage s. The schedules
/// (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) are functions that build such lists; one
/// executor (pipeline.h) runs any list on the real model, and the simulator here runs the same
/// lists with unit costs, which gives each schedule's timeline and bubble exactly, whatever the
/// machine.
///
/// Stages: with v virtual stages per rank, the model's layers are cut into S = p·v consecutive
/// virtual stages; virtual stage s lives on rank s % p (rank r holds stages r, r + p, r + 2p, ...,
/// Megatron-LM's interleaving). The first virtual stage also embeds the tokens, the last one also
/// applies the final norm, the head and the loss.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace fivefold::ch11 {

/// What one entry of a rank's list does.
enum class ActionKind {
  Forward,         ///< F: the stage's forward pass on the micro-batch
  Backward,        ///< B+W: the whole backward pass (1F1B, GPipe, interleaved)
  BackwardInput,   ///< B: the gradient of the stage's input only (what the stage before waits for)
  BackwardWeight,  ///< W: the gradient of the stage's weights (can wait: it fills bubbles)
  SendActivation,  ///< send the stage's output to the next stage
  RecvActivation,  ///< post the receive of the stage's input from the previous stage
  SendGradient,    ///< send the gradient of the stage's input to the previous stage
  RecvGradient,    ///< post the receive of the gradient of the stage's output from the next stage
};

/// "F", "B+W", "B", "W", "send-act", "recv-act", "send-grad", "recv-grad".
const char* action_name(ActionKind kind);

/// One entry: `kind` for micro-batch `micro_batch` of virtual stage `stage`.
struct Action {
  ActionKind kind;      ///< what to do
  int64_t micro_batch;  ///< which micro-batch, 0 .. m-1
  int64_t stage;        ///< which virtual stage, 0 .. p·v-1 (on rank stage % p)
  /// Equal kind, micro-batch and stage.
  bool operator==(const Action& other) const;
};

/// "F3@s1": the kind (action_name), micro-batch and virtual stage, as a failing test prints it.
std::ostream& operator<<(std::ostream& out, const Action& action);

/// The whole schedule: the shape of the pipeline and each rank's ordered list.
struct Schedule {
  std::string name;                        ///< "gpipe", "1f1b", "interleaved" or "zb"
  int64_t ranks = 1;                       ///< p, pipeline ranks
  int64_t virtual_stages = 1;              ///< v, virtual stages per rank
  int64_t micro_batches = 1;               ///< m
  std::vector<std::vector<Action>> lists;  ///< lists[r]: rank r's actions, in order
  /// p·v, the virtual stages.
  int64_t stages() const { return ranks * virtual_stages; }
  /// The rank that runs virtual stage `stage`.
  int64_t rank_of(int64_t stage) const { return stage % ranks; }
};

/// The schedules by name, as `fivefold train --schedule` spells them.
const std::vector<std::string>& schedule_names();

/// GPipe: every forward, then every backward (m micro-batches of activations held at once).
Schedule gpipe(int64_t ranks, int64_t micro_batches);

/// 1F1B (PipeDream-Flush): each rank runs a warm-up of forwards that fills the pipeline, then
/// alternates one forward and one backward (steady state), then runs the backwards left
/// (cool-down). **Exercise** (README, "The exercise"; how long each rank's warm-up is, is the
/// question). Return name "1f1b", ranks p, virtual_stages 1, micro_batches m, and lists[r] for
/// each rank r (its stage is r): Forward and Backward actions only, one of each for every
/// micro-batch 0 .. m−1, each kind in micro-batch order; add_communication adds the sends and
/// receives. The tests check the lists' shape, run them through simulate() (a deadlock or an idle
/// slot too many is reported there) and compare the bubble and the activations in flight with
/// the README's table.
Schedule one_f_one_b(int64_t ranks, int64_t micro_batches);

/// Interleaved 1F1B (Narayanan et al. 2021) with v virtual stages per rank: micro-batches go
/// through the rank's chunks in groups of p; warm-up (p − r − 1)·2 + (v − 1)·p forwards. Needs m a
/// multiple of p (the groups). Bubble (p − 1)/(v·m + p − 1) of the time.
Schedule interleaved(int64_t ranks, int64_t virtual_stages, int64_t micro_batches);

/// Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B's order of forwards and input gradients B, with the
/// weight gradients W put off, rank r keeping up to r of them pending: its B reach the ranks
/// before it sooner, and the W left over fill the cool-down, where 1F1B idles. At most p
/// micro-batches in flight, those past B holding only what W needs; with F = B = W the idle time
/// per rank falls from 3(p − 1) to p − 1 units once m >= p.
Schedule zero_bubble(int64_t ranks, int64_t micro_batches);

/// `lists` of compute actions (Forward, Backward, BackwardInput, BackwardWeight) with the
/// communication added: the receive of a compute's input posted just before the compute before
/// it (so the transfer overlaps that compute), each send right after the compute that produced
/// it. Nothing is exchanged between two stages on the same rank.
Schedule add_communication(Schedule compute);

/// Throws fivefold::Error, naming the reason, for a schedule that cannot run: an unknown name, p,
/// v or m below 1, v > 1 with a schedule other than interleaved, or m not a multiple of p for
/// interleaved. Builds nothing (a layout search checks thousands).
void check_schedule(const std::string& name, int64_t ranks, int64_t virtual_stages,
                    int64_t micro_batches);

/// The schedule called `name` (schedule_names) for p ranks, v virtual stages and m micro-batches,
/// with communication, after check_schedule.
Schedule make_schedule(const std::string& name, int64_t ranks, int64_t virtual_stages,
                       int64_t micro_batches);

/// One action as the simulator ran it.
struct TimedAction {
  Action action;  ///< what
  double start;   ///< when it started (units)
  double end;     ///< when it ended
};

/// Unit costs of the compute actions (communication costs nothing in the simulator).
struct UnitCosts {
  double forward = 1;          ///< F
  double backward_input = 1;   ///< B
  double backward_weight = 1;  ///< W; the whole backward costs B + W
  /// Stages of unequal work (chapter 15's planner: the last stage also runs the head): virtual
  /// stage s costs scale[s] times the three above. Empty: every stage the same.
  std::vector<double> scale;
};

/// What the simulator found.
struct Simulation {
  std::vector<std::vector<TimedAction>> timeline;  ///< per rank, compute actions in order
  double makespan = 0;                             ///< when the last action ends
  double busy = 0;                                 ///< compute time, summed over ranks
  /// Idle share of p × makespan: (p·makespan − busy) / (p·makespan).
  double bubble() const;
  /// Per rank, the most micro-batches (of one virtual stage each) whose activations were held at
  /// once: forwards done minus weight gradients (or whole backwards) done.
  std::vector<int64_t> peak_in_flight;
};

/// Runs `schedule` with `costs`: each rank runs its list in order; a compute starts when its rank
/// is free and its inputs exist (the previous stage's forward of the micro-batch; for a backward,
/// the next stage's input gradient, or for the last stage its own forward). Checks the schedule
/// on the way: every (stage, micro-batch) gets exactly one F and one backward, each on the rank of
/// its stage; each send has its receive, and every channel (one per pair of neighbouring ranks and
/// direction) is received in the order it is sent. Throws fivefold::Error naming the first
/// problem, or the actions left waiting when the lists cannot finish (a deadlock).
Simulation simulate(const Schedule& schedule, const UnitCosts& costs = {});

/// The formula for `schedule`'s bubble with unit costs F = B = W = 1, as notes/11 derives it:
/// GPipe and 1F1B (p − 1)/(m + p − 1); interleaved (p − 1)/(v·m + p − 1); ZB-H1 with
/// d = max(0, p − m): (p − 1 + d)/(3m + p − 1 + d).
double bubble_formula(const Schedule& schedule);

}  // namespace fivefold::ch11
