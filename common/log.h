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

// level: trace | debug | info | warn | error. Every message is written through
// EscapeForLog: a request's names and texts cannot forge a line or drive the terminal.
Status InitLogging(std::string_view process_name, std::string_view level);

// `text` with what a terminal or a line-based log reader would act on made visible: control
// characters (C0, DEL, and C1 as UTF-8) become \n, \r, \t or \xHH (\u{0085} for a C1 code point),
// and bytes that are not well-formed UTF-8 become \xHH. Everything else is kept as is.
std::string EscapeForLog(std::string_view text);

// What the exception being handled says ("unknown exception" if it is no std::exception), for
// the log line of a loop or handler that serves on. Call inside a catch block only.
std::string CurrentExceptionText();

}  // namespace fmoe
