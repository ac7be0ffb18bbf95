// core/dtype.cpp: dtype sizes, names and the promotion lattice.
#include "core/dtype.h"

namespace shardlab {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::u8:
    case DType::boolean:
      return 1;
  }
  __builtin_unreachable();
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i64:
      return "i64";
    case DType::i32:
      return "i32";
    case DType::u8:
      return "u8";
    case DType::boolean:
      return "bool";
  }
  __builtin_unreachable();
}

bool is_floating(DType dtype) {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::bf16 || dtype == DType::f16;
}

bool is_integral(DType dtype) { return dtype == DType::i64 || dtype == DType::i32 || dtype == DType::u8; }

namespace {

// Rank within a category; the wider type has the higher rank.
int width_rank(DType dtype) {
  switch (dtype) {
    case DType::boolean:
      return 0;
    case DType::u8:
      return 1;
    case DType::i32:
      return 2;
    case DType::i64:
      return 3;
    case DType::bf16:
    case DType::f16:
      return 1;
    case DType::f32:
      return 2;
    case DType::f64:
      return 3;
  }
  __builtin_unreachable();
}

int category(DType dtype) { return is_floating(dtype) ? 2 : is_integral(dtype) ? 1 : 0; }

}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (category(a) != category(b)) return category(a) > category(b) ? a : b;
  if (width_rank(a) == width_rank(b)) return DType::f32;  // bf16 with f16
  return width_rank(a) > width_rank(b) ? a : b;
}

}  // namespace shardlab
