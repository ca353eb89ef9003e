// Directory URLs (EngineConfig::directory, SLUICE_DIRECTORY) and engine names: what parses,
// what is refused with which message, and the error of a backend this build lacks.
#include <gtest/gtest.h>

#include <cstdlib>

#include "directory/directory_url.hpp"
#include "directory/store_directory.hpp"
#include "sluice/sluice.hpp"

namespace sluice::detail {
namespace {

std::string error_of(const std::function<void()>& fn, ErrorCode want) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), want) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TEST(DirectoryUrl, EmptyIsTheListenerDirectory) {
  EXPECT_EQ(parse_directory_url("").kind, DirectoryUrl::Kind::kListener);
  EXPECT_EQ(parse_directory_url("listener").kind, DirectoryUrl::Kind::kListener);
}

TEST(DirectoryUrl, EtcdEndpointsAndPrefix) {
  auto d = parse_directory_url("etcd://h1:2379,10.0.0.2:12379/cluster/a/");
  EXPECT_EQ(d.kind, DirectoryUrl::Kind::kEtcd);
  ASSERT_EQ(d.endpoints.size(), 2u);
  EXPECT_EQ(d.endpoints[0], std::make_pair(std::string("h1"), uint16_t(2379)));
  EXPECT_EQ(d.endpoints[1], std::make_pair(std::string("10.0.0.2"), uint16_t(12379)));
  EXPECT_EQ(d.prefix, "cluster/a");
  auto plain = parse_directory_url("etcd://etcdhost");
  EXPECT_EQ(plain.endpoints[0].second, 2379);
  EXPECT_EQ(plain.prefix, "sluice");
}

TEST(DirectoryUrl, RedisDbPasswordAndPrefix) {
  auto d = parse_directory_url("redis://:s3cret@r:6380/3?prefix=kv");
  EXPECT_EQ(d.kind, DirectoryUrl::Kind::kRedis);
  EXPECT_EQ(d.endpoints[0], std::make_pair(std::string("r"), uint16_t(6380)));
  EXPECT_EQ(d.db, 3);
  EXPECT_EQ(d.password, "s3cret");
  EXPECT_EQ(d.prefix, "kv");
  // The password is never in what messages print.
  EXPECT_EQ(d.display.find("s3cret"), std::string::npos);
  auto plain = parse_directory_url("redis://r");
  EXPECT_EQ(plain.endpoints[0].second, 6379);
  EXPECT_EQ(plain.db, 0);
  EXPECT_EQ(plain.prefix, "sluice");
}

TEST(DirectoryUrl, MalformedUrlsNameTheProblem) {
  EXPECT_NE(error_of([] { parse_directory_url("zookeeper://h:2181"); }, ErrorCode::kInvalidArgument).find("unknown scheme"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_directory_url("h:2379"); }, ErrorCode::kInvalidArgument).find("no scheme"),
            std::string::npos);
  error_of([] { parse_directory_url("etcd://h:notaport"); }, ErrorCode::kInvalidArgument);
  error_of([] { parse_directory_url("etcd://h1:2379,,h2:2379"); }, ErrorCode::kInvalidArgument);
  error_of([] { parse_directory_url("etcd://h:2379/ /x"); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(error_of([] { parse_directory_url("redis://h/x"); }, ErrorCode::kInvalidArgument).find("database"),
            std::string::npos);
  error_of([] { parse_directory_url("redis://h?db=2"); }, ErrorCode::kInvalidArgument);
}

TEST(DirectoryUrl, EngineNames) {
  check_engine_name("t", "prefill-0.worker_1");
  error_of([] { check_engine_name("t", ""); }, ErrorCode::kInvalidArgument);
  error_of([] { check_engine_name("t", "a/b"); }, ErrorCode::kInvalidArgument);
  error_of([] { check_engine_name("t", "host:1"); }, ErrorCode::kInvalidArgument);
  error_of([] { check_engine_name("t", std::string(129, 'a')); }, ErrorCode::kInvalidArgument);
}

TEST(DirectoryUrl, ConfigFieldsAreCheckedLikeTheirVariables) {
  EngineConfig c;
  c.set("directory", "etcd://h:2379/p").set("name", "w0");
  EXPECT_EQ(c.directory, "etcd://h:2379/p");
  EXPECT_EQ(c.get("name"), "w0");
  std::string msg = error_of([&] { c.set("directory", "etcd:/h"); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("directory"), std::string::npos) << msg;
  error_of([&] { c.set("name", "bad name"); }, ErrorCode::kInvalidArgument);
  c.set("directory.ttl_ms", "3000");
  EXPECT_EQ(c.get("directory.ttl_ms"), "3000");
  error_of([&] { c.set("directory.ttl_ms", "10"); }, ErrorCode::kInvalidArgument);
  // A field set from code passes the same parser when the engine resolves the config.
  EngineConfig bad;
  bad.name = "a/b";
  error_of([&] { EngineConfig::from_env(bad); }, ErrorCode::kInvalidArgument);
}

TEST(DirectoryUrl, TheVariableSelectsTheDirectory) {
  ::setenv("SLUICE_DIRECTORY", "redis://h:1/0", 1);
  ::setenv("SLUICE_NAME", "from-env", 1);
  EngineConfig c = EngineConfig::from_env({});
  ::unsetenv("SLUICE_DIRECTORY");
  ::unsetenv("SLUICE_NAME");
  EXPECT_EQ(c.directory, "redis://h:1/0");
  EXPECT_EQ(c.name, "from-env");
}

TEST(DirectoryUrl, TheListenerDirectoryIsTheDefault) {
  EngineConfig c;
  auto dir = make_directory(c);
  EXPECT_FALSE(dir->wants_updates());
}

#if !SLUICE_HAVE_ETCD
TEST(DirectoryUrl, EtcdWithoutLibcurlSaysWhatToInstall) {
  EngineConfig c;
  c.directory = "etcd://127.0.0.1:2379";
  EXPECT_NE(error_of([&] { make_directory(c); }, ErrorCode::kUnsupported).find("libcurl4-openssl-dev"), std::string::npos);
}
#endif
#if !SLUICE_HAVE_REDIS
TEST(DirectoryUrl, RedisWithoutHiredisSaysWhatToInstall) {
  EngineConfig c;
  c.directory = "redis://127.0.0.1:6379";
  EXPECT_NE(error_of([&] { make_directory(c); }, ErrorCode::kUnsupported).find("libhiredis-dev"), std::string::npos);
}
#endif

TEST(StoreRecord, RoundTripsAndRefusesForgeries) {
  EngineInfo e;
  e.wire_version = kWireVersion;
  e.engine_id = "0123456789abcdef";
  e.name = "w0";
  e.host_id = "h";
  e.listen_host = "127.0.0.1";
  e.listen_port = 4242;
  std::string rec = StoreDirectory::encode(e);
  EngineInfo back = StoreDirectory::decode("p/w0", rec);
  EXPECT_EQ(back.engine_id, e.engine_id);
  EXPECT_EQ(back.name, "w0");
  EXPECT_EQ(back.listen_port, 4242);
  error_of([] { StoreDirectory::decode("p/x", "not json"); }, ErrorCode::kProtocol);
  error_of([] { StoreDirectory::decode("p/x", "{}"); }, ErrorCode::kProtocol);
  // An incarnation that is not the info's engine id.
  auto j = nlohmann::json::parse(rec);
  j["incarnation"] = "feedfacefeedface";
  error_of([&] { StoreDirectory::decode("p/w0", j.dump()); }, ErrorCode::kProtocol);
  error_of([&] { StoreDirectory::decode("p/w0", std::string(1000, '[')); }, ErrorCode::kProtocol);
}

}  // namespace
}  // namespace sluice::detail
