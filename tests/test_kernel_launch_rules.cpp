// The launch protocol of core/launch.cuh, checked on the sources (a CPU test): with
// programmatic dependent launch a kernel may be placed before its predecessor has finished,
// so a kernel that read its inputs before device::start_after_previous_kernel() - or one
// launched with <<<>>> beside kernels that rely on every predecessor having waited - would
// race. A GPU test cannot show such a race reliably; the rule can be checked exactly.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch_test_macros.hpp>

namespace {

namespace fs = std::filesystem;

struct Source {
  std::string path;
  std::string text;  // comments blanked (same length, newlines kept)
};

// Line comments and block comments replaced by spaces, so that the prose that names
// "__global__" or "<<<" does not count.
std::string without_comments(const std::string& text) {
  std::string out = text;
  for (size_t i = 0; i + 1 < out.size(); ++i) {
    if (out[i] == '/' && out[i + 1] == '/') {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (out[i] == '/' && out[i + 1] == '*') {
      while (i + 1 < out.size() && !(out[i] == '*' && out[i + 1] == '/')) {
        if (out[i] != '\n') out[i] = ' ';
        ++i;
      }
      if (i + 1 < out.size()) out[i] = out[i + 1] = ' ';
    } else if (out[i] == '"') {  // string literals: skip to the closing quote
      for (++i; i < out.size() && out[i] != '"'; ++i)
        if (out[i] == '\\') ++i;
    }
  }
  return out;
}

std::vector<Source> device_sources() {
  std::vector<Source> sources;
  for (const char* dir : {"core", "layers", "optim", "parallel"}) {
    for (const auto& entry : fs::directory_iterator(fs::path(FP8LM_SOURCE_DIR) / dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cu" && ext != ".cuh") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      sources.push_back({entry.path().lexically_relative(FP8LM_SOURCE_DIR).string(), without_comments(text.str())});
    }
  }
  return sources;
}

int line_of(const std::string& text, size_t at) {
  return 1 + int(std::count(text.begin(), text.begin() + std::ptrdiff_t(at), '\n'));
}

}  // namespace

TEST_CASE("every kernel launches through launch_kernel and waits for its predecessor first", "[launch]") {
  const std::vector<Source> sources = device_sources();
  REQUIRE(sources.size() > 10);
  int kernels = 0;
  for (const Source& source : sources) {
    const std::string& t = source.text;
    for (size_t at = t.find("<<<"); at != std::string::npos; at = t.find("<<<", at + 3)) {
      INFO(source.path << ":" << line_of(t, at) << ": a <<<>>> launch; use launch_kernel (core/launch.cuh)");
      CHECK(false);
    }
    if (source.path == "core/launch.cuh") continue;
    for (size_t at = t.find("__global__"); at != std::string::npos; at = t.find("__global__", at + 10)) {
      // The body's opening brace: the first '{' outside parentheses (a ';' first is a declaration).
      int depth = 0;
      size_t k = at;
      for (; k < t.size(); ++k) {
        if (t[k] == '(') ++depth;
        if (t[k] == ')') --depth;
        if (depth == 0 && (t[k] == '{' || t[k] == ';')) break;
      }
      REQUIRE(k < t.size());
      if (t[k] == ';') continue;
      ++kernels;
      const size_t first = t.find_first_not_of(" \t\n", k + 1);
      const std::string statement = "device::start_after_previous_kernel();";
      INFO(source.path << ":" << line_of(t, at) << ": the kernel's first statement must be " << statement);
      CHECK(t.compare(first, statement.size(), statement) == 0);
    }
  }
  // The count guards the scan itself: a parser that found no kernels would pass vacuously.
  CHECK(kernels >= 50);
}
