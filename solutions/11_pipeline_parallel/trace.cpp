// Chapter 11: the timelines of a schedule as Chrome trace JSON and as an SVG picture.

#include "11_pipeline_parallel/trace.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "fivefold/consolidate.h"
#include "fivefold/trace.h"

namespace fivefold::ch11 {

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
  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 10 << "\" height=\""
      << top + row * static_cast<double>(timelines.size()) + 30
      << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
      << "<text x=\"" << left << "\" y=\"18\" font-size=\"13\">" << title << "</text>\n";
  for (size_t r = 0; r < timelines.size(); ++r) {
    const double y = top + row * static_cast<double>(r);
    svg << "<text x=\"4\" y=\"" << y + row / 2 + 4 << "\">rank " << r << "</text>\n"
        << "<rect x=\"" << left << "\" y=\"" << y + 2 << "\" width=\"" << width << "\" height=\""
        << row - 4 << "\" fill=\"#f4f4f4\"/>\n";
    for (const auto& a : timelines[r]) {
      const double x = left + (a.start - first) * scale, w = (a.end - a.start) * scale;
      svg << "<rect x=\"" << x << "\" y=\"" << y + 2 << "\" width=\"" << std::max(w, 0.5)
          << "\" height=\"" << row - 4 << "\" fill=\"" << colour(a.action.kind)
          << "\" stroke=\"white\" stroke-width=\"0.5\"><title>" << action_name(a.action.kind)
          << " micro-batch " << a.action.micro_batch << ", stage " << a.action.stage
          << "</title></rect>\n";
      if (w > 14) {
        svg << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row / 2 + 4
            << "\" text-anchor=\"middle\" fill=\"white\">" << a.action.micro_batch << "</text>\n";
      }
    }
  }
  const double y = top + row * static_cast<double>(timelines.size()) + 18;
  double x = left;
  for (const auto kind : {ActionKind::Forward, ActionKind::Backward, ActionKind::BackwardInput,
                          ActionKind::BackwardWeight}) {
    svg << "<rect x=\"" << x << "\" y=\"" << y - 10 << "\" width=\"12\" height=\"12\" fill=\""
        << colour(kind) << "\"/><text x=\"" << x + 16 << "\" y=\"" << y << "\">"
        << action_name(kind) << "</text>\n";
    x += 70;
  }
  svg << "<text x=\"" << x + 10 << "\" y=\"" << y << "\">blank: idle</text>\n</svg>\n";
  return svg.str();
}

}  // namespace fivefold::ch11
