// A small, portable random source: the same numbers on every platform and standard
// library (std::normal_distribution is not specified bit-exactly), so parameter
// initialisation and anything seeded is reproducible across machines.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace fp8lm {

// SplitMix64's counter increment (2^64 / the golden ratio, odd).
inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;

// SplitMix64's output for one counter value.
FP8LM_HOST_DEVICE inline uint64_t hash64(uint64_t counter) {
  uint64_t z = counter + kGoldenGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Number `index` (0: the first) of Random(seed), without drawing the ones before it.
FP8LM_HOST_DEVICE inline uint64_t random_number_at(uint64_t seed, uint64_t index) {
  return hash64(seed + index * kGoldenGamma);
}

// Uniform in [0, 1) with 53 random bits of `bits`.
FP8LM_HOST_DEVICE inline double uniform_of(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// A standard normal from two uniforms, u1 in (0, 1): one of Box-Muller's pair.
inline double normal_of(double u1, double u2) {
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// SplitMix64: a 64-bit mixer with a full-period counter. Good statistical quality for
// initialisation and test data; not cryptographic.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}

  // A UniformRandomBitGenerator too, for uniform_below() and the like.
  using result_type = uint64_t;
  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t{0}; }
  uint64_t operator()() { return next_u64(); }

  uint64_t next_u64() {
    const uint64_t z = hash64(state_);
    state_ += kGoldenGamma;
    return z;
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return uniform_of(next_u64()); }
  // Standard normal by Box-Muller (one of the pair; simple beats fast here).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    return normal_of(u1, uniform());
  }

 private:
  uint64_t state_;
};

}  // namespace fp8lm
