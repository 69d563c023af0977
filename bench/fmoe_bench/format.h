// Number formatting shared by fmoe-bench's reports and tables.
#pragma once

#include <cstdio>
#include <string>

namespace fmoe::bench {

// `v` with `digits` digits after the point.
inline std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

}  // namespace fmoe::bench
