#include "bench/fmoe_bench/serve_report.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench/fmoe_bench/format.h"

namespace fmoe::bench {
namespace {

namespace fs = std::filesystem;

double Ms(BenchClock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// A CSV field: quoted when it holds a comma, quote or line break.
std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c == '\n' || c == '\r' ? ' ' : c;
  }
  return out + "\"";
}

// A single-quoted gnuplot string.
std::string GnuplotString(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += '\'';
    out += c;
  }
  return out + "'";
}

std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (dir.empty()) continue;
    const std::string candidate = dir + "/" + name;
    struct stat st {};
    if (stat(candidate.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return "";
}

// Runs argv with output appended to log_path; its exit code, -1 on a failure to run or a
// timeout (then it is killed).
int RunTool(std::vector<std::string> args, const std::string& log_path, int timeout_s) {
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return -1;
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    return -1;
  }
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(log_fd);
  for (int i = 0; i < timeout_s * 20; ++i) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

}  // namespace

RunSummary Summarize(const std::vector<BenchRequest>& requests,
                     const std::vector<StreamResult>& results) {
  RunSummary s;
  std::vector<double> ttft, tpot;
  BenchClock::time_point first{}, last{};
  bool any = false;
  for (size_t i = 0; i < requests.size() && i < results.size(); ++i) {
    if (requests[i].warmup) continue;
    const StreamResult& r = results[i];
    ++s.requests;
    if (!any || r.sent < first) first = r.sent;
    if (!any || r.done > last) last = r.done;
    any = true;
    if (!r.ok) {
      ++s.errors;
      if (s.first_error.empty()) {
        s.first_error = "request " + std::to_string(requests[i].index) + ": " + r.error;
      }
      continue;
    }
    ++s.ok;
    s.prompt_tokens += r.prompt_tokens;
    s.cached_tokens += r.cached_tokens;
    s.output_tokens += r.completion_tokens;
    s.requested_tokens += requests[i].max_tokens;
    if (r.completion_tokens < requests[i].max_tokens) ++s.short_requests;
    if (r.completion_tokens > 0 && r.expert_hits + r.expert_misses == 0) {
      ++s.requests_without_figures;
    }
    s.expert_hits += r.expert_hits;
    s.expert_misses += r.expert_misses;
    s.bytes_moved += r.bytes_moved;
    if (r.content_events > 0) ttft.push_back(Ms(r.first_content - r.sent));
    // Every token after the first, up to the one that finished the answer (a stop token
    // included: it counts in completion_tokens but brings no text).
    if (r.content_events > 0 && r.completion_tokens >= 2) {
      const auto end = std::max(r.last_content, r.finished);
      tpot.push_back(Ms(end - r.first_content) / static_cast<double>(r.completion_tokens - 1));
    }
  }
  s.ttft_samples = static_cast<int>(ttft.size());
  s.tpot_samples = static_cast<int>(tpot.size());
  const double pct[3] = {50, 90, 99};
  for (int k = 0; k < 3; ++k) {
    s.ttft_ms[k] = Percentile(ttft, pct[k]);
    s.tpot_ms[k] = Percentile(tpot, pct[k]);
  }
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  s.ttft_mean_ms = mean(ttft);
  s.tpot_mean_ms = mean(tpot);
  s.duration_s = any ? std::chrono::duration<double>(last - first).count() : 0;
  if (s.duration_s > 0) {
    s.tokens_per_s = static_cast<double>(s.output_tokens) / s.duration_s;
    s.requests_per_s = static_cast<double>(s.ok) / s.duration_s;
  }
  const uint64_t lookups = s.expert_hits + s.expert_misses;
  s.hit_rate = lookups > 0 ? static_cast<double>(s.expert_hits) / static_cast<double>(lookups) : -1;
  return s;
}

Status WriteRequestsCsv(const std::string& path, const std::vector<BenchRequest>& requests,
                        const std::vector<StreamResult>& results, BenchClock::time_point start) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return IoError(path + ": cannot write");
  out << "index,warmup,trace_row,arrival_s,sent_s,prompt_line,prompt_tokens,max_tokens,"
         "http_status,ok,completion_tokens,finish_reason,ttft_ms,tpot_ms,latency_ms,expert_hits,"
         "expert_misses,bytes_moved,error\n";
  for (size_t i = 0; i < requests.size() && i < results.size(); ++i) {
    const BenchRequest& q = requests[i];
    const StreamResult& r = results[i];
    const bool timed = r.ok && r.content_events > 0;
    out << q.index << ',' << (q.warmup ? 1 : 0) << ',' << q.trace_row << ','
        << Fixed(q.arrival_s, 4) << ',' << Fixed(Ms(r.sent - start) / 1000.0, 4) << ','
        << q.prompt_line << ',' << q.prompt_tokens << ',' << q.max_tokens << ',' << r.http_status
        << ',' << (r.ok ? 1 : 0) << ',' << r.completion_tokens << ',' << r.finish_reason << ','
        << (timed ? Fixed(Ms(r.first_content - r.sent), 3) : "") << ','
        << (timed && r.completion_tokens >= 2
                ? Fixed(Ms(r.last_content - r.first_content) /
                            static_cast<double>(r.completion_tokens - 1),
                        3)
                : "")
        << ',' << Fixed(Ms(r.done - r.sent), 3) << ',' << r.expert_hits << ',' << r.expert_misses
        << ',' << r.bytes_moved << ',' << CsvField(r.error) << '\n';
  }
  if (!out) return IoError(path + ": write failed");
  return Status::Ok();
}

std::string FormatTable(const std::vector<RunSummary>& runs) {
  const std::vector<std::string> header = {"run",     "policy",  "budget",  "status",   "sent",
                                           "ok",      "err",     "out tok", "TTFT50",   "TTFT90",
                                           "TTFT99",  "TTFTavg", "TPOT50",  "TPOT90",   "TPOT99",
                                           "TPOTavg", "tok/s",   "req/s",   "hit rate", "MB moved"};
  std::vector<std::vector<std::string>> rows;
  for (const RunSummary& r : runs) {
    std::vector<std::string> row = {r.name,
                                    r.policy,
                                    Fixed(r.budget, 2),
                                    r.failed ? "FAILED" : "ok",
                                    std::to_string(r.requests),
                                    std::to_string(r.ok),
                                    std::to_string(r.errors)};
    if (r.failed || r.ok == 0) {
      row.resize(header.size(), "-");
    } else {
      row.push_back(std::to_string(r.output_tokens));
      for (double v : r.ttft_ms) row.push_back(r.ttft_samples > 0 ? Fixed(v, 1) : "-");
      row.push_back(r.ttft_samples > 0 ? Fixed(r.ttft_mean_ms, 1) : "-");
      for (double v : r.tpot_ms) row.push_back(r.tpot_samples > 0 ? Fixed(v, 1) : "-");
      row.push_back(r.tpot_samples > 0 ? Fixed(r.tpot_mean_ms, 1) : "-");
      row.push_back(Fixed(r.tokens_per_s, 1));
      row.push_back(Fixed(r.requests_per_s, 2));
      row.push_back(r.hit_rate < 0 ? "-" : Fixed(r.hit_rate, 3));
      row.push_back(Fixed(static_cast<double>(r.bytes_moved) / 1e6, 1));
    }
    rows.push_back(std::move(row));
  }
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  auto line = [&](const std::vector<std::string>& cells) {
    std::string out;
    for (size_t c = 0; c < cells.size(); ++c) {
      const std::string pad(width[c] - cells[c].size(), ' ');
      out += c < 2 ? cells[c] + pad : pad + cells[c];  // Names left, numbers right.
      out += c + 1 < cells.size() ? "  " : "\n";
    }
    return out;
  };
  std::string out = line(header);
  std::string rule;
  for (size_t c = 0; c < header.size(); ++c) rule += std::string(width[c], '-') + "  ";
  out += rule.substr(0, rule.size() - 2) + "\n";
  for (const auto& row : rows) out += line(row);
  out +=
      "TTFT/TPOT in ms (p50/p90/p99 and mean of the successful requests); tok/s and req/s over the "
      "measured window; hit rate from usage.fmoe_experts.\n";
  for (const RunSummary& r : runs) {
    if (!r.failed && r.cached_tokens > 0) {
      out += r.name + ": " + std::to_string(r.cached_tokens) + " of " +
             std::to_string(r.prompt_tokens) + " prompt tokens from the prefix cache (" +
             Fixed(100.0 * static_cast<double>(r.cached_tokens) /
                       static_cast<double>(std::max<int64_t>(r.prompt_tokens, 1)),
                   1) +
             "%)\n";
    }
    if (!r.failed && r.preemptions > 0) {
      out += r.name + ": " + std::to_string(r.preemptions) +
             " preemption(s) (the KV pool was full; the requests were recomputed)\n";
    }
    if (r.failed) out += r.name + ": FAILED: " + r.failure + "\n";
    if (!r.failed && !r.failure.empty()) out += r.name + ": note: " + r.failure + "\n";
    if (r.errors > 0)
      out += r.name + ": " + std::to_string(r.errors) +
             " request error(s), first: " + r.first_error + "\n";
    if (r.short_requests > 0) {
      out += r.name + ": " + std::to_string(r.short_requests) +
             " request(s) ended at end-of-sequence before their length (" +
             std::to_string(r.output_tokens) + " of " + std::to_string(r.requested_tokens) +
             " tokens generated; the router has no ignore_eos)\n";
    }
    if (r.requests_without_figures > 0) {
      out += r.name + ": " + std::to_string(r.requests_without_figures) +
             " request(s) with tokens had no expert figures in usage.fmoe_experts (not in the "
             "hit rate)\n";
    }
  }
  return out;
}

Status WriteSummaryCsv(const std::string& path, const std::vector<RunSummary>& runs) {
  std::error_code ec;
  if (fs::path(path).has_parent_path()) fs::create_directories(fs::path(path).parent_path(), ec);
  std::ofstream out(path, std::ios::trunc);
  if (!out) return IoError(path + ": cannot write");
  out << "run,policy,budget,status,requests,ok,errors,prompt_tokens,output_tokens,"
         "requested_tokens,duration_s,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,tpot_p50_ms,"
         "tpot_p90_ms,tpot_p99_ms,output_tokens_per_s,requests_per_s,expert_hits,expert_misses,"
         "hit_rate,bytes_moved,error,ttft_mean_ms,tpot_mean_ms\n";
  for (const RunSummary& r : runs) {
    const bool data = !r.failed && r.ok > 0;
    auto num = [&](double v, int digits) { return data ? Fixed(v, digits) : std::string(); };
    out << CsvField(r.name) << ',' << CsvField(r.policy) << ',' << Fixed(r.budget, 4) << ','
        << (r.failed ? "failed" : "ok") << ',' << r.requests << ',' << r.ok << ',' << r.errors
        << ',' << r.prompt_tokens << ',' << r.output_tokens << ',' << r.requested_tokens << ','
        << Fixed(r.duration_s, 3);
    for (double v : r.ttft_ms) out << ',' << (r.ttft_samples > 0 ? num(v, 3) : "");
    for (double v : r.tpot_ms) out << ',' << (r.tpot_samples > 0 ? num(v, 3) : "");
    out << ',' << num(r.tokens_per_s, 3) << ',' << num(r.requests_per_s, 4) << ',' << r.expert_hits
        << ',' << r.expert_misses << ',' << (data && r.hit_rate >= 0 ? Fixed(r.hit_rate, 6) : "")
        << ',' << r.bytes_moved << ',' << CsvField(r.failed ? r.failure : r.first_error) << ','
        << (r.ttft_samples > 0 ? num(r.ttft_mean_ms, 3) : "") << ','
        << (r.tpot_samples > 0 ? num(r.tpot_mean_ms, 3) : "") << '\n';
  }
  if (!out) return IoError(path + ": write failed");
  return Status::Ok();
}

std::string PlotSummary(const std::string& csv_path, const std::string& png_path,
                        const std::vector<RunSummary>& runs) {
  const std::string script_path = fs::path(csv_path).replace_extension(".gp").string();
  const std::string csv = GnuplotString(csv_path);
  std::ofstream gp(script_path, std::ios::trunc);
  gp << "# fmoe-bench serve: plots " << csv_path << " (gnuplot " << script_path << ")\n"
     << "set datafile separator ','\n"
     << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
     << "  set terminal pngcairo size 1400,900 noenhanced\n"
     << "} else {\n"
     << "  set terminal png size 1400,900 noenhanced\n"
     << "}\n"
     << "set output " << GnuplotString(png_path) << "\n"
     << "set multiplot layout 2,2 title " << GnuplotString("fmoe-bench serve: " + csv_path) << "\n"
     << "set style data histograms\n"
     << "set style histogram clustered gap 1\n"
     << "set style fill solid 0.8 border -1\n"
     << "set boxwidth 0.9\n"
     << "set grid ytics\n"
     << "set key top left\n"
     << "set xtics rotate by -30\n"
     << "set yrange [0:*]\n"
     << "set title 'TTFT (ms)'\n"
     << "plot " << csv << " using 'ttft_p50_ms':xtic(1) title 'p50', '' using 'ttft_p90_ms' "
     << "title 'p90', '' using 'ttft_p99_ms' title 'p99'\n"
     << "set title 'TPOT (ms)'\n"
     << "plot " << csv << " using 'tpot_p50_ms':xtic(1) title 'p50', '' using 'tpot_p90_ms' "
     << "title 'p90', '' using 'tpot_p99_ms' title 'p99'\n"
     << "set title 'Throughput (output tokens/s)'\n"
     << "plot " << csv << " using 'output_tokens_per_s':xtic(1) notitle\n"
     << "set title 'Expert hit rate'\n"
     << "set yrange [0:1]\n"
     << "plot " << csv << " using 'hit_rate':xtic(1) notitle\n"
     << "unset multiplot\n";
  gp.close();
  if (!gp) return "cannot write the gnuplot script " + script_path + "; the CSV is " + csv_path;
  if (std::none_of(runs.begin(), runs.end(),
                   [](const RunSummary& r) { return !r.failed && r.ok > 0; })) {
    return "no run has figures to plot: no PNG (script " + script_path + ")";
  }
  const std::string gnuplot = FindOnPath("gnuplot");
  if (gnuplot.empty()) {
    return "gnuplot is not on PATH: no PNG; the CSV is " + csv_path + " and the script " +
           script_path + " (install gnuplot, then: gnuplot " + script_path + ")";
  }
  const std::string log = fs::path(csv_path).replace_extension(".gnuplot.log").string();
  const int code = RunTool({gnuplot, script_path}, log, 60);
  if (code != 0) {
    return "gnuplot failed (" +
           (code < 0 ? std::string("did not finish") : "exit code " + std::to_string(code)) +
           ", see " + log + "): no PNG; the CSV is " + csv_path;
  }
  return "plot: " + png_path + " (script " + script_path + ")";
}

}  // namespace fmoe::bench
