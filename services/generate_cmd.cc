#include "services/generate_cmd.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace fmoe {

int ExecGenerate(const std::string& bin_dir, const std::string& name,
                 const std::vector<std::string>& args) {
#ifndef FMOE_HAVE_TORCH
  (void)bin_dir;
  (void)name;
  (void)args;
  std::fprintf(stderr,
               "fmoe generate: this build has no model runtime (it was configured without "
               "LibTorch; rebuild with FMOE_TORCH=ON to run models)\n");
  return 1;
#else
  const std::string path = bin_dir + "/fmoe-generate";
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(name.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(path.c_str(), argv.data());
  const int err = errno;
  std::fprintf(stderr, "fmoe generate: cannot run %s: %s (build the fmoe-generate target)\n",
               path.c_str(), std::strerror(err));
  return 1;
#endif
}

}  // namespace fmoe
