#include <catch2/catch_test_macros.hpp>
#include "core/fp8.h"
TEST_CASE("placeholder fp8", "[fp8]") { REQUIRE(fp8lm::fp8_max(fp8lm::Fp8Dtype::e4m3) == 448.0f); }
