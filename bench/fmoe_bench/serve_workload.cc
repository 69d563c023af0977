#include "bench/fmoe_bench/serve_workload.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <random>

#include "common/json.h"

namespace fmoe::bench {
namespace {

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\r' || s[b] == '"')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r' || s[e - 1] == '"')) {
    --e;
  }
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> out;
  size_t at = 0;
  for (;;) {
    const size_t comma = line.find(',', at);
    out.push_back(Trim(std::string_view(line).substr(at, comma - at)));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

bool ParseInt(const std::string& text, int64_t* out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && p == end;
}

bool ParseNumber(const std::string& text, double* out) {
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, *out);
  return ec == std::errc() && p == end && std::isfinite(*out);
}

// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
int64_t DaysFromCivil(int64_t y, int64_t m, int64_t d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const int64_t yoe = y - era * 400;
  const int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + doe - 719468;
}

// "YYYY-MM-DD HH:MM:SS[.fraction]" (or with 'T') as seconds since the epoch, or a plain number.
bool ParseTimestamp(const std::string& text, double* out) {
  if (ParseNumber(text, out)) return true;
  if (text.size() < 19 || text[4] != '-' || text[7] != '-' ||
      (text[10] != ' ' && text[10] != 'T') || text[13] != ':' || text[16] != ':') {
    return false;
  }
  int64_t f[6];
  const size_t at[6] = {0, 5, 8, 11, 14, 17};
  const size_t len[6] = {4, 2, 2, 2, 2, 2};
  for (int i = 0; i < 6; ++i) {
    if (!ParseInt(text.substr(at[i], len[i]), &f[i])) return false;
  }
  if (f[1] < 1 || f[1] > 12 || f[2] < 1 || f[2] > 31 || f[3] > 23 || f[4] > 59 || f[5] > 60) {
    return false;
  }
  double fraction = 0;
  if (text.size() > 19) {
    if (text[19] != '.' || !ParseNumber("0" + text.substr(19), &fraction)) return false;
  }
  *out = static_cast<double>(DaysFromCivil(f[0], f[1], f[2]) * 86400 + f[3] * 3600 + f[4] * 60 +
                             f[5]) +
         fraction;
  return true;
}

int ScaleLength(int64_t value, double reference, int cap, int floor) {
  const double scaled = reference > 0 ? std::round(static_cast<double>(value) * cap / reference)
                                      : static_cast<double>(cap);
  return static_cast<int>(std::clamp(scaled, static_cast<double>(floor), static_cast<double>(cap)));
}

}  // namespace

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(values.size()));
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, double(values.size()))) - 1;
  return values[index];
}

Result<ArrivalTrace> LoadArrivals(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("arrivals: " + path + ": cannot open");
  std::string line;
  if (!std::getline(in, line)) return InvalidArgument("arrivals: " + path + ": empty file");
  const std::vector<std::string> header = SplitCsv(line);
  int col_time = -1, col_context = -1, col_generated = -1;
  for (size_t i = 0; i < header.size(); ++i) {
    if (header[i] == "TIMESTAMP") col_time = static_cast<int>(i);
    if (header[i] == "ContextTokens") col_context = static_cast<int>(i);
    if (header[i] == "GeneratedTokens") col_generated = static_cast<int>(i);
  }
  if (col_time < 0 || col_context < 0 || col_generated < 0) {
    return InvalidArgument("arrivals: " + path +
                           ":1: the header must name TIMESTAMP, ContextTokens and GeneratedTokens");
  }
  const size_t columns = static_cast<size_t>(std::max({col_time, col_context, col_generated})) + 1;
  ArrivalTrace trace;
  size_t line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    if (Trim(line).empty()) continue;
    const std::vector<std::string> cells = SplitCsv(line);
    const std::string where = "arrivals: " + path + ":" + std::to_string(line_no) + ": ";
    if (cells.size() < columns) return InvalidArgument(where + "has too few columns");
    ArrivalRow row;
    if (!ParseTimestamp(cells[col_time], &row.time_s)) {
      return InvalidArgument(where + "TIMESTAMP \"" + cells[col_time] +
                             "\" is not YYYY-MM-DD HH:MM:SS[.f] or a number of seconds");
    }
    if (!ParseInt(cells[col_context], &row.context_tokens) || row.context_tokens < 0 ||
        !ParseInt(cells[col_generated], &row.generated_tokens) || row.generated_tokens < 0) {
      return InvalidArgument(where + "ContextTokens and GeneratedTokens must be integers >= 0");
    }
    trace.rows.push_back(row);
  }
  if (trace.rows.empty()) return InvalidArgument("arrivals: " + path + ": no rows");
  std::vector<double> context, generated;
  for (const ArrivalRow& r : trace.rows) {
    context.push_back(static_cast<double>(r.context_tokens));
    generated.push_back(static_cast<double>(r.generated_tokens));
  }
  trace.context_p99 = Percentile(std::move(context), 99);
  trace.generated_p99 = Percentile(std::move(generated), 99);
  return trace;
}

Result<std::vector<std::string>> LoadPrompts(const std::string& path, const std::string& field,
                                             size_t* skipped) {
  std::ifstream in(path);
  if (!in) return NotFound("prompts: " + path + ": cannot open");
  std::vector<std::string> prompts;
  size_t bad = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (Trim(line).empty()) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    const nlohmann::json* value = nullptr;
    if (j.is_object()) {
      if (auto p = j.find(field); p != j.end()) value = &*p;
    }
    if (value != nullptr && value->is_array() && !value->empty()) value = &(*value)[0];
    if (value == nullptr || !value->is_string() || value->get<std::string>().empty()) {
      ++bad;
      continue;
    }
    prompts.push_back(value->get<std::string>());
  }
  if (skipped != nullptr) *skipped = bad;
  if (prompts.empty()) {
    return InvalidArgument("prompts: " + path + ": no line has a non-empty string \"" + field +
                           "\" (--prompt-field)");
  }
  return prompts;
}

Result<Workload> BuildWorkload(const ArrivalTrace& trace, const std::vector<std::string>& prompts,
                               const TokenCounter& count_tokens, const WorkloadOptions& o) {
  const size_t total = static_cast<size_t>(o.warmup) + static_cast<size_t>(o.requests);
  if (o.offset < 0 || static_cast<size_t>(o.offset) + total > trace.rows.size()) {
    return InvalidArgument("arrivals: rows " + std::to_string(o.offset) + ".." +
                           std::to_string(static_cast<size_t>(o.offset) + total - 1) +
                           " asked for (--offset, --warmup + --requests), the file has " +
                           std::to_string(trace.rows.size()));
  }
  // Prompts within the cap, with their token counts.
  std::vector<size_t> usable;
  std::vector<int> tokens(prompts.size(), 0);
  for (size_t i = 0; i < prompts.size(); ++i) {
    Result<int> n = count_tokens(prompts[i]);
    if (!n.ok() || *n < 1 || *n > o.max_prompt_tokens) continue;
    tokens[i] = *n;
    usable.push_back(i);
  }
  if (usable.empty()) {
    return InvalidArgument("prompts: none has at most " + std::to_string(o.max_prompt_tokens) +
                           " tokens (--max-prompt-tokens)");
  }
  Workload w;
  w.prompts_usable = usable.size();

  // Arrival offsets: gaps as in the trace (a row earlier than the one before counts as 0).
  const ArrivalRow* rows = trace.rows.data() + o.offset;
  std::vector<double> raw(total, 0.0);
  for (size_t i = 1; i < total; ++i) {
    raw[i] = raw[i - 1] + std::max(0.0, rows[i].time_s - rows[i - 1].time_s);
  }
  w.time_scale = o.time_scale;
  if (o.rate > 0) {
    const double span = raw.back();
    w.time_scale = span > 0 ? static_cast<double>(total - 1) / (o.rate * span) : 1.0;
  }

  // Length matching: prompts by token count, each count's prompts in seeded random order.
  std::vector<size_t> shuffled = usable;
  std::mt19937_64 rng(o.seed);
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  std::map<int, std::vector<size_t>> by_length;  // Used from the back.
  auto refill = [&] {
    by_length.clear();
    for (auto it = shuffled.rbegin(); it != shuffled.rend(); ++it) {
      by_length[tokens[*it]].push_back(*it);
    }
  };
  refill();
  size_t next_in_order = 0;

  for (size_t i = 0; i < total; ++i) {
    BenchRequest r;
    r.index = static_cast<int>(i);
    r.warmup = i < static_cast<size_t>(o.warmup);
    r.trace_row = static_cast<size_t>(o.offset) + i;
    r.arrival_s = raw[i] * w.time_scale;
    r.trace_context_tokens = rows[i].context_tokens;
    r.trace_generated_tokens = rows[i].generated_tokens;
    r.target_prompt_tokens =
        ScaleLength(r.trace_context_tokens, trace.context_p99, o.max_prompt_tokens, 1);
    r.max_tokens =
        ScaleLength(r.trace_generated_tokens, trace.generated_p99, o.max_tokens, o.min_tokens);
    size_t chosen = 0;
    if (o.match == PromptMatch::kOrder) {
      chosen = usable[next_in_order];
      next_in_order = (next_in_order + 1) % usable.size();
    } else {
      if (by_length.empty()) refill();
      auto above = by_length.lower_bound(r.target_prompt_tokens);
      auto best = above;
      if (above == by_length.end() ||
          (above != by_length.begin() && r.target_prompt_tokens - std::prev(above)->first <=
                                             above->first - r.target_prompt_tokens)) {
        best = std::prev(above);
      }
      chosen = best->second.back();
      best->second.pop_back();
      if (best->second.empty()) by_length.erase(best);
    }
    r.prompt_line = chosen;
    r.prompt = prompts[chosen];
    r.prompt_tokens = tokens[chosen];
    w.requests.push_back(std::move(r));
  }
  return w;
}

Status WriteWorkload(const std::string& path, const Workload& workload) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return IoError(path + ": cannot write");
  for (const BenchRequest& r : workload.requests) {
    out << nlohmann::json{{"index", r.index},
                          {"warmup", r.warmup},
                          {"trace_row", r.trace_row},
                          {"arrival_s", r.arrival_s},
                          {"trace_context_tokens", r.trace_context_tokens},
                          {"trace_generated_tokens", r.trace_generated_tokens},
                          {"target_prompt_tokens", r.target_prompt_tokens},
                          {"prompt_tokens", r.prompt_tokens},
                          {"prompt_line", r.prompt_line},
                          {"max_tokens", r.max_tokens},
                          {"prompt", r.prompt}}
               .dump()
        << "\n";
  }
  if (!out) return IoError(path + ": write failed");
  return Status::Ok();
}

}  // namespace fmoe::bench
