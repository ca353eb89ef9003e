// The parameter table (core/params.hpp): strict parsers, EngineConfig::set/get, namespaced
// options (unknown keys and namespaces rejected naming the key), variables over code, and the
// listing holding every parameter.
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

#include "core/log.hpp"
#include "core/params.hpp"
#include "sluice/engine.hpp"
#include "sluice/error.hpp"

using namespace sluice;
using namespace sluice::detail;

namespace {

// A namespace of this test binary's own, so that option handling is tested whatever
// transports the build has.
const Param<int> kKnob{"ptest.knob", "SLUICE_PTEST_KNOB", 7, int_in(1, 100), "params_test: an engine option"};
const Param<bool> kFlag{"ptest.flag", "SLUICE_PTEST_FLAG", false, boolean(), "params_test: a bool option"};
const Param<uint64_t> kEnvOnly{"ptest.env_only", "SLUICE_PTEST_ENV_ONLY", 4096, size_in(1, 1 << 20),
                               "params_test: a test-only knob", ParamScope::kTest};

const char* kTestVars[] = {"SLUICE_PTEST_KNOB", "SLUICE_PTEST_FLAG", "SLUICE_PTEST_ENV_ONLY", "SLUICE_CHANNELS",
                           "SLUICE_IB_GID_INDEX", "SLUICE_IB_HCA", "SLUICE_CHUNK_SIZE"};

class Params : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto v : kTestVars) ::unsetenv(v);
  }
  void TearDown() override {
    for (auto v : kTestVars) ::unsetenv(v);
  }
};

// Runs fn, expects Error(kInvalidArgument) whose message contains every one of `names`.
template <class Fn>
void expect_invalid(Fn fn, std::initializer_list<const char*> names, const char* what) {
  try {
    fn();
    ADD_FAILURE() << what << ": accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << what << ": " << e.what();
    for (const char* n : names)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << what << ": '" << n << "' not in: " << e.what();
  }
}

}  // namespace

TEST_F(Params, StrictParsers) {
  EXPECT_EQ(parse_size("x", "0"), 0u);
  EXPECT_EQ(parse_size("x", "4k"), 4096u);
  EXPECT_EQ(parse_size("x", "3M"), 3ull << 20);
  EXPECT_EQ(parse_size("x", "2G"), 2ull << 30);
  EXPECT_EQ(parse_size("x", "18446744073709551615"), UINT64_MAX);
  for (const char* bad : {"", "k", "-1", " 1", "1 ", "1.5", "0x10", "1KB", "4T", "18446744073709551616", "99999999999G"})
    expect_invalid([&] { parse_size("SLUICE_X", bad); }, {"SLUICE_X"}, bad);
  EXPECT_EQ(parse_int("x", "-1"), -1);
  EXPECT_EQ(parse_int("x", "42"), 42);
  for (const char* bad : {"", "+1", "1k", "--1", "1e3", "99999999999999999999"})
    expect_invalid([&] { parse_int("SLUICE_Y", bad); }, {"SLUICE_Y"}, bad);
  for (const char* t : {"1", "true", "yes", "on"}) EXPECT_TRUE(parse_bool("b", t)) << t;
  for (const char* f : {"0", "false", "no", "off"}) EXPECT_FALSE(parse_bool("b", f)) << f;
  for (const char* bad : {"", "2", "TRUE", "y", "enable"}) expect_invalid([&] { parse_bool("SLUICE_B", bad); }, {"SLUICE_B"}, bad);
  EXPECT_EQ(int_in(-1, 5)("w", "5"), 5);
  expect_invalid([] { int_in(-1, 5)("w", "6"); }, {"w", "-1..5"}, "int_in above");
  expect_invalid([] { int_in(-1, 5)("w", "-2"); }, {"w"}, "int_in below");
  expect_invalid([] { size_in(4096, 1 << 20)("w", "4095"); }, {"w", "4096"}, "size_in below");
  EXPECT_EQ(size_in(4096, 1 << 20)("w", "1M"), 1u << 20);
}

TEST_F(Params, SetAndGetEveryField) {
  // Every engine-scoped parameter: its default parses back through set() (so that
  // list_params, the log and set() agree), and get() of a fresh config is the default.
  int fields = 0;
  for (const ParamSpec* p : param_table()) {
    if (p->scope != ParamScope::kEngine) continue;
    EngineConfig c;
    EXPECT_EQ(c.get(p->name), p->default_text) << p->name;
    EXPECT_NO_THROW(c.set(p->name, p->default_text)) << p->name << "='" << p->default_text << "'";
    EXPECT_EQ(c.get(p->name), p->default_text) << p->name;
    fields += p->name.find('.') == std::string::npos;
  }
  EXPECT_GE(fields, 17);
  EngineConfig c;
  c.set("channels", "5").set("chunk_size", "8M").set("listen", "0.0.0.0:4567").set("connect_timeout_ms", "250");
  c.set("transports", "tcp, shm").set("log_level", "debug").set("busy_wait_us", "-1").set("recv_timeout_ms", "0");
  EXPECT_EQ(c.channels, 5);
  EXPECT_EQ(c.chunk_size, 8ull << 20);
  EXPECT_EQ(c.listen_host, "0.0.0.0");
  EXPECT_EQ(c.listen_port, 4567);
  EXPECT_EQ(c.connect_timeout, std::chrono::milliseconds(250));
  EXPECT_EQ(c.transports, (std::vector<std::string>{"tcp", "shm"}));
  EXPECT_EQ(c.log_level, LogLevel::kDebug);
  EXPECT_EQ(c.get("listen"), "0.0.0.0:4567");
  EXPECT_EQ(c.get("transports"), "tcp,shm");
  c.set("ptest.knob", "9");
  EXPECT_EQ(c.options.at("ptest.knob"), "9");
  EXPECT_EQ(kKnob.get(c), 9);
  EXPECT_EQ(c.get("ptest.knob"), "9");
  EXPECT_EQ(kFlag.get(c), false);  // not set: the default
}

TEST_F(Params, SetRejectsBadValuesNamingTheKey) {
  EngineConfig c;
  expect_invalid([&] { c.set("channels", "0"); }, {"channels"}, "channels 0");
  expect_invalid([&] { c.set("channels", "2.0"); }, {"channels"}, "channels 2.0");
  expect_invalid([&] { c.set("chunk_size", "1k"); }, {"chunk_size"}, "chunk_size 1k");
  expect_invalid([&] { c.set("op_timeout_ms", "0"); }, {"op_timeout_ms"}, "op_timeout 0");
  expect_invalid([&] { c.set("op_timeout_ms", "5s"); }, {"op_timeout_ms"}, "op_timeout 5s");
  expect_invalid([&] { c.set("log_level", "loud"); }, {"log_level"}, "log_level");
  expect_invalid([&] { c.set("listen", "nohostport"); }, {"listen"}, "listen");
  expect_invalid([&] { c.set("busy_wait_us", "-2"); }, {"busy_wait_us"}, "busy_wait_us");
  expect_invalid([&] { c.set("ptest.knob", "101"); }, {"ptest.knob"}, "ptest.knob");
  expect_invalid([&] { c.set("ptest.flag", "maybe"); }, {"ptest.flag"}, "ptest.flag");
  EXPECT_EQ(c.channels, EngineConfig{}.channels) << "a rejected set() changed the config";
  EXPECT_TRUE(c.options.empty()) << "a rejected option was stored";
}

TEST_F(Params, UnknownKeysAndNamespacesAreRejected) {
  EngineConfig c;
  expect_invalid([&] { c.set("chanels", "2"); }, {"chanels"}, "unknown field");
  expect_invalid([&] { c.set("ptest.knobb", "2"); }, {"ptest.knobb", "ptest.knob"}, "unknown key in a known namespace");
  expect_invalid([&] { c.set("warp.drive", "9"); }, {"warp.drive", "namespace"}, "unknown namespace");
  expect_invalid([&] { c.get("warp.drive"); }, {"warp.drive"}, "get of an unknown namespace");
  // The same through the options map, checked when the config is resolved (as Engine does).
  for (auto [key, why] : {std::pair{"ptest.knobb", "unknown key"}, {"warp.drive", "unknown namespace"},
                         {"channels", "a field in options"}, {"", "empty key"}}) {
    EngineConfig o;
    o.options[key] = "1";
    expect_invalid([&] { EngineConfig::from_env(o); }, {key}, why);
  }
  EngineConfig bad_value;
  bad_value.options["ptest.knob"] = "lots";
  expect_invalid([&] { EngineConfig::from_env(bad_value); }, {"ptest.knob"}, "bad option value");
  // Knobs read from the environment where they are used are not config keys.
  expect_invalid([&] { c.set("ptest.env_only", "1"); }, {"ptest.env_only", "SLUICE_PTEST_ENV_ONLY"}, "env-only knob");
  // The engine resolves its config: an unknown option stops it before anything starts.
  EngineConfig e;
  e.transports = {"tcp"};
  e.options["warp.drive"] = "9";
  expect_invalid([&] { Engine engine(e); }, {"warp.drive"}, "engine with an unknown option");
}

TEST_F(Params, VariablesOverrideCodeAndNameThemselves) {
  EngineConfig c;
  c.channels = 3;
  c.options["ptest.knob"] = "11";
  auto r = EngineConfig::from_env(c);
  EXPECT_EQ(r.channels, 3);
  EXPECT_EQ(kKnob.get(r), 11);
  ::setenv("SLUICE_CHANNELS", "9", 1);
  ::setenv("SLUICE_PTEST_KNOB", "42", 1);
  ::setenv("SLUICE_PTEST_FLAG", "on", 1);
  r = EngineConfig::from_env(c);
  EXPECT_EQ(r.channels, 9);
  EXPECT_EQ(kKnob.get(r), 42);
  EXPECT_TRUE(kFlag.get(r));
  EXPECT_EQ(kKnob.get(c), 11) << "the caller's config changed";
  // Values are read at resolution, never cached: a later change is seen by the next engine.
  ::setenv("SLUICE_PTEST_KNOB", "43", 1);
  EXPECT_EQ(kKnob.get(EngineConfig::from_env(c)), 43);
  EXPECT_EQ(kKnob.get(r), 42);
  ::setenv("SLUICE_PTEST_KNOB", "0", 1);
  expect_invalid([&] { EngineConfig::from_env(c); }, {"SLUICE_PTEST_KNOB"}, "bad variable");
  ::unsetenv("SLUICE_PTEST_KNOB");
  // Empty means unset.
  ::setenv("SLUICE_PTEST_KNOB", "", 1);
  EXPECT_EQ(kKnob.get(EngineConfig::from_env(c)), 11);
  // A test-only knob is read where it is used, at that time.
  EXPECT_EQ(kEnvOnly.read(), 4096u);
  ::setenv("SLUICE_PTEST_ENV_ONLY", "64k", 1);
  EXPECT_EQ(kEnvOnly.read(), 64u << 10);
  ::setenv("SLUICE_PTEST_ENV_ONLY", "64kk", 1);
  expect_invalid([&] { kEnvOnly.read(); }, {"SLUICE_PTEST_ENV_ONLY"}, "bad env-only knob");
}

TEST_F(Params, FieldsSetFromCodePassTheSameBounds) {
  for (auto [set, name] : std::initializer_list<std::pair<void (*)(EngineConfig&), const char*>>{
           {[](EngineConfig& c) { c.channels = 65; }, "channels"},
           {[](EngineConfig& c) { c.chunk_size = 100; }, "chunk_size"},
           {[](EngineConfig& c) { c.max_handshake_bytes = 2ull << 30; }, "max_handshake_bytes"},
           {[](EngineConfig& c) { c.max_handshakes = 0; }, "max_handshakes"},
           {[](EngineConfig& c) { c.busy_wait_us = -5; }, "busy_wait_us"},
           {[](EngineConfig& c) { c.op_timeout = std::chrono::milliseconds(-1); }, "op_timeout_ms"},
       }) {
    EngineConfig c;
    set(c);
    expect_invalid([&] { EngineConfig::from_env(c); }, {name}, name);
  }
}

TEST_F(Params, RdmaOptionsAreParamsOfRdma) {
  if (!find_param("rdma.hca")) GTEST_SKIP() << "the rdma transport is not in this build";
  EngineConfig c;
  c.options["rdma.hca"] = "=mlx5_0,mlx5_1:1";
  c.options["rdma.gid_index"] = "3";
  auto r = EngineConfig::from_env(c);
  EXPECT_EQ(r.get("rdma.hca"), "=mlx5_0,mlx5_1:1");
  EXPECT_EQ(r.get("rdma.gid_index"), "3");
  ::setenv("SLUICE_IB_GID_INDEX", "5", 1);
  ::setenv("SLUICE_IB_HCA", "mlx5", 1);
  r = EngineConfig::from_env(c);
  EXPECT_EQ(r.get("rdma.gid_index"), "5");
  EXPECT_EQ(r.get("rdma.hca"), "mlx5");
  ::setenv("SLUICE_IB_GID_INDEX", "70000", 1);
  expect_invalid([&] { EngineConfig::from_env(c); }, {"SLUICE_IB_GID_INDEX"}, "gid index out of range");
  ::unsetenv("SLUICE_IB_GID_INDEX");
  ::setenv("SLUICE_IB_HCA", "^", 1);
  expect_invalid([&] { EngineConfig::from_env(c); }, {"SLUICE_IB_HCA"}, "malformed hca variable");
  ::unsetenv("SLUICE_IB_HCA");
  c.options["rdma.hca"] = "=mlx5_0,";
  expect_invalid([&] { EngineConfig::from_env(c); }, {"rdma.hca"}, "malformed hca option");
  c.options.erase("rdma.hca");
  c.options["rdma.gid_index"] = "x";
  expect_invalid([&] { EngineConfig::from_env(c); }, {"rdma.gid_index"}, "bad gid index option");
  EngineConfig t;
  expect_invalid([&] { t.set("rdma.fault_rkey_xor", "1"); }, {"SLUICE_RDMA_FAULT_RKEY_XOR"}, "fault knob as option");
}

TEST_F(Params, ListHoldsEveryParameter) {
  auto list = list_params();
  std::set<std::string> names, envs;
  for (const auto& p : list) {
    EXPECT_TRUE(names.insert(p.name).second) << "declared twice: " << p.name;
    EXPECT_TRUE(envs.insert(p.env).second) << "variable used twice: " << p.env;
    EXPECT_EQ(p.env.rfind("SLUICE_", 0), 0u) << p.name << ": " << p.env;
    EXPECT_FALSE(p.doc.empty()) << p.name;
    EXPECT_TRUE(p.scope == "engine" || p.scope == "process" || p.scope == "test") << p.name << ": " << p.scope;
  }
  EXPECT_TRUE(std::is_sorted(list.begin(), list.end(), [](auto& a, auto& b) { return a.name < b.name; }));
  // Every variable EngineConfig::from_env read before the table, and this file's own.
  for (const char* env :
       {"SLUICE_TRANSPORTS", "SLUICE_CHANNELS", "SLUICE_LISTEN", "SLUICE_HOST_ID", "SLUICE_CONNECT_TIMEOUT_MS",
        "SLUICE_OP_TIMEOUT_MS", "SLUICE_RECV_TIMEOUT_MS", "SLUICE_CHUNK_SIZE", "SLUICE_STRIPE_THRESHOLD",
        "SLUICE_MAX_UNEXPECTED_BYTES", "SLUICE_MAX_UNEXPECTED_MESSAGES", "SLUICE_MAX_HANDSHAKES",
        "SLUICE_MAX_HANDSHAKE_BYTES", "SLUICE_MAX_PENDING_ACCEPTS", "SLUICE_MAX_QUEUED_RESPONSES",
        "SLUICE_BUSY_WAIT_US", "SLUICE_LOG_LEVEL", "SLUICE_PTEST_KNOB", "SLUICE_PTEST_ENV_ONLY"})
    EXPECT_TRUE(envs.count(env)) << env << " is not in the table";
  // The transports' own, where the build has them.
  if (find_param("rdma.hca")) {
    for (const char* env : {"SLUICE_IB_HCA", "SLUICE_IB_GID_INDEX", "SLUICE_RDMA_SPIN_US", "SLUICE_RDMA_BUSY_MS",
                            "SLUICE_RDMA_POLL_US", "SLUICE_RDMA_MAX_WR_BYTES", "SLUICE_RDMA_MAX_SGE",
                            "SLUICE_RDMA_FAULT_RKEY_XOR", "SLUICE_IBVERBS_LIB"})
      EXPECT_TRUE(envs.count(env)) << env << " is not in the table";
  }
  if (find_param("nvlink.streams")) {
    for (const char* env : {"SLUICE_NVLINK_SM_COPY_MAX", "SLUICE_NVLINK_STREAMS", "SLUICE_NVLINK_SPLIT_MIN",
                            "SLUICE_NVLINK_INLINE_MAX", "SLUICE_NVLINK_DISABLE", "SLUICE_CUDA_NO_VMM",
                            "SLUICE_AG_LL_MAX"})
      EXPECT_TRUE(envs.count(env)) << env << " is not in the table";
  }
}

TEST_F(Params, EffectiveValuesAreLoggedAtInfo) {
  EngineConfig c;
  c.channels = 4;
  c.options["ptest.knob"] = "12";
  log::set_level(LogLevel::kInfo);
  ::testing::internal::CaptureStderr();
  log_params(c);
  std::string out = ::testing::internal::GetCapturedStderr();
  log::set_level(LogLevel::kWarn);
  EXPECT_NE(out.find("param channels = '4' [SLUICE_CHANNELS]"), std::string::npos) << out;
  EXPECT_NE(out.find("param ptest.knob = '12' [SLUICE_PTEST_KNOB]"), std::string::npos) << out;
  EXPECT_NE(out.find("param ptest.flag = 'false' (default)"), std::string::npos) << out;
  for (const ParamSpec* p : param_table())
    EXPECT_NE(out.find("param " + p->name + " = "), std::string::npos) << p->name << " not logged";
  // Not at warn.
  ::testing::internal::CaptureStderr();
  log_params(c);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}
