// What the data-parallel gradient reduction puts on the wire (dist.grad_reduce_dtype): f32, bf16
// (rounded values), or int8 (block-quantised with error feedback, core/block_quant.h).
#pragma once
#include <string_view>

#include "core/check.h"

namespace moetrain {

enum class GradWire { F32, BF16, Int8 };

constexpr std::string_view grad_wire_name(GradWire w) {
  return w == GradWire::F32 ? "f32" : w == GradWire::BF16 ? "bf16" : "int8";
}

// Throws naming `key`, the value and the allowed names.
inline GradWire parse_grad_wire(std::string_view name, std::string_view key) {
  for (GradWire w : {GradWire::F32, GradWire::BF16, GradWire::Int8})
    if (name == grad_wire_name(w)) return w;
  MOETRAIN_FAIL("{} = '{}': allowed are f32, bf16, int8", key, name);
}

// Bytes per gradient element on the wire (int8: the code plus its share of the block's scale).
constexpr double grad_wire_bytes(GradWire w) {
  return w == GradWire::F32 ? 4.0 : w == GradWire::BF16 ? 2.0 : 1.0 + 4.0 / 256.0;
}

}  // namespace moetrain
