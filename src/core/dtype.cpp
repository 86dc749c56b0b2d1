#include "core/dtype.h"

namespace mlaserve {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::F8_E4M3: return 1;
    case DType::F8_E5M2: return 1;
    case DType::I64: return 8;
    case DType::I32: return 4;
    case DType::I16: return 2;
    case DType::I8: return 1;
    case DType::U8: return 1;
    case DType::BOOL: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::F8_E5M2: return "F8_E5M2";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view n) {
  if (n == "F32") return DType::F32;
  if (n == "F16") return DType::F16;
  if (n == "BF16") return DType::BF16;
  if (n == "F8_E4M3") return DType::F8_E4M3;
  if (n == "F8_E5M2") return DType::F8_E5M2;
  if (n == "I64") return DType::I64;
  if (n == "I32") return DType::I32;
  if (n == "I16") return DType::I16;
  if (n == "I8") return DType::I8;
  if (n == "U8") return DType::U8;
  if (n == "BOOL") return DType::BOOL;
  return std::nullopt;
}

}  // namespace mlaserve
