// ApiError (router/http_server.h), apart from the server so that code without Beast (the request
// parsing, and its fuzzer) links it.

#include "common/json.h"
#include "router/http_server.h"

namespace fmoe {

HttpResponse ApiError(int status, const std::string& message, const std::string& type,
                      const std::string& param, const std::string& code) {
  using Json = nlohmann::json;
  Json body = {{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? Json(nullptr) : Json(param)},
                 {"code", code.empty() ? Json(nullptr) : Json(code)}}}};
  HttpResponse res;
  res.status = status;
  res.body = body.dump(-1, ' ', false, Json::error_handler_t::replace);
  return res;
}

}  // namespace fmoe
