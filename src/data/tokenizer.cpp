#include "data/tokenizer.h"

#include <sentencepiece_processor.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <type_traits>

#include "core/check.h"
#include "io/crc32c.h"

namespace moetrain {

namespace fs = std::filesystem;

void byte_encode(std::string_view text, uint16_t* out) {
  for (std::size_t i = 0; i < text.size(); ++i) out[i] = static_cast<uint8_t>(text[i]);
}

std::vector<uint16_t> byte_encode(std::string_view text) {
  std::vector<uint16_t> out(text.size());
  byte_encode(text, out.data());
  return out;
}

namespace {
template <typename T>
std::string decode(std::span<const T> tokens) {
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    bool in_vocab;
    if constexpr (std::is_signed_v<T>) {
      in_vocab = tokens[i] >= 0 && static_cast<uint32_t>(tokens[i]) < kByteVocab;
    } else {
      in_vocab = static_cast<uint32_t>(tokens[i]) < kByteVocab;
    }
    MOETRAIN_CHECK(in_vocab,
                   "byte_decode: token {} at position {} is outside the byte vocabulary [0, {})",
                   tokens[i], i, kByteVocab);
  }
  std::string out(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i)
    out[i] = static_cast<char>(static_cast<uint8_t>(tokens[i]));
  return out;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  MOETRAIN_CHECK(f.good(), "cannot open '{}'", p.string());
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  MOETRAIN_CHECK(!f.bad(), "error reading '{}'", p.string());
  return s;
}
}  // namespace

std::string byte_decode(std::span<const uint16_t> tokens) {
  return decode(tokens);
}
std::string byte_decode(std::span<const int32_t> tokens) {
  return decode(tokens);
}

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
  std::string bytes;
  std::string source;
};

Tokenizer::Tokenizer() = default;

Tokenizer Tokenizer::sentencepiece(std::string model_bytes, const std::string& source) {
  auto impl = std::make_shared<Impl>();
  const auto st = impl->sp.LoadFromSerializedProto(model_bytes);
  MOETRAIN_CHECK(st.ok(), "{}: not a SentencePiece model ({})", source, st.ToString());
  MOETRAIN_CHECK(impl->sp.eos_id() >= 0,
                 "{}: the SentencePiece model has no end-of-sentence piece (</s>); moetrain ends "
                 "each document with it",
                 source);
  Tokenizer t;
  t.fingerprint_ = fmt::format("sentencepiece:{:08x}", crc32c(model_bytes.data(), model_bytes.size()));
  impl->bytes = std::move(model_bytes);
  impl->source = source;
  t.impl_ = std::move(impl);
  return t;
}

namespace {
Tokenizer from_dir_model(const fs::path& model) {
  return Tokenizer::sentencepiece(read_bytes(model), model.string());
}
}  // namespace

Tokenizer Tokenizer::from_dir(const fs::path& dir) {
  const fs::path model = dir / kTokenizerFile;
  if (!fs::exists(model)) return Tokenizer();
  Tokenizer t = from_dir_model(model);
  const fs::path config = dir / "tokenizer_config.json";
  if (fs::exists(config)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_bytes(config));
    } catch (const nlohmann::json::exception& e) {
      MOETRAIN_FAIL("{}: not valid JSON ({})", config.string(), e.what());
    }
    const auto it = j.find("add_bos_token");
    t.add_bos_ = it != j.end() && it->is_boolean() && it->get<bool>() && t.impl_->sp.bos_id() >= 0;
  }
  return t;
}

std::string Tokenizer::kind() const {
  return is_bytes() ? "byte" : "sentencepiece";
}

int64_t Tokenizer::vocab_size() const {
  return is_bytes() ? kByteVocab : impl_->sp.GetPieceSize();
}

int32_t Tokenizer::eod_id() const {
  return is_bytes() ? '\n' : impl_->sp.eos_id();
}

const std::string& Tokenizer::fingerprint() const {
  return fingerprint_;
}

const std::string& Tokenizer::model_bytes() const {
  static const std::string none;
  return is_bytes() ? none : impl_->bytes;
}

void Tokenizer::encode_into(std::string_view text, std::vector<int32_t>& out) const {
  if (is_bytes()) {
    const std::size_t at = out.size();
    out.resize(at + text.size());
    for (std::size_t i = 0; i < text.size(); ++i) out[at + i] = static_cast<uint8_t>(text[i]);
    return;
  }
  std::vector<int> ids;
  const auto st = impl_->sp.Encode(text, &ids);
  MOETRAIN_CHECK(st.ok(), "{}: cannot encode text: {}", impl_->source, st.ToString());
  out.insert(out.end(), ids.begin(), ids.end());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  encode_into(text, out);
  return out;
}

std::vector<int32_t> Tokenizer::encode_prompt(std::string_view text) const {
  std::vector<int32_t> out;
  if (add_bos_) out.push_back(impl_->sp.bos_id());
  encode_into(text, out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  if (is_bytes()) return byte_decode(ids);
  const int64_t V = vocab_size();
  for (std::size_t i = 0; i < ids.size(); ++i)
    MOETRAIN_CHECK(ids[i] >= 0 && ids[i] < V,
                   "decode: token {} at position {} is outside the vocabulary [0, {}) of {}",
                   ids[i], i, V, impl_->source);
  std::string out;
  const auto st = impl_->sp.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
  MOETRAIN_CHECK(st.ok(), "{}: cannot decode: {}", impl_->source, st.ToString());
  return out;
}

std::vector<std::pair<std::string, std::string>> Tokenizer::hf_files(int64_t max_length) const {
  if (is_bytes()) return {};
  const auto& sp = impl_->sp;
  auto piece = [&](int id) -> nlohmann::json {
    if (id < 0) return nullptr;
    return sp.IdToPiece(id);
  };
  // LlamaTokenizer is the SentencePiece tokenizer transformers pairs with Mixtral; no BOS/EOS
  // added on encode, as moetrain's encode adds none.
  nlohmann::ordered_json config = {
      {"tokenizer_class", "LlamaTokenizer"},
      {"add_bos_token", false},
      {"add_eos_token", false},
      {"bos_token", piece(sp.bos_id())},
      {"eos_token", piece(sp.eos_id())},
      {"unk_token", piece(sp.unk_id())},
      {"pad_token", piece(sp.pad_id())},
      {"model_max_length", max_length},
      {"clean_up_tokenization_spaces", false},
      {"legacy", true},
      {"sp_model_kwargs", nlohmann::json::object()},
  };
  nlohmann::ordered_json special = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"})
    if (!config[key].is_null()) special[key] = config[key];
  return {{kTokenizerFile, impl_->bytes},
          {"tokenizer_config.json", config.dump(2) + "\n"},
          {"special_tokens_map.json", special.dump(2) + "\n"}};
}

Tokenizer load_tokenizer(const std::string& spec) {
  if (spec == "byte") return Tokenizer();
  const fs::path p = spec;
  MOETRAIN_CHECK(fs::exists(p), "--tokenizer '{}' does not exist (give 'byte', a tokenizer.model "
                 "file or a directory holding one)", spec);
  if (fs::is_directory(p)) {
    MOETRAIN_CHECK(fs::exists(p / kTokenizerFile),
                   "--tokenizer '{}' is a directory without {} (train one with `moetrain "
                   "tokenizer train`, or give a Hugging Face model directory that has one)",
                   spec, kTokenizerFile);
    return Tokenizer::from_dir(p);
  }
  return from_dir_model(p);
}

namespace {
nlohmann::json read_meta(const fs::path& meta_file) {
  try {
    return nlohmann::json::parse(read_bytes(meta_file));
  } catch (const nlohmann::json::exception& e) {
    MOETRAIN_FAIL("{}: not valid JSON ({})", meta_file.string(), e.what());
  }
}
}  // namespace

int64_t data_vocab_size(const fs::path& data_dir) {
  const fs::path meta_file = data_dir / "meta.json";
  if (!fs::exists(meta_file)) return kByteVocab;
  const nlohmann::json meta = read_meta(meta_file);
  const auto it = meta.find("vocab_size");
  MOETRAIN_CHECK(it != meta.end() && it->is_number_integer() && it->get<int64_t>() > 0,
                 "{}: no positive integer 'vocab_size' (prepare the data again)",
                 meta_file.string());
  return it->get<int64_t>();
}

Tokenizer data_tokenizer(const fs::path& data_dir) {
  const fs::path meta_file = data_dir / "meta.json";
  if (!fs::exists(meta_file)) return Tokenizer();
  const nlohmann::json meta = read_meta(meta_file);
  const auto it = meta.find("tokenizer");
  // meta.json of shards prepared before tokenizers were recorded says "byte".
  if (it == meta.end() || it->is_string()) return Tokenizer();
  const std::string kind = it->value("kind", "");
  if (kind == "byte") return Tokenizer();
  MOETRAIN_CHECK(kind == "sentencepiece", "{}: tokenizer.kind = '{}', expected 'byte' or 'sentencepiece'",
                 meta_file.string(), kind);
  const fs::path model = data_dir / kTokenizerFile;
  MOETRAIN_CHECK(fs::exists(model),
                 "{} says the shards were made with a SentencePiece tokenizer, but {} is missing",
                 meta_file.string(), model.string());
  Tokenizer t = Tokenizer::sentencepiece(read_bytes(model), model.string());
  const std::string want = it->value("fingerprint", "");
  MOETRAIN_CHECK(t.fingerprint() == want,
                 "{} is not the tokenizer the shards were made with: its fingerprint is {}, {} "
                 "records {}",
                 model.string(), t.fingerprint(), meta_file.string(), want);
  return t;
}

}  // namespace moetrain
