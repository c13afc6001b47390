// Payload encodings for gradient pushes and parameter pulls: f32, bf16 (round to nearest even)
// and int8 with one f32 scale per block of kQuantBlock values (core/block_quant.h: a range's
// scales, then its codes). A sparse push sends only some
// ranges of its key range (the dense parameters and the experts that received tokens): a list of
// (offset, size) pairs relative to key_begin precedes the values of those ranges.
//
// int8 error feedback: what quantisation loses is kept by the worker (`residual`, one float per
// element of the key range) and added to the next push, so no gradient is lost for good, only
// delayed.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ps/message.h"

namespace moetrain::ps {

struct Span {
  int64_t offset = 0;  // relative to the key range's start
  int64_t size = 0;
};

// "none" | "bf16" | "int8" (the names of --push-compression and --pull-compression); throws
// naming the option, the value and the allowed ones.
Encoding parse_compression(std::string_view name, std::string_view option);
std::string_view compression_name(Encoding e);

// Bytes that n values take in encoding e.
std::size_t encoded_size(Encoding e, int64_t n);

// Writes the encoding of values[0, n) to out (encoded_size(e, n) bytes). With int8 and a
// residual (n floats), encodes values + residual and stores in residual what the encoding lost.
void write_values(Encoding e, const float* values, int64_t n, float* residual, char* out);
// The same, appended to a string.
void append_values(Encoding e, const float* values, int64_t n, float* residual, std::string& out);
// dst[0, n) = decoded values; `bytes` must be exactly encoded_size(e, n) (throws otherwise).
void decode_values(Encoding e, const char* data, std::size_t bytes, int64_t n, float* dst);

// A sparse payload's range list: a uint32 count, then (offset, size) int64 pairs relative to the
// key range. A sparse push begins with it, and so do a sparse pull's request (the ranges it asks
// for) and its reply (the ranges sent, then their values).
std::size_t ranges_size(const std::vector<Span>& ranges);
void write_ranges(const std::vector<Span>& ranges, char* out);
// Reads the range list at the start of a `bytes`-byte payload for a key range of n keys into
// `out` and returns the bytes it took. Throws naming what is malformed: the count, a range outside
// [0, n) or out of order.
std::size_t read_ranges(const char* payload, std::size_t bytes, int64_t n, std::vector<Span>& out);

// Bytes of a push payload for n values: dense when `ranges` is null, else the listed ranges.
std::size_t push_payload_size(Encoding e, int64_t n, const std::vector<Span>* ranges);
// Writes the push payload (push_payload_size bytes) to out, in place in the outgoing frame.
void write_push(Encoding e, const float* values, int64_t n, const std::vector<Span>* ranges,
                float* residual, char* out);
// A push payload for values[0, n) (the whole key range): dense when `ranges` is null, else the
// listed ranges only (sorted, disjoint, inside [0, n); possibly none).
std::string encode_push(Encoding e, const float* values, int64_t n, const std::vector<Span>* ranges,
                        float* residual);
// Decodes a push payload (flags say dense or sparse) into dst (n): elements outside the ranges
// are zero, or left as they are with zero_rest = false (a sparse pull reply, which has the same
// form). The ranges that were sent are returned in *ranges (the whole range when dense).
// Throws naming what is malformed: range count, a range outside [0, n), sizes that disagree.
void decode_push(const Header& h, const char* payload, int64_t n, float* dst,
                 std::vector<Span>* ranges, bool zero_rest = true);

}  // namespace moetrain::ps
