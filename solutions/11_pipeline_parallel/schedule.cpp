// Chapter 11: the schedules as data, the communication they need, and the unit-cost simulator.

#include "11_pipeline_parallel/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "fivefold/error.h"

namespace fivefold::ch11 {

const char* action_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "F";
    case ActionKind::Backward: return "B+W";
    case ActionKind::BackwardInput: return "B";
    case ActionKind::BackwardWeight: return "W";
    case ActionKind::SendActivation: return "send-act";
    case ActionKind::RecvActivation: return "recv-act";
    case ActionKind::SendGradient: return "send-grad";
    case ActionKind::RecvGradient: return "recv-grad";
  }
  return "?";
}

bool Action::operator==(const Action& other) const {
  return kind == other.kind && micro_batch == other.micro_batch && stage == other.stage;
}

std::ostream& operator<<(std::ostream& out, const Action& action) {
  return out << action_name(action.kind) << action.micro_batch << "@s" << action.stage;
}

const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names{"gpipe", "1f1b", "interleaved", "zb"};
  return names;
}

Schedule gpipe(int64_t ranks, int64_t micro_batches) {
  FIVEFOLD_CHECK(ranks >= 1 && micro_batches >= 1, "gpipe: needs ranks and micro-batches >= 1");
  Schedule s{"gpipe", ranks, 1, micro_batches, {}};
  for (int64_t r = 0; r < ranks; ++r) {
    std::vector<Action> list;
    for (int64_t j = 0; j < micro_batches; ++j) list.push_back({ActionKind::Forward, j, r});
    for (int64_t j = 0; j < micro_batches; ++j) list.push_back({ActionKind::Backward, j, r});
    s.lists.push_back(std::move(list));
  }
  return s;
}

Schedule interleaved(int64_t ranks, int64_t virtual_stages, int64_t micro_batches) {
  const int64_t p = ranks, v = virtual_stages, m = micro_batches;
  check_schedule("interleaved", p, v, m);
  Schedule s{"interleaved", p, v, m, {}};
  // The k-th forward of every rank: micro-batches in groups of p, each group through chunk 0,
  // then chunk 1, ... The k-th backward: the same groups through the chunks in reverse.
  auto nth = [&](int64_t k, int64_t r, bool backward, ActionKind kind) {
    int64_t chunk = (k / p) % v;
    if (backward) chunk = v - 1 - chunk;
    const int64_t j = (k / (p * v)) * p + k % p;
    return Action{kind, j, chunk * p + r};
  };
  const int64_t total = m * v;
  for (int64_t r = 0; r < p; ++r) {
    std::vector<Action> list;
    const int64_t warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int64_t k = 0; k < warmup; ++k) list.push_back(nth(k, r, false, ActionKind::Forward));
    for (int64_t k = 0; k < total - warmup; ++k) {
      list.push_back(nth(warmup + k, r, false, ActionKind::Forward));
      list.push_back(nth(k, r, true, ActionKind::Backward));
    }
    for (int64_t k = total - warmup; k < total; ++k)
      list.push_back(nth(k, r, true, ActionKind::Backward));
    s.lists.push_back(std::move(list));
  }
  return s;
}

Schedule zero_bubble(int64_t ranks, int64_t micro_batches) {
  const int64_t p = ranks, m = micro_batches;
  FIVEFOLD_CHECK(p >= 1 && m >= 1, "zb: needs ranks and micro-batches >= 1");
  Schedule s{"zb", p, 1, m, {}};
  for (int64_t r = 0; r < p; ++r) {
    std::vector<Action> list;
    int64_t weights_done = 0;
    // Rank r puts off up to r weight gradients: its B go out sooner, so the ranks before it
    // get their gradients earlier, and it runs what it put off at the end, where 1F1B leaves it
    // idle (the later a rank, the earlier it finishes its last B).
    auto after_input_gradient = [&](int64_t j) {
      if (j - weights_done >= r) list.push_back({ActionKind::BackwardWeight, weights_done++, r});
    };
    const int64_t warmup = std::min(p - r - 1, m);
    for (int64_t j = 0; j < warmup; ++j) list.push_back({ActionKind::Forward, j, r});
    for (int64_t j = 0; j < m - warmup; ++j) {
      list.push_back({ActionKind::Forward, warmup + j, r});
      list.push_back({ActionKind::BackwardInput, j, r});
      after_input_gradient(j);
    }
    for (int64_t j = m - warmup; j < m; ++j) {
      list.push_back({ActionKind::BackwardInput, j, r});
      after_input_gradient(j);
    }
    while (weights_done < m) list.push_back({ActionKind::BackwardWeight, weights_done++, r});
    s.lists.push_back(std::move(list));
  }
  return s;
}

namespace {

bool is_compute(ActionKind k) {
  return k == ActionKind::Forward || k == ActionKind::Backward || k == ActionKind::BackwardInput ||
         k == ActionKind::BackwardWeight;
}

bool is_input_gradient(ActionKind k) {
  return k == ActionKind::Backward || k == ActionKind::BackwardInput;
}

}  // namespace

Schedule add_communication(Schedule compute) {
  const int64_t last = compute.stages() - 1;
  auto crosses = [&](int64_t from, int64_t to) {
    return compute.rank_of(from) != compute.rank_of(to);
  };
  for (auto& list : compute.lists) {
    std::vector<Action> out;
    auto receives = [&](size_t k) {  // the receive compute k needs, if any
      if (k >= list.size()) return;
      const Action& a = list[k];
      if (a.kind == ActionKind::Forward && a.stage > 0 && crosses(a.stage - 1, a.stage))
        out.push_back({ActionKind::RecvActivation, a.micro_batch, a.stage});
      if (is_input_gradient(a.kind) && a.stage < last && crosses(a.stage + 1, a.stage))
        out.push_back({ActionKind::RecvGradient, a.micro_batch, a.stage});
    };
    receives(0);
    for (size_t k = 0; k < list.size(); ++k) {
      FIVEFOLD_CHECK(is_compute(list[k].kind),
                     "add_communication: the lists must hold compute "
                     "actions only, found ",
                     action_name(list[k].kind));
      receives(k + 1);  // posted now, so that it arrives while compute k runs
      const Action& a = list[k];
      out.push_back(a);
      if (a.kind == ActionKind::Forward && a.stage < last && crosses(a.stage, a.stage + 1))
        out.push_back({ActionKind::SendActivation, a.micro_batch, a.stage});
      if (is_input_gradient(a.kind) && a.stage > 0 && crosses(a.stage, a.stage - 1))
        out.push_back({ActionKind::SendGradient, a.micro_batch, a.stage});
    }
    list = std::move(out);
  }
  return compute;
}

void check_schedule(const std::string& name, int64_t ranks, int64_t virtual_stages,
                    int64_t micro_batches) {
  FIVEFOLD_CHECK(ranks >= 1, "pipeline: needs at least 1 stage, got ", ranks);
  FIVEFOLD_CHECK(micro_batches >= 1, "pipeline: needs at least 1 micro-batch, got ", micro_batches);
  FIVEFOLD_CHECK(virtual_stages >= 1, "--virtual-stages must be at least 1, got ", virtual_stages);
  const auto& names = schedule_names();
  FIVEFOLD_CHECK(std::find(names.begin(), names.end(), name) != names.end(),
                 "unknown pipeline schedule '", name, "' (gpipe, 1f1b, interleaved or zb)");
  FIVEFOLD_CHECK(virtual_stages == 1 || name == "interleaved", "--virtual-stages ", virtual_stages,
                 " needs --schedule interleaved (", name, " runs one stage per rank)");
  FIVEFOLD_CHECK(name != "interleaved" || micro_batches % ranks == 0,
                 "interleaved: the micro-batches (", micro_batches,
                 ") go through each rank's virtual stages in groups of p = ", ranks,
                 ": they must be a multiple of it");
}

Schedule make_schedule(const std::string& name, int64_t ranks, int64_t virtual_stages,
                       int64_t micro_batches) {
  check_schedule(name, ranks, virtual_stages, micro_batches);
  if (name == "gpipe") return add_communication(gpipe(ranks, micro_batches));
  if (name == "1f1b") return add_communication(one_f_one_b(ranks, micro_batches));
  if (name == "interleaved")
    return add_communication(interleaved(ranks, virtual_stages, micro_batches));
  return add_communication(zero_bubble(ranks, micro_batches));  // "zb"
}

double Simulation::bubble() const {
  const double total = static_cast<double>(timeline.size()) * makespan;
  return total > 0 ? (total - busy) / total : 0;
}

namespace {

// What a stage's micro-batch has been through, as the simulator tracks it.
using Key = std::pair<int64_t, int64_t>;  // (stage, micro-batch)

std::string describe(const Action& a) {
  std::ostringstream out;
  out << action_name(a.kind) << " of micro-batch " << a.micro_batch << " at stage " << a.stage;
  return out.str();
}

// "schedule 1f1b (p 3, v 1, m 4)": every message of the checks names the case it is about.
std::string named(const Schedule& s) {
  return "schedule " + s.name + " (p " + std::to_string(s.ranks) + ", v " +
         std::to_string(s.virtual_stages) + ", m " + std::to_string(s.micro_batches) + ")";
}

// Every compute once, on its stage's rank; sends after what they send, receives before what
// needs them; every channel received in the order it is sent.
void check_lists(const Schedule& s) {
  FIVEFOLD_CHECK(static_cast<int64_t>(s.lists.size()) == s.ranks, named(s), ": ", s.lists.size(),
                 " lists for ", s.ranks, " ranks");
  const int64_t last = s.stages() - 1;
  std::map<std::tuple<int, int64_t, int64_t>, int> count;  // (kind, stage, mb) -> times
  // channel (from rank, to rank, activation?) -> the (sending stage, micro-batch) sequence
  std::map<std::tuple<int64_t, int64_t, bool>, std::vector<Key>> sent, received;
  for (int64_t r = 0; r < s.ranks; ++r) {
    std::map<std::tuple<int, int64_t, int64_t>, bool> seen;
    auto done = [&](ActionKind k, int64_t stage, int64_t j) {
      return seen.count({static_cast<int>(k), stage, j}) > 0;
    };
    for (const Action& a : s.lists[static_cast<size_t>(r)]) {
      FIVEFOLD_CHECK(
          a.stage >= 0 && a.stage <= last && a.micro_batch >= 0 && a.micro_batch < s.micro_batches,
          named(s), ": rank ", r, " has ", describe(a), ", outside the pipeline");
      FIVEFOLD_CHECK(s.rank_of(a.stage) == r, named(s), ": rank ", r, " has ", describe(a),
                     ", which rank ", s.rank_of(a.stage), " holds");
      const int64_t j = a.micro_batch;
      switch (a.kind) {
        case ActionKind::SendActivation:
          FIVEFOLD_CHECK(done(ActionKind::Forward, a.stage, j), named(s), ": rank ", r,
                         " sends before computing: ", describe(a));
          sent[{r, s.rank_of(a.stage + 1), true}].push_back({a.stage, j});
          break;
        case ActionKind::SendGradient:
          FIVEFOLD_CHECK(
              done(ActionKind::Backward, a.stage, j) || done(ActionKind::BackwardInput, a.stage, j),
              named(s), ": rank ", r, " sends before computing: ", describe(a));
          sent[{r, s.rank_of(a.stage - 1), false}].push_back({a.stage, j});
          break;
        case ActionKind::RecvActivation:
          received[{s.rank_of(a.stage - 1), r, true}].push_back({a.stage - 1, j});
          break;
        case ActionKind::RecvGradient:
          received[{s.rank_of(a.stage + 1), r, false}].push_back({a.stage + 1, j});
          break;
        default: {
          const bool needs_activation =
              a.kind == ActionKind::Forward && a.stage > 0 && s.rank_of(a.stage - 1) != r;
          const bool needs_gradient =
              is_input_gradient(a.kind) && a.stage < last && s.rank_of(a.stage + 1) != r;
          FIVEFOLD_CHECK(!needs_activation || done(ActionKind::RecvActivation, a.stage, j),
                         named(s), ": rank ", r, " runs ", describe(a),
                         " without receiving its input first");
          FIVEFOLD_CHECK(!needs_gradient || done(ActionKind::RecvGradient, a.stage, j), "schedule ",
                         s.name, ": rank ", r, " runs ", describe(a),
                         " without receiving its output's gradient first");
          ++count[{static_cast<int>(a.kind), a.stage, j}];
        }
      }
      seen[{static_cast<int>(a.kind), a.stage, j}] = true;
    }
  }
  for (int64_t stage = 0; stage <= last; ++stage) {
    for (int64_t j = 0; j < s.micro_batches; ++j) {
      auto times = [&](ActionKind k) {
        const auto found = count.find({static_cast<int>(k), stage, j});
        return found == count.end() ? 0 : found->second;
      };
      const int whole = times(ActionKind::Backward), input = times(ActionKind::BackwardInput),
                weight = times(ActionKind::BackwardWeight);
      FIVEFOLD_CHECK(
          times(ActionKind::Forward) == 1 && ((whole == 1 && input == 0 && weight == 0) ||
                                              (whole == 0 && input == 1 && weight == 1)),
          named(s), ": micro-batch ", j, " at stage ", stage,
          " needs one F and one backward (B+W, or B and W), got ", times(ActionKind::Forward),
          " F, ", whole, " B+W, ", input, " B, ", weight, " W");
    }
  }
  // Each channel's sends and receives, as (sending stage, micro-batch) in list order.
  auto sequence = [](const std::vector<Key>& keys) {
    std::string text;
    for (const auto& [stage, j] : keys)
      text += (text.empty() ? "" : " ") + std::to_string(j) + "@s" + std::to_string(stage);
    return text.empty() ? std::string("nothing") : text;
  };
  auto channels = sent;
  channels.insert(received.begin(), received.end());
  for (const auto& [channel, ignored] : channels) {
    const auto& [from, to, activation] = channel;
    const auto out = sent.count(channel) ? sent.at(channel) : std::vector<Key>{};
    const auto in = received.count(channel) ? received.at(channel) : std::vector<Key>{};
    FIVEFOLD_CHECK(out == in, named(s), ": the ", activation ? "activations" : "gradients",
                   " from rank ", from, " to rank ", to, " are sent as ", sequence(out),
                   " but received as ", sequence(in),
                   " (micro-batch@stage, in list order): the executor would deliver a tensor to "
                   "the wrong micro-batch, or wait for one never sent");
  }
}

}  // namespace

Simulation simulate(const Schedule& s, const UnitCosts& costs) {
  check_lists(s);
  const int64_t last = s.stages() - 1;
  // End time of each compute, and the time each send left its rank.
  std::map<std::tuple<int, int64_t, int64_t>, double> finished, posted;
  auto at = [](const std::map<std::tuple<int, int64_t, int64_t>, double>& m, ActionKind k,
               int64_t stage, int64_t j) -> const double* {
    const auto found = m.find({static_cast<int>(k), stage, j});
    return found == m.end() ? nullptr : &found->second;
  };
  Simulation sim;
  sim.timeline.resize(static_cast<size_t>(s.ranks));
  sim.peak_in_flight.assign(static_cast<size_t>(s.ranks), 0);
  std::vector<size_t> next(static_cast<size_t>(s.ranks), 0);
  std::vector<double> clock(static_cast<size_t>(s.ranks), 0);
  std::vector<int64_t> in_flight(static_cast<size_t>(s.ranks), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < s.ranks; ++r) {
      const auto& list = s.lists[static_cast<size_t>(r)];
      auto& k = next[static_cast<size_t>(r)];
      auto& now = clock[static_cast<size_t>(r)];
      for (; k < list.size(); ++k) {
        const Action& a = list[k];
        const int64_t j = a.micro_batch;
        if (a.kind == ActionKind::RecvActivation || a.kind == ActionKind::RecvGradient)
          continue;  // posting a receive takes no time
        if (a.kind == ActionKind::SendActivation || a.kind == ActionKind::SendGradient) {
          posted[{static_cast<int>(a.kind), a.stage, j}] = now;
          continue;
        }
        // When the inputs of this compute exist (nullptr: not yet).
        std::vector<const double*> needs;
        double cost = costs.forward;
        if (a.kind == ActionKind::Forward) {
          if (a.stage > 0)
            needs.push_back(s.rank_of(a.stage - 1) == r
                                ? at(finished, ActionKind::Forward, a.stage - 1, j)
                                : at(posted, ActionKind::SendActivation, a.stage - 1, j));
        } else if (a.kind == ActionKind::BackwardWeight) {
          needs.push_back(at(finished, ActionKind::BackwardInput, a.stage, j));
          cost = costs.backward_weight;
        } else {
          needs.push_back(at(finished, ActionKind::Forward, a.stage, j));
          if (a.stage < last) {
            const auto* local = at(finished, ActionKind::BackwardInput, a.stage + 1, j);
            if (local == nullptr) local = at(finished, ActionKind::Backward, a.stage + 1, j);
            needs.push_back(s.rank_of(a.stage + 1) == r
                                ? local
                                : at(posted, ActionKind::SendGradient, a.stage + 1, j));
          }
          cost =
              costs.backward_input + (a.kind == ActionKind::Backward ? costs.backward_weight : 0);
        }
        if (std::find(needs.begin(), needs.end(), nullptr) != needs.end()) break;  // waits
        if (!costs.scale.empty()) cost *= costs.scale.at(static_cast<size_t>(a.stage));
        double start = now;
        for (const double* t : needs) start = std::max(start, *t);
        now = start + cost;
        sim.busy += cost;
        // Backward counts as B for those waiting on the input gradient.
        finished[{
            static_cast<int>(a.kind == ActionKind::Backward ? ActionKind::BackwardInput : a.kind),
            a.stage, j}] = now;
        finished[{static_cast<int>(a.kind), a.stage, j}] = now;
        sim.timeline[static_cast<size_t>(r)].push_back({a, start, now});
        auto& held = in_flight[static_cast<size_t>(r)];
        if (a.kind == ActionKind::Forward) ++held;
        if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) --held;
        sim.peak_in_flight[static_cast<size_t>(r)] =
            std::max(sim.peak_in_flight[static_cast<size_t>(r)], held);
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int64_t r = 0; r < s.ranks; ++r) {
    const auto& list = s.lists[static_cast<size_t>(r)];
    if (next[static_cast<size_t>(r)] < list.size())
      stuck << " rank " << r << " waits in " << describe(list[next[static_cast<size_t>(r)]]) << ";";
    sim.makespan = std::max(sim.makespan, clock[static_cast<size_t>(r)]);
  }
  FIVEFOLD_CHECK(stuck.str().empty(), named(s), " deadlocks:", stuck.str());
  return sim;
}

double bubble_formula(const Schedule& s) {
  const auto p = static_cast<double>(s.ranks), m = static_cast<double>(s.micro_batches),
             v = static_cast<double>(s.virtual_stages);
  if (s.name == "interleaved") return (p - 1) / (v * m + p - 1);
  if (s.name == "zb") {
    const double d = std::max(0.0, p - m);  // too few W to fill the cool-down
    return (p - 1 + d) / (3 * m + p - 1 + d);
  }
  return (p - 1) / (m + p - 1);  // GPipe, 1F1B
}

}  // namespace fivefold::ch11
