#include "store_servers.hpp"

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>
#include <vector>

#include "directory/etcd_directory.hpp"
#include "directory/redis_directory.hpp"
#include "sluice/error.hpp"

namespace sluice::test {
namespace {

using namespace std::chrono_literals;

std::string which(const char* name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    auto colon = p.find(':', start);
    std::string dir = p.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    std::string full = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(full.c_str(), X_OK) == 0) return full;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return "";
}

}  // namespace

const char* kind_name(StoreKind kind) { return kind == StoreKind::kEtcd ? "etcd" : "redis"; }

uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string StoreServer::binary(StoreKind kind) { return which(kind == StoreKind::kEtcd ? "etcd" : "redis-server"); }

StoreServer::StoreServer(StoreKind kind) : kind_(kind) {
  char tmpl[] = "/tmp/sluice-store-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  dir_ = tmpl;
  log_ = dir_ + "/server.log";
  port_ = free_port();
  peer_port_ = free_port();
}

StoreServer::~StoreServer() {
  stop();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string StoreServer::url(const std::string& prefix) const {
  if (kind_ == StoreKind::kEtcd) return "etcd://127.0.0.1:" + std::to_string(port_) + "/" + prefix;
  return "redis://127.0.0.1:" + std::to_string(port_) + "/0?prefix=" + prefix;
}

void StoreServer::start(bool wipe) {
  if (pid_ > 0) return;
  std::string data = dir_ + "/data";
  if (wipe) {
    std::error_code ec;
    std::filesystem::remove_all(data, ec);
  }
  std::filesystem::create_directories(data);
  std::vector<std::string> args;
  const std::string c = "http://127.0.0.1:" + std::to_string(port_);
  const std::string p = "http://127.0.0.1:" + std::to_string(peer_port_);
  if (kind_ == StoreKind::kEtcd) {
    args = {binary(kind_), "--name", "t", "--data-dir", data, "--listen-client-urls", c, "--advertise-client-urls", c,
            "--listen-peer-urls", p, "--initial-advertise-peer-urls", p, "--initial-cluster", "t=" + p,
            "--logger", "zap", "--log-level", "warn"};
  } else {
    // No persistence: a restart is a store that lost everything.
    args = {binary(kind_), "--port", std::to_string(port_), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", data, "--daemonize", "no", "--loglevel", "warning"};
  }
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    FILE* f = std::fopen(log_.c_str(), "a");
    if (f) {
      ::dup2(fileno(f), 1);
      ::dup2(fileno(f), 2);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  pid_ = pid;
  wait_ready();
}

void StoreServer::wait_ready() {
  using Clock = std::chrono::steady_clock;
  // Ready = our own backend gets an answer (etcd also has to elect itself leader first).
  std::unique_ptr<detail::StoreBackend> probe;
#if SLUICE_HAVE_ETCD
  if (kind_ == StoreKind::kEtcd) probe = detail::make_etcd_backend({{{"127.0.0.1", port_}}, 10s});
#endif
#if SLUICE_HAVE_REDIS
  if (kind_ == StoreKind::kRedis) probe = detail::make_redis_backend({"127.0.0.1", port_, 0, "", 10s});
#endif
  if (!probe) throw std::runtime_error(std::string("this build has no ") + kind_name(kind_) + " directory");
  auto deadline = Clock::now() + 20s;
  std::string last;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error(std::string(kind_name(kind_)) + " exited at start; see " + log_);
    }
    try {
      probe->get("sluice-test/probe", Clock::now() + 1s);
      return;
    } catch (const Error& e) {
      last = e.what();
    }
    std::this_thread::sleep_for(20ms);
  }
  throw std::runtime_error(std::string(kind_name(kind_)) + " did not answer within 20 s (" + last + "); see " + log_);
}

void StoreServer::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 500; ++i) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace sluice::test
