// expect_error(f, code, needle): f throws sluice::Error with that code and a message containing
// needle (the tests' way of checking that a refusal says what was wrong).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "sluice/error.hpp"

namespace sluice::test {

template <typename F>
void expect_error(F&& f, ErrorCode code, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace sluice::test
