// Rotary position embedding in the Hugging Face Llama/Mixtral convention ("rotate_half": pairs
// element i with element i + HS/2, not adjacent elements), bit-for-bit the way transformers builds
// its cos/sin so that our checkpoints behave the same there:
//   inv_freq_i = 1 / theta^(float(2i) / HS)   (float32),   angle = float(pos) · inv_freq_i
//   (float32) out[i]        = x[i]·cos − x[i+HS/2]·sin out[i+HS/2]   = x[i+HS/2]·cos + x[i]·sin
#pragma once
#include <cstdint>
#include <vector>

namespace moetrain {

// out (N, NH, HS) = rope(inp) with each token at position pos (N) >= 0; HS even. out may alias inp.
void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, float theta);
// dinp (N, NH, HS) = the inverse rotation of dout (N, NH, HS). dinp may alias dout.
void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, float theta);

// cos/sin for positions [0, max_pos), computed once; gives bitwise the same results as the
// functions above, without a cos/sin per token and call.
class RopeTable {
 public:
  RopeTable(int64_t max_pos, int64_t HS, float theta);
  int64_t max_pos() const { return max_pos_; }
  int64_t head_size() const { return hs_; }
  float theta() const { return theta_; }
  const float* cos_row(int64_t pos) const { return cos_.data() + pos * (hs_ / 2); }  // (HS/2)
  const float* sin_row(int64_t pos) const { return sin_.data() + pos * (hs_ / 2); }  // (HS/2)

 private:
  int64_t max_pos_;
  int64_t hs_;
  float theta_;
  std::vector<float> cos_;  // (max_pos, HS/2)
  std::vector<float> sin_;  // (max_pos, HS/2)
};

// As above with positions in [0, table.max_pos()) and HS = table.head_size().
void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                  int64_t HS, const RopeTable& table);
void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                   int64_t HS, const RopeTable& table);

}  // namespace moetrain
