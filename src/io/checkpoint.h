// Checkpoints: world-size independent, written by every rank in parallel, checksummed, committed
// atomically. A checkpoint is RUN_DIR/checkpoints/step_NNNNNNNN/ holding
//   model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json
//                          parameters under their Hugging Face names, whole tensors (transformers'
//                          sharded layout when several ranks write them)
//   optimizer[-0000i-of-0000n].safetensors   optimizer moments, "<state>.<parameter name>", whole
//                          tensors or element ranges of them (ZeRO-1 slices)
//   state[-0000i-of-0000n].safetensors       training state that is not a parameter
//   config.json            the model in MixtralConfig form (plus moetrain's own run config)
//   trainer_state.json     step, schedule and data position, seeds, config hash, global batch
//   tokenizer.model, tokenizer_config.json, special_tokens_map.json
//                          the run's SentencePiece tokenizer, as transformers' AutoTokenizer
//                          reads it (none for the byte tokenizer)
//   manifest.json          every file with its size and CRC-32C, every tensor with its pieces
// Every tensor is saved by global name and global element range, so a checkpoint written by N
// processes loads on any M: each rank reads the ranges it needs, wherever they were written.
//
// Commit protocol (write_checkpoint): every rank writes its files into checkpoints/.tmp_step_N/;
// rank 0 then writes the JSON files and, last, manifest.json; fsyncs the directory and renames it
// to step_N (the commit point), then points the symbolic link `latest` at it. A directory without a valid manifest, a
// leftover .tmp_ one, or one whose files do not match the manifest is refused, and the previous
// complete checkpoint is used.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm.h"
#include "core/tensor.h"

namespace moetrain {

// Elements [begin, end) of the flattened float tensor `name`, whose whole shape is `shape`,
// in the caller's memory (end − begin floats at data): written from, or read into.
// A piece outside memory (an offloaded optimizer state) has no data: get copies its elements
// [begin + at, begin + at + n) into buf, put stores buf there, and the checkpoint moves it a
// window of kCheckpointWindow bytes at a time.
struct TensorPiece {
  std::string name;
  Shape shape;
  int64_t begin = 0, end = 0;
  float* data = nullptr;
  std::function<void(int64_t at, int64_t n, float* buf)> get{};
  std::function<void(int64_t at, int64_t n, const float* buf)> put{};
};

// Bytes a checkpoint copies at a time: of a piece outside memory, and of a mapped checkpoint
// file whose pages are handed back once read.
inline constexpr int64_t kCheckpointWindow = int64_t{4} << 20;

// A whole tensor as one piece.
TensorPiece whole_tensor(std::string name, Shape shape, float* data);

// The pieces one rank writes (each element of each tensor by exactly one rank), or wants to read
// (any ranges). Three file families: parameters, optimizer state, other training state.
struct CheckpointShare {
  std::vector<TensorPiece> model, optimizer, state;
};

// The JSON documents of a checkpoint (rank 0's are written).
struct CheckpointDocs {
  nlohmann::json config;   // config.json
  nlohmann::json trainer;  // trainer_state.json
  // Other files, name -> bytes (the tokenizer's), checksummed in the manifest like the rest.
  std::vector<std::pair<std::string, std::string>> files;
};

std::filesystem::path checkpoint_dir(const std::filesystem::path& run_dir, int64_t step);

// Collective over comm. Writes this rank's share, then (rank 0) the docs and the manifest, commits
// the checkpoint for `step`, points `latest` at it and removes all but the newest `keep` of those
// up to `step` (a newer one is never removed).
// Throws on every rank if any rank fails, or if the ranks' pieces do not cover every element of
// every tensor exactly once. Returns the checkpoint's directory.
std::filesystem::path write_checkpoint(Comm& comm, const std::filesystem::path& run_dir,
                                       int64_t step, const CheckpointShare& mine,
                                       const CheckpointDocs& docs, int64_t keep);

// Verifies a checkpoint directory against its manifest: every file's size, every file's CRC-32C,
// every tensor's pieces, and that the directory's name, the manifest and trainer_state.json
// name the same step. With a communicator (collective), each rank checksums a share of the
// files and all throw the same message if any fails. Throws naming the file and what is wrong.
void verify_checkpoint(const std::filesystem::path& dir, Comm* comm = nullptr);

// The newest complete checkpoint of a run: the newest committed one that verifies (each refusal
// is logged with its reason); `latest` is only a hint, and one naming anything outside the run's
// checkpoints directory is ignored with a warning. nullopt if there is none. Collective when
// given a communicator: every rank returns the same answer.
// `load`, when given, reads the verified checkpoint (on every rank); if it throws, the checkpoint
// is refused like one that fails verification. `refusals` collects each refusal's reason.
using CheckpointLoad = std::function<void(const std::filesystem::path&)>;
std::optional<std::filesystem::path> find_latest_checkpoint(
    const std::filesystem::path& run_dir, Comm* comm = nullptr, const CheckpointLoad& load = {},
    std::vector<std::string>* refusals = nullptr);

// A JSON file of a checkpoint (config.json, trainer_state.json, manifest.json).
nlohmann::json read_checkpoint_json(const std::filesystem::path& dir, const std::string& file);

[[noreturn]] void throw_json_error(const std::filesystem::path& file, const std::exception& e);
// fn(), with nlohmann's errors (a key of the wrong type: "type must be number, but is string")
// rethrown as an Error that names `file`, the JSON document fn reads.
template <typename F>
decltype(auto) reading_json(const std::filesystem::path& file, F&& fn) {
  try {
    return fn();
  } catch (const nlohmann::json::exception& e) {
    throw_json_error(file, e);
  }
}

// Fills every piece of `into` from the saved pieces that overlap it (any layout, any ranges).
// Throws if a tensor is missing, has another shape, or an element is not covered. Does not
// verify checksums: do that first (find_latest_checkpoint and verify_checkpoint do).
void read_checkpoint_pieces(const std::filesystem::path& dir, const CheckpointShare& into);

// --- One process -------------------------------------------------------------------------------

// A named whole tensor in the caller's memory.
struct NamedTensor {
  std::string name;
  Shape shape;
  float* data;
};

struct CheckpointContents {
  std::vector<NamedTensor> model;
  std::vector<NamedTensor> optimizer;
  std::vector<NamedTensor> state;
  nlohmann::json config;   // config.json
  nlohmann::json trainer;  // trainer_state.json
  std::vector<std::pair<std::string, std::string>> files;  // as CheckpointDocs::files
};

// write_checkpoint by a single process holding everything.
std::filesystem::path write_checkpoint(const std::filesystem::path& run_dir, int64_t step,
                                       const CheckpointContents& contents, int64_t keep);

// Verifies, then fills every tensor listed in `into` (an empty group is not read) and
// into.config / into.trainer.
void read_checkpoint(const std::filesystem::path& dir, CheckpointContents& into);

}  // namespace moetrain
