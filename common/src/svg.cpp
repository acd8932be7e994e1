// SVG pictures: a document of shapes and a line chart drawn with it.

#include "fivefold/svg.h"

#include <algorithm>
#include <cstdio>
#include <limits>

#include "fivefold/error.h"

namespace fivefold::svg {

namespace {

std::string escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

std::string number(double value, const char* format) {
  char text[32];
  std::snprintf(text, sizeof(text), format, value);
  return text;
}

std::string dash_attribute(const std::string& dash) {
  return dash.empty() ? "" : " stroke-dasharray=\"" + dash + "\"";
}

}  // namespace

Document::Document(double width, double height, double font_size)
    : width_(width), height_(height), font_size_(font_size) {
  body_ << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
}

void Document::rect(double x, double y, double w, double h, const std::string& fill,
                    const std::string& extra, const std::string& tooltip) {
  body_ << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h
        << "\" fill=\"" << fill << "\"" << (extra.empty() ? "" : " " + extra);
  if (tooltip.empty()) {
    body_ << "/>\n";
  } else {
    body_ << "><title>" << escaped(tooltip) << "</title></rect>\n";
  }
}

void Document::line(double x1, double y1, double x2, double y2, const std::string& stroke,
                    double stroke_width, const std::string& dash) {
  body_ << "<line x1=\"" << x1 << "\" y1=\"" << y1 << "\" x2=\"" << x2 << "\" y2=\"" << y2
        << "\" stroke=\"" << stroke << "\" stroke-width=\"" << stroke_width << "\""
        << dash_attribute(dash) << "/>\n";
}

void Document::polyline(const std::vector<std::pair<double, double>>& points,
                        const std::string& stroke, double stroke_width, const std::string& dash) {
  body_ << "<polyline fill=\"none\" stroke=\"" << stroke << "\" stroke-width=\"" << stroke_width
        << "\"" << dash_attribute(dash) << " points=\"";
  for (const auto& [x, y] : points) body_ << number(x, "%.1f") << "," << number(y, "%.1f") << " ";
  body_ << "\"/>\n";
}

void Document::text(double x, double y, const std::string& content, const std::string& extra) {
  body_ << "<text x=\"" << x << "\" y=\"" << y << "\"" << (extra.empty() ? "" : " " + extra)
        << ">" << escaped(content) << "</text>\n";
}

std::string Document::str() const {
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width_ << "\" height=\""
      << height_ << "\" font-family=\"sans-serif\" font-size=\"" << font_size_ << "\">\n"
      << body_.str() << "</svg>\n";
  return out.str();
}

std::string line_chart(const LineChart& chart) {
  FIVEFOLD_CHECK(!chart.series.empty(), "line_chart: no series");
  const double left = 70, right = 20, top = 40, bottom = 50;
  const double width = chart.width, height = chart.height;
  double x0 = std::numeric_limits<double>::max(), x1 = std::numeric_limits<double>::lowest();
  double y0 = x0, y1 = x1;
  for (const Series& s : chart.series) {
    FIVEFOLD_CHECK(!s.x.empty() && s.x.size() == s.y.size(), "line_chart: series '", s.label,
                   "' is empty or has ", s.x.size(), " x for ", s.y.size(), " y");
    x0 = std::min(x0, *std::min_element(s.x.begin(), s.x.end()));
    x1 = std::max(x1, *std::max_element(s.x.begin(), s.x.end()));
    y0 = std::min(y0, *std::min_element(s.y.begin(), s.y.end()));
    y1 = std::max(y1, *std::max_element(s.y.begin(), s.y.end()));
  }
  if (x1 <= x0) x1 = x0 + 1;
  if (y1 <= y0) y1 = y0 + 1;
  const double pad = 0.05 * (y1 - y0);
  y0 = std::isnan(chart.y_min) ? y0 - pad : chart.y_min;
  y1 = std::isnan(chart.y_max) ? y1 + pad : chart.y_max;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * (width - left - right); };
  auto py = [&](double y) { return top + (y1 - y) / (y1 - y0) * (height - top - bottom); };

  Document svg(width, height);
  svg.text(width / 2, 22, chart.title, "text-anchor=\"middle\" font-size=\"14\"");
  auto x_ticks = chart.x_ticks;
  if (x_ticks.empty())
    for (int t = 0; t <= 4; ++t) {
      const double x = x0 + (x1 - x0) * t / 4;
      x_ticks.emplace_back(x, number(x, "%.0f"));
    }
  for (const auto& [x, label] : x_ticks)
    svg.text(px(x), height - bottom + 18, label, "text-anchor=\"middle\"");
  for (int t = 0; t <= 4; ++t) {
    const double y = y0 + (y1 - y0) * t / 4;
    svg.line(left, py(y), width - right, py(y), "#ddd");
    svg.text(left - 8, py(y) + 4, number(y, "%.3g"), "text-anchor=\"end\"");
  }
  svg.line(left, top, left, height - bottom, "#444");
  svg.line(left, height - bottom, width - right, height - bottom, "#444");
  svg.text((left + width - right) / 2, height - 12, chart.x_label, "text-anchor=\"middle\"");
  const double middle = (top + height - bottom) / 2;
  svg.text(16, middle, chart.y_label,
           "transform=\"rotate(-90 16 " + number(middle, "%g") + ")\" text-anchor=\"middle\"");
  const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"};
  const char* dashes[] = {"", "6,4", "2,3", "8,3,2,3", "1,2"};
  for (size_t k = 0; k < chart.series.size(); ++k) {
    const Series& s = chart.series[k];
    const std::string colour = s.colour.empty() ? colours[k % 5] : s.colour;
    const std::string dash = s.dash.empty() && s.colour.empty() ? dashes[k % 5] : s.dash;
    std::vector<std::pair<double, double>> points;
    for (size_t i = 0; i < s.x.size(); ++i) points.emplace_back(px(s.x[i]), py(s.y[i]));
    svg.polyline(points, colour, 1.8, dash);
    const double ly = top + 16 + 18 * static_cast<double>(k);
    svg.line(width - right - 260, ly, width - right - 230, ly, colour, 2, dash);
    svg.text(width - right - 224, ly + 4, s.label);
  }
  return svg.str();
}

}  // namespace fivefold::svg
