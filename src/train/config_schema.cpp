#include "train/config_schema.h"

#include <sys/stat.h>
#include <toml++/toml.h>
#include <charconv>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "core/check.h"
#include "core/log.h"
#include "core/suggest.h"

namespace moetrain {

const char* field_type_name(const FieldPtr& ptr) {
  return std::visit(
      [](const auto& v) -> const char* {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>)
          return "an integer";
        if constexpr (std::is_same_v<T, double>) return "a number";
        if constexpr (std::is_same_v<T, bool>) return "true or false";
        return "a string";
      },
      ptr);
}

namespace {

std::string section_of(const std::string& key) {
  return key.substr(0, key.find('.'));
}

void set_from_toml(Field& f, const toml::node& node, const std::string& where) {
  bool ok = std::visit(
      [&](auto& v) {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, Choice>) {
          if (auto x = node.value_exact<std::string>()) return v.parse(*x), true;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (auto x = node.value_exact<int64_t>()) return *v = *x, true;
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (auto x = node.value_exact<int64_t>(); x && *x >= 0)
            return *v = static_cast<uint64_t>(*x), true;
        } else if constexpr (std::is_same_v<T, double>) {
          if (auto x = node.value<double>()) return *v = *x, true;  // integers accepted as numbers
        } else if constexpr (std::is_same_v<T, bool>) {
          if (auto x = node.value_exact<bool>()) return *v = *x, true;
        } else {
          if (auto x = node.value_exact<std::string>()) return *v = *x, true;
        }
        return false;
      },
      f.ptr);
  MOETRAIN_CHECK(ok, "{}key '{}' must be {}{}", where, f.key, field_type_name(f.ptr),
                 std::holds_alternative<uint64_t*>(f.ptr) ? " ≥ 0" : "");
}

void set_from_string(Field& f, const std::string& value) {
  auto fail = [&]() {
    MOETRAIN_FAIL("--set {}={}: the value must be {}", f.key, value, field_type_name(f.ptr));
  };
  std::visit(
      [&](auto& v) {
        using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
        if constexpr (std::is_same_v<T, Choice>) {
          v.parse(value);
        } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
          T x{};
          auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), x);
          if (ec != std::errc() || end != value.data() + value.size()) fail();
          *v = x;
        } else if constexpr (std::is_same_v<T, double>) {
          try {
            std::size_t used = 0;
            double x = std::stod(value, &used);
            if (used != value.size()) fail();
            *v = x;
          } catch (const std::logic_error&) {
            fail();
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          if (value == "true")
            *v = true;
          else if (value == "false")
            *v = false;
          else
            fail();
        } else {
          *v = value;
        }
      },
      f.ptr);
}

void walk(const toml::table& table, const std::string& prefix, ConfigSchema& schema,
          const std::string& where) {
  for (const auto& [k, node] : table) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table()) {
      MOETRAIN_CHECK(prefix.empty(), "{}unknown table [{}]; sections are {}", where, key,
                     schema.section_list());
      MOETRAIN_CHECK(schema.has_section(key), "{}unknown section [{}]; sections are {}", where, key,
                     schema.section_list());
      walk(*sub, key, schema, where);
    } else {
      MOETRAIN_CHECK(!prefix.empty(), "{}key '{}' must be inside a section ({})", where, key,
                     schema.section_list());
      set_from_toml(schema.find(key, where), node, where);
    }
  }
}

}  // namespace

ConfigSchema::ConfigSchema(std::vector<Field> fields) : fields_(std::move(fields)) {
  for (const auto& f : fields_) {
    std::string s = section_of(f.key);
    if (!has_section(s)) sections_.push_back(s);
  }
}

std::vector<std::string> ConfigSchema::keys() const {
  std::vector<std::string> out;
  for (const auto& f : fields_) out.push_back(f.key);
  return out;
}

bool ConfigSchema::has_section(const std::string& section) const {
  for (const auto& s : sections_)
    if (s == section) return true;
  return false;
}

std::string ConfigSchema::section_list() const {
  std::string out;
  for (const auto& s : sections_) out += (out.empty() ? "[" : ", [") + s + "]";
  return out;
}

std::string ConfigSchema::known_keys(const std::string& section) const {
  std::string out;
  for (const auto& f : fields_) {
    if (section.empty() || f.key.starts_with(section + "."))
      out += (out.empty() ? "" : ", ") + f.key;
  }
  return out;
}

Field& ConfigSchema::find(const std::string& key, const std::string& where) {
  for (auto& f : fields_)
    if (f.key == key) return f;
  if (auto near = nearest(key, keys()))
    MOETRAIN_FAIL("{}unknown key '{}'; did you mean '{}'? (moetrain config list shows every key)",
                  where, key, *near);
  const std::string section = section_of(key);
  if (has_section(section))
    MOETRAIN_FAIL("{}unknown key '{}'; the keys of [{}] are {}", where, key, section,
                  known_keys(section));
  MOETRAIN_FAIL(
      "{}unknown key '{}': no section [{}]; sections are {} (moetrain config list "
      "shows every key)",
      where, key, section, section_list());
}

namespace {

// Why `path` cannot be read as a config file, or "" when it is a readable regular file.
std::string unreadable_config(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return fmt::format("config file '{}' does not exist", path);
    return fmt::format("config file '{}' cannot be read: {}", path, std::strerror(err));
  }
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISFIFO(st.st_mode) ? "a pipe"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISREG(st.st_mode)  ? nullptr
                                            : "not a regular file";
  if (kind)
    return fmt::format(
        "config file '{}' is {}, not a file: pass a TOML file (e.g. "
        "configs/tiny.toml)",
        path, kind);
  if (!std::ifstream(path).good())
    return fmt::format("config file '{}' cannot be read: {}", path, std::strerror(errno));
  return "";
}

}  // namespace

void ConfigSchema::apply_toml_file(const std::string& path) {
  if (const std::string why = unreadable_config(path); !why.empty()) MOETRAIN_FAIL("{}", why);
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    MOETRAIN_FAIL("{}:{}:{}: TOML syntax error: {}", path, e.source().begin.line,
                  e.source().begin.column, e.description());
  }
  walk(table, "", *this, path + ": ");
  // A file that sets nothing (empty, or all comments) is most likely not the one meant.
  if (table.empty())
    log_warn("config file '{}' sets no key: every setting takes its default", path);
}

void ConfigSchema::apply_overrides(const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    MOETRAIN_CHECK(eq != std::string::npos && eq > 0,
                   "--set '{}': expected key=value, e.g. model.dim=256", o);
    set_from_string(find(o.substr(0, eq), "--set: "), o.substr(eq + 1));
  }
}

void ConfigSchema::apply_json(const nlohmann::json& j, const std::string& where) {
  MOETRAIN_CHECK(j.is_object(), "{}: the run configuration is not a JSON object", where);
  for (const auto& [section, table] : j.items()) {
    MOETRAIN_CHECK(table.is_object(), "{}: section '{}' is not an object", where, section);
    for (const auto& [name, value] : table.items()) {
      Field& f = find(section + "." + name, where + ": ");
      bool ok = std::visit(
          [&](auto& v) {
            using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
            if constexpr (std::is_same_v<T, Choice>) {
              if (!value.is_string()) return false;
              v.parse(value.get<std::string>());
              return true;
            } else if constexpr (std::is_same_v<T, double>) {
              if (!value.is_number()) return false;
            } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, uint64_t>) {
              if (!value.is_number_integer()) return false;
            } else if constexpr (std::is_same_v<T, bool>) {
              if (!value.is_boolean()) return false;
            } else {
              if (!value.is_string()) return false;
            }
            if constexpr (!std::is_same_v<T, Choice>) *v = value.get<T>();
            return true;
          },
          f.ptr);
      MOETRAIN_CHECK(ok, "{}: key '{}' must be {}", where, f.key, field_type_name(f.ptr));
    }
  }
}

nlohmann::json ConfigSchema::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& f : fields_) {
    std::string section = section_of(f.key);
    std::string name = f.key.substr(f.key.find('.') + 1);
    std::visit(
        [&](const auto& v) {
          if constexpr (std::is_same_v<std::decay_t<decltype(v)>, Choice>) {
            j[section][name] = v.name();
          } else {
            j[section][name] = *v;
          }
        },
        f.ptr);
  }
  return j;
}

}  // namespace moetrain

namespace moetrain {

nlohmann::json changed_from(const nlohmann::json& values, const nlohmann::json& defaults) {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [section, table] : values.items()) {
    if (!table.is_object()) continue;
    for (const auto& [name, value] : table.items()) {
      const bool same = defaults.contains(section) && defaults[section].contains(name) &&
                        defaults[section][name] == value;
      if (!same) out[section][name] = value;
    }
  }
  return out;
}

std::string ConfigSchema::describe(const std::string& section) const {
  if (!section.empty() && !has_section(section)) {
    std::string near;
    if (auto n = nearest(section, sections_)) near = fmt::format("did you mean '{}'? ", *n);
    MOETRAIN_FAIL("no section [{}]; {}sections are {}", section, near, section_list());
  }
  const nlohmann::json values = to_json();
  std::string out;
  std::string current;
  for (const auto& f : fields_) {
    const std::string s = section_of(f.key);
    if (!section.empty() && s != section) continue;
    if (s != current) {
      out += fmt::format("{}[{}]\n", out.empty() ? "" : "\n", s);
      current = s;
    }
    const std::string name = f.key.substr(f.key.find('.') + 1);
    std::string type = std::visit(
        [](const auto& v) -> std::string {
          using T = std::remove_pointer_t<std::decay_t<decltype(v)>>;
          if constexpr (std::is_same_v<T, int64_t>) return "integer";
          if constexpr (std::is_same_v<T, uint64_t>) return "integer ≥ 0";
          if constexpr (std::is_same_v<T, double>) return "number";
          if constexpr (std::is_same_v<T, bool>) return "true/false";
          return "string";
        },
        f.ptr);
    if (f.allowed) type += fmt::format(": {}", f.allowed);
    out += fmt::format("  {} = {}  ({})\n      {}\n", f.key, values[s][name].dump(), type, f.help);
  }
  return out;
}

}  // namespace moetrain
