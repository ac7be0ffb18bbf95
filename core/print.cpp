// core/print.cpp: Tensor::str(), a readable dump: "[2, 3] f32 cpu" then nested rows of values.
#include <cmath>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace shardlab {
namespace {

constexpr std::int64_t kSummariseAbove = 1000;  // elements
constexpr std::int64_t kEdgeItems = 3;

struct Printer {
  const std::vector<double>& values;
  const Shape& shape;
  const Strides strides;  // row-major over `shape`
  bool summarise;
  bool floating;
  bool boolean;
  bool scientific = false;
  std::size_t width = 0;

  std::string format_value(double v) const {
    if (boolean) return v != 0 ? "true" : "false";
    if (!floating || std::isnan(v) || std::isinf(v)) {
      if (std::isnan(v)) return "nan";
      if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
      return fmt::format("{}", static_cast<std::int64_t>(v));
    }
    return scientific ? fmt::format("{:.4e}", v) : fmt::format("{:.4f}", v);
  }

  // Indices of dim d that are shown (-1 marks the "..." gap).
  std::vector<std::int64_t> shown(std::size_t d) const {
    std::vector<std::int64_t> out;
    const std::int64_t n = shape[d];
    if (!summarise || n <= 2 * kEdgeItems) {
      for (std::int64_t i = 0; i < n; ++i) out.push_back(i);
      return out;
    }
    for (std::int64_t i = 0; i < kEdgeItems; ++i) out.push_back(i);
    out.push_back(-1);
    for (std::int64_t i = n - kEdgeItems; i < n; ++i) out.push_back(i);
    return out;
  }

  void visit_values(std::size_t d, std::int64_t offset, const auto& fn) const {
    if (d == shape.size()) return fn(values[offset]);
    for (const std::int64_t i : shown(d)) {
      if (i >= 0) visit_values(d + 1, offset + i * strides[d], fn);
    }
  }

  void render(std::size_t d, std::int64_t offset, std::string& out) const {
    if (d == shape.size()) {
      const std::string text = format_value(values[offset]);
      out += std::string(width - std::min(width, text.size()), ' ') + text;
      return;
    }
    out += '[';
    bool first = true;
    for (const std::int64_t i : shown(d)) {
      if (!first) out += d + 1 == shape.size() ? ", " : ",\n" + std::string(d + 1, ' ');
      first = false;
      if (i < 0) {
        out += "...";
        continue;
      }
      render(d + 1, offset + i * strides[d], out);
    }
    out += ']';
  }
};

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "undefined tensor";
  std::string out = fmt::format("{} {} {}", shape_str(shape_), dtype_name(dtype_), device().str());
  if (numel() == 0) return out + "\n[]";
  const std::vector<double> values = to_vector<double>();
  Printer printer{values,
                  shape_,
                  contiguous_strides(shape_),
                  numel() > kSummariseAbove,
                  is_floating(dtype_),
                  dtype_ == DType::boolean};
  double largest = 0, smallest_nonzero = INFINITY;
  printer.visit_values(0, 0, [&](double v) {
    if (!std::isfinite(v)) return;
    largest = std::max(largest, std::abs(v));
    if (v != 0) smallest_nonzero = std::min(smallest_nonzero, std::abs(v));
  });
  printer.scientific = printer.floating && (largest >= 1e8 || smallest_nonzero < 1e-4);
  printer.visit_values(
      0, 0, [&](double v) { printer.width = std::max(printer.width, printer.format_value(v).size()); });
  out += '\n';
  printer.render(0, 0, out);
  return out;
}

}  // namespace shardlab
