// Logging: spdlog's default logger, one line per event on stderr, prefixed with the process name
// and pid so that interleaved logs of the launcher's children can be told apart. Use
// spdlog::info/warn/error/debug with "req=", "rank=", "layer=", "expert=" fields; nothing per
// token at info level. InitLogging once, at the start of main(), before any thread starts.
#pragma once

#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

#include "common/status.h"

namespace fmoe {

// level: trace | debug | info | warn | error.
Status InitLogging(std::string_view process_name, std::string_view level);

// What the exception being handled says ("unknown exception" if it is no std::exception), for
// the log line of a loop or handler that serves on. Call inside a catch block only.
std::string CurrentExceptionText();

}  // namespace fmoe
