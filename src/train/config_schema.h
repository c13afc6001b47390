// The generic half of a TOML run configuration: a schema of "section.key" fields bound to the
// members of a config struct, filled from a TOML file, `--set key=value` overrides or a JSON copy
// (a checkpoint's config.json), and written back to JSON. Every error names the key, the value
// and what is allowed; what the values must satisfy is the config struct's own validate().
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moetrain {

// A setting with named values (an enum), parsed into its type when it is set: parse throws naming
// the key, the value and the allowed names; name gives a value's text (what JSON records).
struct Choice {
  std::function<void(const std::string&)> parse;
  std::function<std::string()> name;
};
template <class E, class Parse, class Name>
Choice choice(E* member, Parse parse, Name name) {
  return {[member, parse](const std::string& s) { *member = parse(s); },
          [member, name] { return std::string(name(*member)); }};
}

using FieldPtr = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, Choice>;

struct Field {
  std::string key;                // "section.name"
  FieldPtr ptr;                   // the member it sets
  const char* help = "";          // one line: what it does, its unit, what 0 means
  const char* allowed = nullptr;  // named values ("adamw, sgd"), when not any of its type
};

// "an integer", "a number", "true or false", "a string" (a choice: "a string").
const char* field_type_name(const FieldPtr& ptr);

// The entries of `values` ({ "section": { "key": v } }) that differ from `defaults`, same shape.
nlohmann::json changed_from(const nlohmann::json& values, const nlohmann::json& defaults);

class ConfigSchema {
 public:
  // Sections are taken from the keys, in order of first appearance.
  explicit ConfigSchema(std::vector<Field> fields);

  const std::vector<Field>& fields() const { return fields_; }
  std::vector<std::string> keys() const;
  // The field named `key`, or an Error (prefixed with `where`) suggesting the nearest known key,
  // or listing the keys of its section when none is near.
  Field& find(const std::string& key, const std::string& where = "");

  // Parses `path` (TOML) and sets every key it holds; the file must exist.
  void apply_toml_file(const std::string& path);
  // "section.key=value" each, applied in order.
  void apply_overrides(const std::vector<std::string>& overrides);
  // { "section": { "key": value } }, as to_json writes it; `where` names the source in errors.
  void apply_json(const nlohmann::json& j, const std::string& where);
  // { "section": { "key": value } } of every field's current value.
  nlohmann::json to_json() const;

  // "section.a, section.b, ..." (every key when `section` is empty; "" for an unknown section).
  std::string known_keys(const std::string& section) const;
  bool has_section(const std::string& section) const;
  std::string section_list() const;  // "[model], [optim], [train]"

  // `moetrain config list`: every key of `section` (every key when empty) with its type, its
  // current value (the defaults, on a fresh config), the allowed values and its help line. An
  // Error names an unknown section.
  std::string describe(const std::string& section) const;

 private:
  std::vector<Field> fields_;
  std::vector<std::string> sections_;
};

}  // namespace moetrain
