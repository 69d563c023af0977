#include "bench/fmoe_bench/plot.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fmoe::bench {
namespace {

// A gnuplot string literal (single quotes: no escapes but '' for a quote).
std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "''";
    else if (c != '\n')
      out += c;
  }
  return out + "'";
}

// The path of `gnuplot` on PATH, or empty.
std::string FindGnuplot() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::filesystem::path p = std::filesystem::path(dir.empty() ? "." : dir) / "gnuplot";
    std::error_code ec;
    if (std::filesystem::is_regular_file(p, ec)) return p.string();
  }
  return {};
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

Status Render(const std::string& png, const std::string& script) {
  const std::string gp = png + ".gp";
  {
    std::ofstream out(gp);
    out << script;
    if (!out) return IoError(gp + ": cannot write");
  }
  const std::string gnuplot = FindGnuplot();
  if (gnuplot.empty()) {
    return NotFound("gnuplot is not installed (apt-get install gnuplot-nox); the script is " + gp);
  }
  const std::string cmd = ShellQuote(gnuplot) + " " + ShellQuote(gp) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  if (rc != 0) return Internal("gnuplot failed on " + gp + " (status " + std::to_string(rc) + ")");
  return Status::Ok();
}

std::string Header(const std::string& png, const std::string& title, uint32_t rows, uint32_t cols) {
  std::ostringstream s;
  s << "set terminal pngcairo size " << 520 * cols << "," << 400 * rows + 40
    << " noenhanced font ',9'\n"
    << "set output " << Quote(png) << "\n"
    << "set datafile missing 'nan'\n"
    << "set grid\nset key outside right top vertical spacing 0.9 font ',8'\n"
    << "set multiplot layout " << rows << "," << cols << " title " << Quote(title)
    << " font ',11'\n";
  return s.str();
}

}  // namespace

Status WritePlot(const std::string& png, const std::string& title,
                 const std::vector<PlotPanel>& panels, uint32_t rows, uint32_t cols) {
  std::ostringstream s;
  s.precision(8);
  for (size_t p = 0; p < panels.size(); ++p) {
    for (size_t i = 0; i < panels[p].series.size(); ++i) {
      s << "$p" << p << "s" << i << " << EOD\n";
      for (const auto& [x, y] : panels[p].series[i].points) s << x << " " << y << "\n";
      s << "EOD\n";
    }
  }
  s << Header(png, title, rows, cols);
  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    s << "set title " << Quote(panel.title) << "\nset xlabel " << Quote(panel.xlabel)
      << "\nset ylabel " << Quote(panel.ylabel) << "\n"
      << (panel.log_y ? "set logscale y\n" : "unset logscale y\n") << "plot ";
    bool first = true;
    for (size_t i = 0; i < panel.series.size(); ++i) {
      if (panel.series[i].points.empty()) continue;
      s << (first ? "" : ", ") << "$p" << p << "s" << i << " using 1:2 with linespoints title "
        << Quote(panel.series[i].name) << " lw 1.5 pt " << (i % 12) + 1;
      first = false;
    }
    if (first) s << "NaN notitle";
    s << "\n";
  }
  s << "unset multiplot\n";
  return Render(png, s.str());
}

Status WriteBarPlot(const std::string& png, const std::string& title,
                    const std::vector<BarPanel>& panels, uint32_t rows, uint32_t cols) {
  std::ostringstream s;
  s.precision(8);
  for (size_t p = 0; p < panels.size(); ++p) {
    s << "$b" << p << " << EOD\n";
    for (size_t c = 0; c < panels[p].categories.size(); ++c) {
      s << '"' << panels[p].categories[c] << '"';
      for (const auto& [name, values] : panels[p].series) {
        s << " " << (c < values.size() ? values[c] : 0.0);
      }
      s << "\n";
    }
    s << "EOD\n";
  }
  s << Header(png, title, rows, cols)
    << "set style data histograms\nset style histogram clustered gap 1\n"
    << "set style fill solid 0.8 border -1\nset xtics rotate by -30\nset yrange [0:*]\n";
  for (size_t p = 0; p < panels.size(); ++p) {
    const BarPanel& panel = panels[p];
    s << "set title " << Quote(panel.title) << "\nset xlabel ''\nset ylabel " << Quote(panel.ylabel)
      << "\nplot ";
    for (size_t i = 0; i < panel.series.size(); ++i) {
      s << (i ? ", " : "") << "$b" << p << " using " << i + 2 << ":xtic(1) title "
        << Quote(panel.series[i].first);
    }
    if (panel.series.empty()) s << "NaN notitle";
    s << "\n";
  }
  s << "unset multiplot\n";
  return Render(png, s.str());
}

}  // namespace fmoe::bench
