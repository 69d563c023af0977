// Line plots as PNG through gnuplot (an external program: `apt-get install gnuplot-nox`). The
// script is written next to the image (PNG path + ".gp") with the data inline, so a plot can be
// redrawn or restyled by hand.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fmoe::bench {

struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in this order.
};

struct PlotPanel {
  std::string title;
  std::string xlabel;
  std::string ylabel;
  bool log_y = false;
  std::vector<PlotSeries> series;
};

// Lines and points, one panel per plot in a rows x cols grid. kNotFound when gnuplot is not on
// PATH (the script is still written), kIoError when the script cannot be written, kInternal
// when gnuplot fails.
Status WritePlot(const std::string& png, const std::string& title,
                 const std::vector<PlotPanel>& panels, uint32_t rows, uint32_t cols);

// Bars: one group per category, one bar per series (y values in category order).
struct BarPanel {
  std::string title;
  std::string ylabel;
  std::vector<std::string> categories;
  std::vector<std::pair<std::string, std::vector<double>>> series;
};
Status WriteBarPlot(const std::string& png, const std::string& title,
                    const std::vector<BarPanel>& panels, uint32_t rows, uint32_t cols);

}  // namespace fmoe::bench
