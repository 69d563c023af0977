#include "common/log.h"

#include <unistd.h>

#include <exception>
#include <string>

#include <spdlog/sinks/stdout_sinks.h>

namespace fmoe {

Status InitLogging(std::string_view process_name, std::string_view level) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return InvalidArgument("log level \"" + std::string(level) +
                           "\" is not trace, debug, info, warn or error");
  }
  auto logger = spdlog::stderr_logger_mt(std::string(process_name));
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%-5l%$ " + std::string(process_name) + "[" +
                      std::to_string(getpid()) + "] %v");
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

std::string CurrentExceptionText() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace fmoe
