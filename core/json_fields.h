// Typed reads of a parsed JSON object whose errors name the file and the key.
//
// nlohmann's own exceptions ("[json.exception.type_error.302] type must be number, but is
// string") name neither, so every reader of a user's file (a GPT config, a checkpoint's
// state.json) goes through JsonFields: a wrong type, a missing key or a value out of range
// is an InputError "FILE: "KEY" must be ..., got VALUE".
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace fp8lm {

class JsonFields {
 public:
  // `source` names the file (or flags) in errors; `prefix` the enclosing keys ("data_position.").
  JsonFields(const nlohmann::json& object, std::string source, std::string prefix = {})
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {
    if (!object_.is_object())
      throw InputError(source_ + ": " + (prefix_.empty() ? std::string("the top level") : quoted_prefix()) +
                       " must be a JSON object, got " + excerpt(object_));
  }

  const std::string& source() const { return source_; }
  const nlohmann::json& json() const { return object_; }

  // Present with a value other than null.
  bool has(std::string_view key) const {
    const auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }

  // The value of a required key as T: an integer type (range-checked against T and
  // [min, max]), double, bool or std::string.
  template <typename T>
  T get(std::string_view key, T min = lowest<T>(), T max = highest<T>()) const {
    if (!has(key)) missing(key);
    return convert<T>(key, object_.at(std::string(key)), min, max);
  }

  // The value of an optional key, or `fallback` when it is absent or null.
  template <typename T>
  T get_or(std::string_view key, T fallback, T min = lowest<T>(), T max = highest<T>()) const {
    return has(key) ? convert<T>(key, object_.at(std::string(key)), min, max) : fallback;
  }

  // A nested object (required): its errors name "outer.inner".
  JsonFields object(std::string_view key) const {
    if (!has(key)) missing(key);
    const nlohmann::json& value = object_.at(std::string(key));
    if (!value.is_object()) fail(key, "must be a JSON object, got " + excerpt(value));
    return JsonFields(value, source_, prefix_ + std::string(key) + ".");
  }

  [[noreturn]] void missing(std::string_view key) const {
    throw InputError(source_ + ": missing required key \"" + prefix_ + std::string(key) + "\"");
  }
  [[noreturn]] void fail(std::string_view key, const std::string& problem) const {
    throw InputError(source_ + ": \"" + prefix_ + std::string(key) + "\" " + problem);
  }

 private:
  template <typename T>
  static constexpr T lowest() {
    if constexpr (std::is_arithmetic_v<T>) return std::numeric_limits<T>::lowest();
    else return T{};
  }
  template <typename T>
  static constexpr T highest() {
    if constexpr (std::is_arithmetic_v<T>) return std::numeric_limits<T>::max();
    else return T{};
  }

  // A value as it appears in the file, shortened: enough to recognise it.
  static std::string excerpt(const nlohmann::json& value) {
    std::string text = value.dump();
    if (text.size() > 60) text = text.substr(0, 57) + "...";
    return text;
  }
  std::string quoted_prefix() const {
    std::string quoted(1, '"');
    quoted.append(prefix_, 0, prefix_.size() - 1).append(1, '"');
    return quoted;
  }

  template <typename T>
  T convert(std::string_view key, const nlohmann::json& value, T min, T max) const {
    if constexpr (std::is_same_v<T, bool>) {
      if (!value.is_boolean()) fail(key, "must be true or false, got " + excerpt(value));
      return value.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
      // JSON integers arrive as int64 or uint64; a float such as 3.0 or 1e3 is not an integer.
      if (!value.is_number_integer()) fail(key, "must be an integer, got " + excerpt(value));
      const bool in_range = value.is_number_unsigned()
                                ? value.get<uint64_t>() <= uint64_t(max) && (min <= 0 || value.get<uint64_t>() >= uint64_t(min))
                                : in_signed_range(value.get<int64_t>(), min, max);
      if (!in_range)
        fail(key, "must be an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "], got " +
                      excerpt(value));
      return static_cast<T>(value.is_number_unsigned() ? value.get<uint64_t>() : uint64_t(value.get<int64_t>()));
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!value.is_number()) fail(key, "must be a number, got " + excerpt(value));
      const T number = value.get<T>();
      if (!(number >= min && number <= max))
        fail(key, "must be a number in [" + nlohmann::json(min).dump() + ", " + nlohmann::json(max).dump() +
                      "], got " + excerpt(value));
      return number;
    } else {
      static_assert(std::is_same_v<T, std::string>, "JsonFields reads integers, numbers, booleans and strings");
      if (!value.is_string()) fail(key, "must be a string, got " + excerpt(value));
      return value.get<std::string>();
    }
  }

  template <typename T>
  static bool in_signed_range(int64_t value, T min, T max) {
    if (value < 0 && std::is_unsigned_v<T>) return false;
    if constexpr (std::is_unsigned_v<T>) return uint64_t(value) >= uint64_t(min) && uint64_t(value) <= uint64_t(max);
    else return value >= int64_t(min) && value <= int64_t(max);
  }

  const nlohmann::json& object_;
  std::string source_;
  std::string prefix_;
};

}  // namespace fp8lm
