// Plain Hugging Face model directories (what transformers' save_pretrained writes): config.json,
// and model.safetensors or model-0000i-of-0000n.safetensors with model.safetensors.index.json.
// No manifest and no checksums: the files are checked against their own headers and the index,
// every tensor against the names and shapes the model expects.
#pragma once
#include <filesystem>
#include <vector>

#include "io/checkpoint.h"

namespace moetrain {

// A directory with config.json and model weights in safetensors form but no moetrain manifest.
bool is_hf_model_dir(const std::filesystem::path& dir);

// Fills every tensor of `into` from dir's safetensors files, widening bf16 and f16 to f32.
// Throws naming the tensor and the file when one is missing, has another shape or element type,
// or when the files hold a tensor that `into` does not list (a model we would load only in part).
void read_hf_tensors(const std::filesystem::path& dir, const std::vector<NamedTensor>& into);

}  // namespace moetrain
