#pragma once
/// @file svg.h
/// @brief Pictures as SVG text: a document of rectangles, lines, polylines and text, and a line
/// chart (series over a numeric x axis, with axes, ticks and a legend) drawn with it. The training
/// curves of `fivefold compare`, chapter 05's retrieval plot and chapter 11's pipeline timelines
/// are all drawn this one way.

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace fivefold::svg {

/// An SVG picture, its shapes drawn in the order they are added (later ones on top). `extra` is
/// more attributes, as written (`text-anchor="end"`); text content is escaped.
class Document {
 public:
  /// A `width` x `height` picture on white, sans-serif text of `font_size`.
  Document(double width, double height, double font_size = 12);
  /// A rectangle; `tooltip`, if given, shows when the pointer rests on it.
  void rect(double x, double y, double w, double h, const std::string& fill,
            const std::string& extra = "", const std::string& tooltip = "");
  /// A straight line; `dash` is a stroke-dasharray ("6,4"), "" for solid.
  void line(double x1, double y1, double x2, double y2, const std::string& stroke,
            double stroke_width = 1, const std::string& dash = "");
  /// Connected points (x, y).
  void polyline(const std::vector<std::pair<double, double>>& points, const std::string& stroke,
                double stroke_width = 1, const std::string& dash = "");
  /// Text whose baseline starts at (x, y) (or is centred or ends there: `extra`).
  void text(double x, double y, const std::string& content, const std::string& extra = "");
  /// The whole document.
  std::string str() const;

 private:
  double width_, height_, font_size_;
  std::ostringstream body_;
};

/// One line of a chart.
struct Series {
  std::string label;      ///< its name in the legend
  std::vector<double> x;  ///< positions along the x axis
  std::vector<double> y;  ///< values, one per x
  std::string colour;     ///< "" : the chart's palette, by the series' index
  std::string dash;       ///< stroke-dasharray; "" : solid for a series with a colour, else by index
};

/// A line chart: axes, five ticks on each (or those given), grid lines, a legend in the top
/// right corner.
struct LineChart {
  std::string title;            ///< above the plot
  std::string x_label;          ///< under the x axis
  std::string y_label;          ///< beside the y axis, turned
  std::vector<Series> series;   ///< at least one, none empty
  double width = 720;           ///< of the picture
  double height = 420;          ///< of the picture
  double y_min = NAN;           ///< NaN: the data's smallest, less 5% of the range
  double y_max = NAN;           ///< NaN: the data's largest, plus 5% of the range
  /// Where the x ticks go and what they say; empty: five evenly spaced, labelled "%.0f".
  std::vector<std::pair<double, std::string>> x_ticks;
};

/// The chart as an SVG document. Throws fivefold::Error for no series or an empty one.
std::string line_chart(const LineChart& chart);

}  // namespace fivefold::svg
