// EngineConfig::from_env: every SLUICE_* variable, and bad values rejected naming the variable.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "sluice/config.hpp"
#include "sluice/error.hpp"
#include "sluice/types.hpp"

using namespace sluice;
using namespace std::chrono_literals;

namespace {

const char* kVars[] = {"SLUICE_TRANSPORTS",        "SLUICE_CHANNELS",     "SLUICE_LISTEN",
                       "SLUICE_HOST_ID",           "SLUICE_CONNECT_TIMEOUT_MS", "SLUICE_OP_TIMEOUT_MS",
                       "SLUICE_CHUNK_SIZE",        "SLUICE_STRIPE_THRESHOLD",   "SLUICE_MAX_UNEXPECTED_BYTES",
                       "SLUICE_LOG_LEVEL",         "SLUICE_IB_HCA",             "SLUICE_IB_GID_INDEX"};

class FromEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto v : kVars) ::unsetenv(v);
  }
  void TearDown() override {
    for (auto v : kVars) ::unsetenv(v);
  }
  // Sets var=value and expects from_env to throw kInvalidArgument with the variable named.
  void expect_rejected(const char* var, const char* value) {
    ::setenv(var, value, 1);
    try {
      EngineConfig::from_env(EngineConfig{});
      ADD_FAILURE() << var << "='" << value << "' was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << var << "=" << value;
      EXPECT_NE(std::string(e.what()).find(var), std::string::npos)
          << var << "='" << value << "': message does not name the variable: " << e.what();
    }
    ::unsetenv(var);
  }
};

}  // namespace

TEST_F(FromEnv, NothingSetKeepsBase) {
  EngineConfig base;
  base.channels = 7;
  base.transports = {"tcp"};
  base.op_timeout = 1234ms;
  auto c = EngineConfig::from_env(base);
  EXPECT_EQ(c.channels, 7);
  EXPECT_EQ(c.transports, std::vector<std::string>{"tcp"});
  EXPECT_EQ(c.op_timeout, 1234ms);
  EXPECT_EQ(c.chunk_size, base.chunk_size);
  // Empty values count as unset.
  ::setenv("SLUICE_CHANNELS", "", 1);
  EXPECT_EQ(EngineConfig::from_env(base).channels, 7);
}

TEST_F(FromEnv, ParsesEveryVariable) {
  ::setenv("SLUICE_TRANSPORTS", "tcp, shm,,", 1);
  ::setenv("SLUICE_CHANNELS", "5", 1);
  ::setenv("SLUICE_LISTEN", "0.0.0.0:4567", 1);
  ::setenv("SLUICE_HOST_ID", "myhost", 1);
  ::setenv("SLUICE_CONNECT_TIMEOUT_MS", "250", 1);
  ::setenv("SLUICE_OP_TIMEOUT_MS", "1500", 1);
  ::setenv("SLUICE_CHUNK_SIZE", "8M", 1);
  ::setenv("SLUICE_STRIPE_THRESHOLD", "64k", 1);
  ::setenv("SLUICE_MAX_UNEXPECTED_BYTES", "1G", 1);
  ::setenv("SLUICE_LOG_LEVEL", "debug", 1);
  auto c = EngineConfig::from_env(EngineConfig{});
  EXPECT_EQ(c.transports, (std::vector<std::string>{"tcp", "shm"}));
  EXPECT_EQ(c.channels, 5);
  EXPECT_EQ(c.listen_host, "0.0.0.0");
  EXPECT_EQ(c.listen_port, 4567);
  EXPECT_EQ(c.host_id, "myhost");
  EXPECT_EQ(c.connect_timeout, 250ms);
  EXPECT_EQ(c.op_timeout, 1500ms);
  EXPECT_EQ(c.chunk_size, 8ull << 20);
  EXPECT_EQ(c.stripe_threshold, 64ull << 10);
  EXPECT_EQ(c.max_unexpected_bytes, 1ull << 30);
  EXPECT_EQ(c.log_level, LogLevel::kDebug);
  for (auto [text, lvl] : {std::pair{"error", LogLevel::kError}, {"warn", LogLevel::kWarn}, {"warning", LogLevel::kWarn},
                          {"info", LogLevel::kInfo}, {"trace", LogLevel::kTrace}}) {
    ::setenv("SLUICE_LOG_LEVEL", text, 1);
    EXPECT_EQ(EngineConfig::from_env(EngineConfig{}).log_level, lvl) << text;
  }
}

TEST_F(FromEnv, EnvOverridesBase) {
  EngineConfig base;
  base.channels = 3;
  ::setenv("SLUICE_CHANNELS", "9", 1);
  EXPECT_EQ(EngineConfig::from_env(base).channels, 9);
  EXPECT_EQ(env_config().channels, 9);
}

TEST_F(FromEnv, BadValuesNameTheVariable) {
  expect_rejected("SLUICE_CHANNELS", "two");
  expect_rejected("SLUICE_CHANNELS", "0");
  expect_rejected("SLUICE_CHANNELS", "65");
  expect_rejected("SLUICE_CHANNELS", "-1");
  expect_rejected("SLUICE_CHANNELS", "4294967297");  // would wrap to 1 in an int
  expect_rejected("SLUICE_CHANNELS", "3x");
  expect_rejected("SLUICE_LISTEN", "nohostport");
  expect_rejected("SLUICE_LISTEN", "host:port");
  expect_rejected("SLUICE_LISTEN", "host:70000");
  expect_rejected("SLUICE_LISTEN", "host:");
  expect_rejected("SLUICE_CONNECT_TIMEOUT_MS", "soon");
  expect_rejected("SLUICE_CONNECT_TIMEOUT_MS", "1.5");
  expect_rejected("SLUICE_OP_TIMEOUT_MS", "-5");
  expect_rejected("SLUICE_OP_TIMEOUT_MS", "10 ms");
  expect_rejected("SLUICE_CHUNK_SIZE", "big");
  expect_rejected("SLUICE_CHUNK_SIZE", "M");
  expect_rejected("SLUICE_CHUNK_SIZE", "100");          // below the 4096 minimum
  expect_rejected("SLUICE_CHUNK_SIZE", "99999999999G");  // overflows 64 bits
  expect_rejected("SLUICE_STRIPE_THRESHOLD", "4T");
  expect_rejected("SLUICE_MAX_UNEXPECTED_BYTES", "lots");
  expect_rejected("SLUICE_MAX_UNEXPECTED_BYTES", "18446744073709551616");
  expect_rejected("SLUICE_LOG_LEVEL", "verbose");
  expect_rejected("SLUICE_LOG_LEVEL", "DEBUG ");
}

TEST(Location, Parse) {
  EXPECT_EQ(Location::parse("host"), Location::host());
  EXPECT_EQ(Location::parse("cpu"), Location::host());
  EXPECT_EQ(Location::parse("cuda"), Location::cuda(0));
  EXPECT_EQ(Location::parse("cuda:0"), Location::cuda(0));
  EXPECT_EQ(Location::parse("cuda:13"), Location::cuda(13));
  EXPECT_TRUE(Location::parse("host").is_host());
  EXPECT_FALSE(Location::parse("cuda:1").is_host());
  for (const char* bad : {"", "HOST", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:1 ", " host", "cuda::1",
                          "cuda:99999999999"}) {
    try {
      Location::parse(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << bad;
    }
  }
  // to_string round trips.
  for (auto loc : {Location::host(), Location::cuda(0), Location::cuda(7)})
    EXPECT_EQ(Location::parse(loc.to_string()), loc);
}

TEST(ErrorType, CarriesCodeAndMessage) {
  Error e(ErrorCode::kOutOfRange, "region 3: too far");
  EXPECT_EQ(e.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(std::string(e.what()).find("region 3: too far"), std::string::npos);
  EXPECT_EQ(e.status().code, ErrorCode::kOutOfRange);
  EXPECT_FALSE(to_string(ErrorCode::kPeerLost).empty());
  EXPECT_NE(to_string(ErrorCode::kPeerLost), to_string(ErrorCode::kTimeout));
}
