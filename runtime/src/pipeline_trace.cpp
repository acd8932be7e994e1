// The timelines of a pipeline schedule (chapter 11) of a schedule as Chrome trace JSON and as an SVG picture.

#include "runtime/pipeline_trace.h"

#include <algorithm>
#include <limits>

#include "fivefold/consolidate.h"
#include "fivefold/svg.h"
#include "fivefold/trace.h"

namespace fivefold::runtime {

using namespace ch11;

namespace {

const char* colour(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "#4e79a7";         // blue
    case ActionKind::Backward: return "#59a14f";        // green
    case ActionKind::BackwardInput: return "#8cd17d";   // light green
    case ActionKind::BackwardWeight: return "#f28e2b";  // orange
    default: return "#bab0ac";
  }
}

std::pair<double, double> span(const Timelines& timelines) {
  double first = std::numeric_limits<double>::max(), last = 0;
  for (const auto& rank : timelines) {
    for (const auto& a : rank) {
      first = std::min(first, a.start);
      last = std::max(last, a.end);
    }
  }
  return {first == std::numeric_limits<double>::max() ? 0 : first, last};
}

}  // namespace

Timelines simulated_timelines(const Simulation& simulation) {
  Timelines out;
  for (const auto& rank : simulation.timeline) {
    out.emplace_back();
    for (const auto& t : rank) out.back().push_back({t.action, t.start, t.end});
  }
  return out;
}

Timelines gather_timelines(const PipelineExecutor& executor, dist::Communicator& pp) {
  nlohmann::json mine = nlohmann::json::array();
  for (const auto& a : executor.timeline()) {
    mine.push_back({static_cast<int>(a.action.kind), a.action.micro_batch, a.action.stage,
                    executor.started() + a.start, executor.started() + a.end});
  }
  Timelines out;
  for (const auto& rank : all_gather_json(mine, pp)) {
    out.emplace_back();
    for (const auto& e : rank) {
      out.back().push_back({Action{static_cast<ActionKind>(e[0].get<int>()), e[1].get<int64_t>(),
                                   e[2].get<int64_t>()},
                            e[3].get<double>(), e[4].get<double>()});
    }
  }
  const double origin = span(out).first;
  for (auto& rank : out) {
    for (auto& a : rank) {
      a.start -= origin;
      a.end -= origin;
    }
  }
  return out;
}

std::vector<double> idle_shares(const Timelines& timelines) {
  const auto [first, last] = span(timelines);
  std::vector<double> out;
  for (const auto& rank : timelines) {
    double busy = 0;
    for (const auto& a : rank) busy += a.end - a.start;
    out.push_back(last > first ? 1 - busy / (last - first) : 0);
  }
  return out;
}

nlohmann::json chrome_trace(const Timelines& timelines) {
  std::vector<trace::Event> events;
  std::vector<std::pair<int, std::string>> lanes;
  for (size_t r = 0; r < timelines.size(); ++r) {
    lanes.emplace_back(static_cast<int>(r), "rank " + std::to_string(r));
    for (const auto& a : timelines[r]) {
      events.push_back(
          {std::string(action_name(a.action.kind)) + " " + std::to_string(a.action.micro_batch),
           action_name(a.action.kind), static_cast<int>(r), a.start, a.end - a.start,
           {{"micro_batch", a.action.micro_batch}, {"stage", a.action.stage}}});
    }
  }
  return trace::chrome_trace(events, 0, "pipeline", lanes);
}

std::string timeline_svg(const Timelines& timelines, const std::string& title) {
  const auto [first, last] = span(timelines);
  const double width = 900, row = 28, left = 60, top = 30;
  const double scale = last > first ? width / (last - first) : 1;
  const double bottom = top + row * static_cast<double>(timelines.size());
  svg::Document picture(left + width + 10, bottom + 30, 11);
  picture.text(left, 18, title, "font-size=\"13\"");
  for (size_t r = 0; r < timelines.size(); ++r) {  // one row per rank, each action a box
    const double y = top + row * static_cast<double>(r);
    picture.text(4, y + row / 2 + 4, "rank " + std::to_string(r));
    picture.rect(left, y + 2, width, row - 4, "#f4f4f4");
    for (const auto& a : timelines[r]) {
      const double x = left + (a.start - first) * scale, w = (a.end - a.start) * scale;
      picture.rect(x, y + 2, std::max(w, 0.5), row - 4, colour(a.action.kind),
                   "stroke=\"white\" stroke-width=\"0.5\"",
                   std::string(action_name(a.action.kind)) + " micro-batch " +
                       std::to_string(a.action.micro_batch) + ", stage " +
                       std::to_string(a.action.stage));
      if (w > 14)
        picture.text(x + w / 2, y + row / 2 + 4, std::to_string(a.action.micro_batch),
                     "text-anchor=\"middle\" fill=\"white\"");
    }
  }
  double x = left;  // the legend
  for (const auto kind : {ActionKind::Forward, ActionKind::Backward, ActionKind::BackwardInput,
                          ActionKind::BackwardWeight}) {
    picture.rect(x, bottom + 8, 12, 12, colour(kind));
    picture.text(x + 16, bottom + 18, action_name(kind));
    x += 70;
  }
  picture.text(x + 10, bottom + 18, "blank: idle");
  return picture.str();
}

}  // namespace fivefold::runtime
