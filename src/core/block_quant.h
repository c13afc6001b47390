// int8 block quantisation, the one implementation behind every int8 wire form: the compressed
// gradient reduction (dist.grad_reduce_dtype = int8) and parameter-server pushes and pulls
// (ps/codec.h):
// values in blocks of kQuantBlock, one f32 scale per block, scale = max|x| / 127, q = round to
// nearest of x / scale (|q| ≤ 127), so that |x − q·scale| ≤ scale / 2 for every element.
// Error feedback: what quantising lost is kept in a residual and added to the next values
// quantised at the same place, so the sum of what was sent tracks the sum of the true values
// within one residual.
// On the wire a quantised range of n values is its ceil(n / kQuantBlock) scales (f32, native byte
// order) followed by its n int8 codes: wire_bytes(n) bytes.
#pragma once
#include <cstdint>

namespace moetrain {

inline constexpr int64_t kQuantBlock = 256;

constexpr int64_t quant_blocks(int64_t n) {
  return (n + kQuantBlock - 1) / kQuantBlock;
}
constexpr int64_t quant_wire_bytes(int64_t n) {
  return quant_blocks(n) * 4 + n;
}

// Quantises x[0, n) into wire (quant_wire_bytes(n) bytes). A block holding a NaN or an Inf gets a
// NaN scale, so that it dequantises to NaN and the overflow checks after the reduction see it.
void quantise_int8(uint8_t* wire, const float* x, int64_t n);
// x[0, n) = the values of a range quantised by quantise_int8.
void dequantise_int8(float* x, const uint8_t* wire, int64_t n);
// x[0, n) += the values of a quantised range; the adds of several calls are in call order.
void accumulate_int8(float* x, const uint8_t* wire, int64_t n);

// Error feedback around quantise_int8: v = x + residual is quantised into wire, and residual
// becomes v − dequantised(v). A non-finite block sends its NaN and keeps a zero residual: an
// overflow must not poison the following steps.
void quantise_int8_feedback(uint8_t* wire, const float* x, float* residual, int64_t n);

// The block kernels, exposed so tests can hold the AVX2 path to the scalar one bit for bit.
// scale = max|v| / 127 over the block (NaN when it holds a NaN or an Inf); q = clamp(nearbyint(
// v / scale), ±127), residual = v − q·scale (q = 0 when scale is 0 or NaN; the residual is 0
// when scale is NaN). residual may be null.
float quant_block_scale(const float* v, int64_t len, bool vector_path);
void quant_block_codes(const float* v, int64_t len, float scale, int8_t* q, float* residual,
                       bool vector_path);
bool quant_vector_path_available();

}  // namespace moetrain
