// ApiError: a request the client got wrong (or cannot be served), carried to the HTTP layer as an
// OpenAI-style error body `{"error": {"message", "type", "param", "code"}}` with a 4xx status.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mlaserve::server {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = "invalid_value",
           std::string type = "invalid_request_error")
      : std::runtime_error(message), status(status), param(std::move(param)), code(std::move(code)),
        type(std::move(type)) {}
  int status;
  std::string param;  // the offending field ("sampling_params.temperature"), empty if none
  std::string code;   // invalid_json, invalid_type, invalid_value, model_not_found, context_length_exceeded, ...
  std::string type;
};

// ApiError(400, ...) with a formatted message naming the field.
template <typename... Args>
[[noreturn]] inline void bad_request(const std::string& param, std::string code, fmt::format_string<Args...> f,
                                     Args&&... args) {
  throw ApiError(400, fmt::format(f, std::forward<Args>(args)...), param, std::move(code));
}

// The JSON body of an error response.
std::string error_body(const ApiError& e);
std::string error_body(int status, const std::string& message, const std::string& type = "invalid_request_error",
                       const std::string& code = "", const std::string& param = "");

}  // namespace mlaserve::server
