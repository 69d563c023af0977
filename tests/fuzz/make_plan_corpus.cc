// Writes the seed corpus of plan_fuzz into the directory named on the command line: iteration
// plans as a leader sends them (prefills, prompt chunks, decodes, ended and preempted requests,
// restarts, keep-alives, a stop). Usage: make_plan_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "gpu_worker/core/group_plan.h"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_plan_corpus DIR\n");
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  using fmoe::IterationPlan;
  using fmoe::PlanKind;
  std::vector<IterationPlan> plans;
  IterationPlan p;
  p.kind = PlanKind::kIteration;
  p.step = 7;
  p.sequences.push_back({1, 0, {5, 6, 7, 8}, true, false});
  plans.push_back(p);
  p.step = 8;
  p.ended = {3, 4};
  p.sequences = {
      {1, 1, {9}, false, false}, {2, 0, {1, 2}, true, false}, {5, 3, {10, 11, 12}, true, false}};
  plans.push_back(p);
  // A preemption: request 2's blocks go back; later it restarts from position 0.
  p.step = 9;
  p.ended = {};
  p.preempted = {2};
  p.sequences = {{1, 2, {4}, false, false}};
  plans.push_back(p);
  p.step = 10;
  p.preempted = {};
  p.sequences = {{2, 1, {1, 2, 3}, true, true}};
  plans.push_back(p);
  p.step = 13;
  p.stream = true;  // A long prefill that streams its missing experts.
  p.sequences = {{3, 0, {5, 6, 7, 8, 9}, true, false}, {1, 3, {4}, false, false}};
  plans.push_back(p);
  p.stream = false;
  plans.push_back({PlanKind::kIdle, 11, {1, 2, 3}, {}, {}});
  plans.push_back({PlanKind::kStop, 12, {}, {}, {}});
  int n = 0;
  for (const IterationPlan& plan : plans) {
    const std::vector<uint8_t> bytes = fmoe::EncodePlan(plan);
    std::ofstream(out / ("seed-" + std::to_string(n++)), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  }
  return 0;
}
