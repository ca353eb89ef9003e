// GPU tests: engine cuda:N memory, the nvlink transport (in one process and between two
// processes), stream ordering and the AllGather. Skip cleanly without a GPU.
#include <gtest/gtest.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap/messages.hpp"
#include "bootstrap/socket.hpp"
#include "core/engine_info.hpp"
#include "core/memfd.hpp"
#include "sluice/allgather.hpp"
#include "sluice/cuda.hpp"
#include "sluice/sluice.hpp"
#include "transport/common/same_host.hpp"
#include "test_engine.hpp"

#ifdef SLUICE_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace sluice;
using namespace std::chrono_literals;
using sluice_test::quiet;

namespace {

#define NEED_GPUS(n)                                                                                      \
  do {                                                                                                    \
    if (cuda::device_count() < (n))                                                                       \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s); have " << cuda::device_count() << ": "         \
                   << cuda::unavailable_reason();                                                         \
  } while (0)

#ifdef SLUICE_TEST_CUDA
#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x
int second_device() { return cuda::device_count() > 1 ? 1 : 0; }

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  return v;
}
#endif


}  // namespace

TEST(CudaNoDevice, ReportsCleanly) {
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present; this checks the no-GPU path";
  Engine e(quiet());
  try {
    e.allocate(4096, Location::cuda(0));
    FAIL() << "allocate(cuda:0) should throw without a GPU";
  } catch (const Error& err) {
    EXPECT_TRUE(err.code() == ErrorCode::kNoDevice || err.code() == ErrorCode::kUnsupported) << err.what();
  }
  for (auto& t : e.transports()) EXPECT_NE(t, "nvlink");
  EXPECT_THROW(cuda::AllGather(1, 1024, cuda::DType::kUInt8, 2, 0, 0), Error);
  EXPECT_FALSE(cuda::stream_capturing(nullptr));  // the query fails: not capturing
}

#ifdef SLUICE_TEST_CUDA
// What the torch backend asks before it waits on an event or sets its AllGather up.
TEST(CudaStream, CaptureIsReported) {
  NEED_GPUS(1);
  CK(cudaSetDevice(0));
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_FALSE(cuda::stream_capturing(s));
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  EXPECT_TRUE(cuda::stream_capturing(s));
  cudaGraph_t g = nullptr;
  CK(cudaStreamEndCapture(s, &g));
  EXPECT_FALSE(cuda::stream_capturing(s));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(s));
}
#endif

// The same-host proof nvlink and shm share (runs without a GPU): the answer must come with a
// lease table that is a memfd and from the engine the peer's info names; the peer's pid is
// the kernel's word, not the message's.
TEST(SameHostProof, NeedsTheNamedEngineAndAMemfdLeaseTable) {
  namespace sh = sluice::detail::same_host;
  int memfd = sluice::detail::sealed_memfd("lease-test", 16 * 64);
  ASSERT_GE(memfd, 0);
  // A memfd without the shrink seal: its owner could truncate it under our mapping (SIGBUS).
  int loose = ::memfd_create("lease-test-loose", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(loose, 0);
  ASSERT_EQ(::ftruncate(loose, 16 * 64), 0);
  ASSERT_EQ(::fcntl(loose, F_ADD_SEALS, F_SEAL_GROW), 0);
  FILE* plain = std::tmpfile();  // a regular file on disk: never mapped as a lease table
  ASSERT_NE(plain, nullptr);
  ASSERT_EQ(::ftruncate(::fileno(plain), 16 * 64), 0);
  std::atomic<int> pass_fd{memfd};
  std::string engine = "engine-b";
  sh::Service svc;
  svc.start("sluice-test", [&](sluice::net::Socket& s, const sh::PeerCred&, const nlohmann::json&, int fd) {
    if (fd >= 0) ::close(fd);
    sh::send(s.fd(), {{"ok", true}, {"engine", engine}, {"pid", 1}}, pass_fd.load());
  });
  auto deadline = [] { return sh::Clock::now() + 2s; };
  auto code = [&](const std::string& expect) {
    try {
      auto p = sh::prove(svc.name(), 7, "engine-a", memfd, expect, deadline(), "test");
      ::close(p.lease_fd);
      EXPECT_EQ(p.cred.pid, ::getpid()) << "the peer is the process the kernel names, not the pid in the message";
      return ErrorCode::kOk;
    } catch (const Error& e) {
      return e.code();
    }
  };
  EXPECT_EQ(code("engine-b"), ErrorCode::kOk);
  EXPECT_EQ(code("engine-c"), ErrorCode::kProtocol) << "a socket served by another engine than the info names";
  pass_fd = ::fileno(plain);
  EXPECT_EQ(code("engine-b"), ErrorCode::kProtocol) << "a lease table that is not a memfd";
  pass_fd = loose;
  EXPECT_EQ(code("engine-b"), ErrorCode::kProtocol) << "a lease table its owner can still shrink";
  pass_fd = -1;
  EXPECT_EQ(code("engine-b"), ErrorCode::kProtocol) << "no lease table at all";
  // A name nobody serves (another host's engine, say) cannot be proven.
  try {
    sh::prove("sluice-test-nobody-serves-this", 7, "engine-a", memfd, "", deadline(), "test");
    ADD_FAILURE() << "proved against a socket nobody serves";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  }
  svc.stop();
  std::fclose(plain);
  ::close(memfd);
  ::close(loose);
}

#ifdef SLUICE_TEST_CUDA

TEST(CudaMemory, AllocateAndRegister) {
  NEED_GPUS(1);
  Engine e(quiet());
  auto a = e.allocate(1 << 20, Location::cuda(0), "buf");
  ASSERT_NE(a.ptr, nullptr);
  EXPECT_GE(a.length, 1u << 20);
  std::vector<uint8_t> host(1 << 20, 7);
  CK(cudaMemcpy(host.data(), a.ptr, host.size(), cudaMemcpyDeviceToHost));
  for (auto b : host) ASSERT_EQ(b, 0);  // zero filled
  e.free(a);

  void* p = nullptr;
  CK(cudaSetDevice(0));
  CK(cudaMalloc(&p, 1 << 20));
  auto h = e.register_memory(static_cast<uint8_t*>(p) + 4096, 8192, Location::cuda(0), "sub");
  EXPECT_NE(h.id, 0u);
  EXPECT_THROW(e.register_memory(&host[0], 4096, Location::cuda(0)), Error);  // host memory
  if (cuda::device_count() > 1) EXPECT_THROW(e.register_memory(p, 4096, Location::cuda(1)), Error);
  e.unregister_memory(h);
  cudaFree(p);
  EXPECT_THROW(e.allocate(4096, Location::cuda(cuda::device_count())), Error);
}

// Two engines in one process, cuda:0 <-> cuda:1 (or cuda:0 twice).
TEST(Nvlink, InProcessWriteRead) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  auto ts = a.transports();
  ASSERT_EQ(ts.front(), "nvlink");
  const size_t n = 3 << 20;
  auto src = a.allocate(n, Location::cuda(0));
  auto dst = b.allocate(n + 8192, Location::cuda(second_device()), "dst");
  auto ep = a.connect(b.local_info());
  EXPECT_EQ(ep.transport(), "nvlink");
  auto r = ep.remote_region("dst");
  ASSERT_TRUE(r.has_value());
  auto data = pattern(n, 3);
  CK(cudaMemcpy(src.ptr, data.data(), n, cudaMemcpyHostToDevice));
  { auto st_ = ep.write({{src.handle, 0, *r, 4096, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), static_cast<uint8_t*>(dst.ptr) + 4096, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
  CK(cudaMemset(src.ptr, 0, n));
  CK(cudaDeviceSynchronize());
  { auto st_ = ep.read({{src.handle, 0, *r, 4096, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(back.data(), src.ptr, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
}

// Stream ordering through OpOptions::cuda_stream (the *_on_stream calls are shorthands for it):
// the op's copies run on the caller's stream, after what is queued there and before what is
// queued later. A long queue of memsets ahead of the op makes an unordered copy read stale data.
TEST(Nvlink, StreamOrderedThroughOpOptions) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  const size_t n = 4 << 20;
  auto src = a.allocate(2 * n, Location::cuda(0));
  auto busy = a.allocate(64 << 20, Location::cuda(0));
  auto dst = b.allocate(n, Location::cuda(second_device()), "dst");
  auto ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  auto peer = b.accept(5s);
  ASSERT_TRUE(peer.has_value());
  const Capabilities caps = ep.capabilities();
  EXPECT_TRUE(caps.host_memory);
  EXPECT_TRUE(caps.cuda_memory);
  EXPECT_TRUE(caps.stream_ordered);
  EXPECT_FALSE(caps.stream_ordered_messages);
  EXPECT_TRUE(caps.imm);
  auto r = *ep.remote_region("dst");
  CK(cudaMemset(dst.ptr, 0, n));
  CK(cudaDeviceSynchronize());

  cudaStream_t s;
  CK(cudaSetDevice(0));
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OpOptions on_s;
  on_s.cuda_stream = s;
  auto delay = [&](cudaStream_t q) {
    for (int i = 0; i < 32; ++i) CK(cudaMemsetAsync(busy.ptr, i, 64 << 20, q));
  };
  // write_with_imm: the stream's 0xAB lands, its later 0xCD does not; the peer's imm comes
  // after the bytes are visible.
  auto imm = peer->imm_recv();
  delay(s);
  CK(cudaMemsetAsync(src.ptr, 0xAB, n, s));
  auto w = ep.write_with_imm({{src.handle, 0, r, 0, n}}, 77, on_s);
  CK(cudaMemsetAsync(src.ptr, 0xCD, n, s));
  { auto st_ = w.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  ASSERT_TRUE(imm.wait_for(10s));
  EXPECT_EQ(imm.imm(), 77u);
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), dst.ptr, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(back[i], 0xAB) << i;
  ASSERT_EQ(back[n - 1], 0xAB);
  // read: a copy queued on the stream after the read sees the read's bytes.
  delay(s);
  auto g = ep.read({{src.handle, n, r, 0, n}}, on_s);
  std::vector<uint8_t> got(n, 0);
  CK(cudaMemcpyAsync(got.data(), static_cast<uint8_t*>(src.ptr) + n, n, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  { auto st_ = g.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_TRUE(got == back);
  // The legacy default stream (handle 0) is passed as cudaStreamLegacy; the shorthand maps a
  // null stream to it.
  OpOptions legacy;
  legacy.cuda_stream = static_cast<void*>(cudaStreamLegacy);
  delay(nullptr);
  CK(cudaMemsetAsync(src.ptr, 0x11, n, nullptr));
  auto l = ep.write({{src.handle, 0, r, 0, n}}, legacy);
  CK(cudaMemsetAsync(src.ptr, 0x22, n, nullptr));
  { auto st_ = l.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(back.data(), dst.ptr, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(back[i], 0x11) << i;
  delay(nullptr);
  CK(cudaMemsetAsync(src.ptr, 0x33, n, nullptr));
  auto sh = cuda::write_on_stream(ep, {{src.handle, 0, r, 0, n}}, nullptr);
  { auto st_ = sh.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(back.data(), dst.ptr, n, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i += 4093) ASSERT_EQ(back[i], 0x33) << i;
  // Messages are not stream-ordered on nvlink: refused at submit, naming the capability.
  try {
    ep.send(src.handle, 0, 64, on_s);
    ADD_FAILURE() << "send with a cuda_stream should throw on nvlink";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("stream_ordered_messages"), std::string::npos) << e.what();
  }
  CK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
}

TEST(Nvlink, PeerUnregisteredRegionIsRefused) {
  // nvlink copies without asking the owner; the owner's lease table must still refuse a
  // stale handle, and the memory must stay untouched.
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  const size_t n = 1 << 20;
  auto src = a.allocate(n, Location::cuda(0));
  void* victim = nullptr;
  CK(cudaSetDevice(second_device()));
  CK(cudaMalloc(&victim, n));
  auto data = pattern(n, 9);
  CK(cudaMemcpy(victim, data.data(), n, cudaMemcpyHostToDevice));
  auto hv = b.register_memory(victim, n, Location::cuda(second_device()), "victim");
  auto ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  auto r = ep.remote_region("victim");
  ASSERT_TRUE(r.has_value());
  { auto st_ = ep.read({{src.handle, 0, *r, 0, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  b.unregister_memory(hv);
  CK(cudaSetDevice(0));
  CK(cudaMemset(src.ptr, 0xab, n));
  CK(cudaDeviceSynchronize());
  Status st;
  try {
    st = ep.write({{src.handle, 0, *r, 0, n}}).wait();
  } catch (const Error& e) {
    st = e.status();
  }
  EXPECT_EQ(st.code, ErrorCode::kUnknownHandle) << st.to_string();
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), victim, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data) << "a write reached a region its owner had unregistered";
  CK(cudaFree(victim));
}

// Writes into a peer's host memory that is not an engine (memfd) allocation are executed by
// the owner (PULL_WRITE), from host and from cuda memory here; a withdrawn region is refused.
TEST(Nvlink, HostWritesArePulledByTheOwner) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  std::vector<uint8_t> plain(1 << 20, 0);
  auto hp = b.register_memory(plain.data(), plain.size(), Location::host(), "plain");
  auto ep = a.connect(b.local_info());
  ASSERT_EQ(ep.transport(), "nvlink");
  auto r = ep.remote_region("plain");
  ASSERT_TRUE(r.has_value());
  auto data = pattern(1 << 16, 5);
  auto hh = a.register_memory(data.data(), data.size());
  { auto st_ = ep.write({{hh, 0, *r, 100, data.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(std::memcmp(plain.data() + 100, data.data(), data.size()), 0);
  auto src = a.allocate(1 << 16, Location::cuda(0));
  auto cdata = pattern(1 << 16, 77);
  CK(cudaMemcpy(src.ptr, cdata.data(), cdata.size(), cudaMemcpyHostToDevice));
  { auto st_ = ep.write_with_imm({{src.handle, 0, *r, 1 << 19, cdata.size()}}, 9).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(std::memcmp(plain.data() + (1 << 19), cdata.data(), cdata.size()), 0);
  Status st;
  try {
    st = ep.write({{hh, 0, *r, (1 << 20) - 10, 100}}).wait();
  } catch (const Error& e) {
    st = e.status();
  }
  EXPECT_FALSE(st.ok()) << "a write past the end of the peer's region";
  b.unregister_memory(hp);
  std::vector<uint8_t> before = plain;
  try {
    st = ep.write({{hh, 0, *r, 0, 4096}}).wait();
  } catch (const Error& e) {
    st = e.status();
  }
  EXPECT_EQ(st.code, ErrorCode::kUnknownHandle) << st.to_string();
  EXPECT_TRUE(plain == before) << "a write reached a region its owner had unregistered";
}

// A peer that only speaks TCP claims nvlink with this process's pid (or another's), the
// engine's own lease table and regions, and the engine's own same-host socket, all copied from
// the unauthenticated INFO reply. It must never get an endpoint: nvlink needs a proof on the
// Unix socket, which a TCP peer cannot give.
TEST(Nvlink, ForgedTcpPeerGetsNoEndpoint) {
  NEED_GPUS(1);
  Engine victim(quiet());
  auto secret = victim.allocate(1 << 20, Location::cuda(0), "secret");
  auto hsecret = victim.allocate(1 << 16, Location::host(), "hsecret");
  (void)secret;
  (void)hsecret;
  auto info = nlohmann::json::parse(victim.local_info());
  // INFO publishes neither a pid nor handles for nvlink any more: a peer learns about our cuda
  // memory only after proving itself.
  ASSERT_TRUE(info["transports"].contains("nvlink"));
  EXPECT_FALSE(info["transports"]["nvlink"].contains("regions")) << info["transports"]["nvlink"].dump();
  EXPECT_FALSE(info["transports"]["nvlink"].contains("pid"));
  auto [host, port] = sluice::detail::split_host_port(victim.listen_address());
  int tries = 0;
  for (int pid : {static_cast<int>(::getpid()), static_cast<int>(::getppid())}) {
    for (bool with_socket : {true, false}) {
      auto forged = info;
      forged["engine_id"] = "forged-" + std::to_string(tries);
      forged["pid"] = pid;
      forged["transports"]["nvlink"]["pid"] = pid;
      if (!with_socket) forged["transports"]["nvlink"].erase("socket");
      const uint64_t token = 0x5eed0000 + tries++;
      sluice::net::Socket s = sluice::net::connect_tcp(host, port, 2000ms);
      sluice::net::set_io_timeout(s.fd(), 2000ms);
      sluice::bootstrap::send_msg(s.fd(), sluice::bootstrap::MsgKind::kHello,
                                  {{"info", forged}, {"token", token}, {"transport", "nvlink"}, {"channels", 1}});
      auto [kind, body] = sluice::bootstrap::recv_msg(s.fd());
      if (kind == sluice::bootstrap::MsgKind::kError) continue;  // refused at hello: fine
      sluice::net::Socket c = sluice::net::connect_tcp(host, port, 2000ms);
      sluice::net::set_io_timeout(c.fd(), 2000ms);
      sluice::bootstrap::send_msg(c.fd(), sluice::bootstrap::MsgKind::kChannel,
                                  {{"token", token}, {"index", 0}, {"transport", "nvlink"}});
      auto [ckind, cbody] = sluice::bootstrap::recv_msg(c.fd());
      EXPECT_EQ(ckind, sluice::bootstrap::MsgKind::kError) << "pid " << pid << ": " << cbody.dump();
      EXPECT_EQ(cbody.value("code", 0), static_cast<int>(ErrorCode::kProtocol)) << cbody.dump();
    }
  }
  EXPECT_FALSE(victim.accept(500ms).has_value()) << "a TCP peer got an nvlink endpoint into this process";
}

// One engine never serves itself as an nvlink peer; two engines of one process do, and an
// info blob whose socket is served by another engine than it names is not nvlink-reachable.
TEST(Nvlink, LoopbackAndMisnamedSocketsAreRefused) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet()), c(quiet());
  ConnectOptions o;
  o.transport = "nvlink";
  EXPECT_THROW(a.connect(a.local_info(), o), Error);
  auto binfo = nlohmann::json::parse(b.local_info());
  auto cinfo = nlohmann::json::parse(c.local_info());
  binfo["transports"]["nvlink"]["socket"] = cinfo["transports"]["nvlink"]["socket"];
  EXPECT_THROW(a.connect(binfo.dump(), o), Error);
  auto ep = a.connect(b.local_info(), o);
  EXPECT_EQ(ep.transport(), "nvlink");
  ep.close();
}

namespace {

// The peer process: engine on cuda:dev with an engine allocation "alloc" and a user
// cudaMalloc buffer registered 1 MiB + 256 B into its allocation as "tensor". Prints its
// info blob, then serves until stdin closes. Each 'r' read from stdin unregisters "tensor",
// frees its buffer, allocates one of the same size (the driver tends to reuse the address),
// fills it with the round number, registers it as "tensor" again and prints "<same address
// 0|1>" and the new info blob.
int child_main(int dev) {
  EngineConfig c = quiet();
  Engine e(c);
  auto a = e.allocate(8 << 20, Location::cuda(dev), "alloc");
  (void)a;
  void* p = nullptr;
  if (cudaSetDevice(dev) != cudaSuccess || cudaMalloc(&p, 16 << 20) != cudaSuccess) return 3;
  cudaMemset(p, 0, 16 << 20);
  cudaDeviceSynchronize();
  MemoryHandle th = e.register_memory(static_cast<uint8_t*>(p) + (1 << 20) + 256, 4 << 20, Location::cuda(dev), "tensor");
  e.allocate(4 << 20, Location::host(), "hostalloc");  // memfd: nvlink maps it for host pieces
  static std::vector<uint8_t> plain(1 << 16);           // not a memfd: writes are pulled by us
  e.register_memory(plain.data(), plain.size(), Location::host(), "plain");
  // Plain host memory large enough for the staged read's lanes (data_path.cpp): 72 MiB.
  static std::vector<uint8_t> big = pattern(72 << 20, 41);
  e.register_memory(big.data(), big.size(), Location::host(), "bigplain");
  std::string info = e.local_info();
  std::printf("%s\n", info.c_str());
  std::fflush(stdout);
  char ch;
  for (int round = 1; ::read(0, &ch, 1) > 0;) {
    if (ch != 'r') continue;
    e.unregister_memory(th);
    void* old = p;
    if (cudaFree(p) != cudaSuccess || cudaMalloc(&p, 16 << 20) != cudaSuccess) return 4;
    cudaMemset(p, round++, 16 << 20);
    cudaDeviceSynchronize();
    th = e.register_memory(static_cast<uint8_t*>(p) + (1 << 20) + 256, 4 << 20, Location::cuda(dev), "tensor");
    std::printf("%d %s\n", p == old ? 1 : 0, e.local_info().c_str());
    std::fflush(stdout);
  }
  return 0;
}

struct Child {
  pid_t pid = -1;
  int to = -1;    // child's stdin
  int from = -1;  // child's stdout
  std::string info;
  std::string line() {
    std::string l;
    char ch;
    while (::read(from, &ch, 1) == 1 && ch != '\n') l += ch;
    return l;
  }
  ~Child() {
    if (to >= 0) ::close(to);
    if (from >= 0) ::close(from);
    if (pid > 0) {
      int st = 0;
      ::waitpid(pid, &st, 0);
    }
  }
};

std::unique_ptr<Child> spawn_child(int dev) {
  int in[2], out[2];
  if (::pipe(in) || ::pipe(out)) return nullptr;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::close(in[1]);
    ::close(out[0]);
    std::string arg = "--sluice-child=" + std::to_string(dev);
    char* argv[] = {const_cast<char*>("/proc/self/exe"), arg.data(), nullptr};
    ::execv("/proc/self/exe", argv);
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  auto c = std::make_unique<Child>();
  c->pid = pid;
  c->to = in[1];
  c->from = out[0];
  c->info = c->line();
  return c;
}

// The set-up of the cross-process nvlink tests: a child process (on the second GPU where
// there is one) and this process's nvlink endpoint to it. Members go in reverse order: the
// endpoint and engine close before the child is reaped.
struct ChildPeer {
  std::unique_ptr<Child> child;
  Engine e{quiet()};
  Endpoint ep;
};

void connect_child(ChildPeer* p) {
  p->child = spawn_child(second_device());
  ASSERT_TRUE(p->child && !p->child->info.empty()) << "child did not start";
  p->ep = p->e.connect(p->child->info);
  ASSERT_EQ(p->ep.transport(), "nvlink");
}

__attribute__((unused)) void fill_on_stream(void* dst, uint8_t v, size_t n, cudaStream_t s) {
  cudaMemsetAsync(dst, v, n, s);
}

}  // namespace

// The owner frees a registered cudaMalloc buffer and allocates a new one at the same address:
// reads of the new region must see the new buffer, never the old one through a cached export
// or import (an export cached by base address handed out the freed buffer's IPC handle).
TEST(Nvlink, ReallocatedBufferAtTheSameAddressIsTheNewOne) {
  NEED_GPUS(1);
  ChildPeer peer;
  ASSERT_NO_FATAL_FAILURE(connect_child(&peer));
  auto& [child, e, ep] = peer;
  const size_t n = 1 << 20;
  auto dst = e.allocate(n, Location::host());
  std::vector<uint8_t> got(n);
  int reused = 0;
  for (int round = 0; round < 3; ++round) {
    auto t = ep.remote_region("tensor");
    ASSERT_TRUE(t);
    ASSERT_TRUE(ep.read({{dst.handle, 0, *t, 4096, n}}).wait().ok()) << "round " << round;
    std::memcpy(got.data(), dst.ptr, n);
    EXPECT_EQ(got, std::vector<uint8_t>(n, static_cast<uint8_t>(round))) << "round " << round;
    ASSERT_EQ(1, ::write(child->to, "r", 1));
    std::string l = child->line();
    ASSERT_GT(l.size(), 2u) << "the child did not reallocate";
    reused += l[0] == '1';
    ep.refresh_remote_regions();
  }
  std::printf("the new buffer came at the old address in %d of 3 rounds\n", reused);
}

TEST(Nvlink, CrossProcessOffsetsImmAndStreams) {
  NEED_GPUS(1);
  ChildPeer peer;
  ASSERT_NO_FATAL_FAILURE(connect_child(&peer));
  auto& [child, e, ep] = peer;
  auto tensor = ep.remote_region("tensor");
  auto alloc = ep.remote_region("alloc");
  ASSERT_TRUE(tensor && alloc);
  const size_t n = (2 << 20) + 77;
  auto src = e.allocate(8 << 20, Location::cuda(0));
  auto data = pattern(n, 9);
  CK(cudaMemcpy(static_cast<uint8_t*>(src.ptr) + 5, data.data(), n, cudaMemcpyHostToDevice));
  // Into a tensor that is not at the start of its allocation (cudaIpc base + offset) and into
  // an engine allocation (cuMem POSIX fd).
  for (auto remote : {*tensor, *alloc}) {
    { auto st_ = ep.write({{src.handle, 5, remote, 1000, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
    CK(cudaMemset(static_cast<uint8_t*>(src.ptr) + (4 << 20), 0, n + 16));
    CK(cudaDeviceSynchronize());
    { auto st_ = ep.read({{src.handle, (4 << 20) + 3, remote, 1000, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
    std::vector<uint8_t> back(n);
    CK(cudaMemcpy(back.data(), static_cast<uint8_t*>(src.ptr) + (4 << 20) + 3, n, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(back == data) << "remote " << remote.id;
  }
  // Many small pieces in one batch.
  Batch batch;
  for (int i = 0; i < 64; ++i) batch.push_back({src.handle, uint64_t(i) * 4096, *tensor, uint64_t(i) * 8192, 1000});
  { auto st_ = ep.write(batch).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  // write_with_imm: the peer gets the imm; we can't see it from here, but the op completes.
  { auto st_ = ep.write_with_imm({{src.handle, 0, *alloc, 0, 4096}}, 42).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }

  // Stream ordering: a memset queued on the user's stream must land before the write reads.
  cudaStream_t s;
  CK(cudaSetDevice(0));
  CK(cudaStreamCreate(&s));
  const size_t m = 1 << 20;
  CK(cudaMemsetAsync(src.ptr, 0xAB, m, s));
  auto f = cuda::write_on_stream(ep, {{src.handle, 0, *tensor, 0, m}}, s);
  CK(cudaMemsetAsync(src.ptr, 0xCD, m, s));  // after the write on the stream
  CK(cudaStreamSynchronize(s));
  { auto st_ = f.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  auto g = cuda::read_on_stream(ep, {{src.handle, 2 << 20, *tensor, 0, m}}, s);
  std::vector<uint8_t> back(m);
  CK(cudaMemcpyAsync(back.data(), static_cast<uint8_t*>(src.ptr) + (2 << 20), m, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  { auto st_ = g.wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  for (size_t i = 0; i < m; ++i) ASSERT_EQ(back[i], 0xAB) << i;
  cudaStreamDestroy(s);
  // Host memory over the same endpoint (CMA path).
  std::vector<uint8_t> hbuf(1 << 16, 5);
  auto hh = e.register_memory(hbuf.data(), hbuf.size());
  { auto st_ = ep.write({{hh, 0, *tensor, 0, hbuf.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  // Host <-> the peer's memfd host memory (mapped), and cuda here <-> it.
  auto hostalloc = ep.remote_region("hostalloc");
  ASSERT_TRUE(hostalloc);
  { auto st_ = ep.write({{hh, 0, *hostalloc, 100, hbuf.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> hback(hbuf.size(), 0);
  auto hb = e.register_memory(hback.data(), hback.size());
  { auto st_ = ep.read({{hb, 0, *hostalloc, 100, hback.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_TRUE(hback == hbuf);
  { auto st_ = ep.write({{src.handle, 0, *hostalloc, 0, 1 << 20}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemset(static_cast<uint8_t*>(src.ptr) + (6 << 20), 0, 1 << 20));
  CK(cudaDeviceSynchronize());
  { auto st_ = ep.read({{src.handle, 6 << 20, *hostalloc, 0, 1 << 20}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> a1(1 << 20), a2(1 << 20);
  CK(cudaMemcpy(a1.data(), src.ptr, a1.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(a2.data(), static_cast<uint8_t*>(src.ptr) + (6 << 20), a2.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(a1 == a2);
  { auto st_ = ep.read({{hh, 0, *tensor, 4096, 4096}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  // The peer's plain host memory: written by the peer itself (PULL_WRITE), read with CMA.
  auto plain = ep.remote_region("plain");
  ASSERT_TRUE(plain);
  std::fill(hbuf.begin(), hbuf.end(), 0x3c);
  { auto st_ = ep.write({{hh, 0, *plain, 0, hbuf.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::fill(hback.begin(), hback.end(), 0);
  { auto st_ = ep.read({{hb, 0, *plain, 0, hback.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_TRUE(hback == hbuf);
  std::vector<uint8_t> want(4096);
  CK(cudaMemcpy(want.data(), static_cast<uint8_t*>(src.ptr) + 5, want.size(), cudaMemcpyDeviceToHost));
  { auto st_ = ep.write({{src.handle, 5, *plain, 0, 4096}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  { auto st_ = ep.read({{hb, 0, *plain, 0, 4096}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(std::memcmp(hback.data(), want.data(), want.size()), 0) << "cuda -> the peer's plain host memory";
  ep.close();
}

// Reads of the peer's plain (not memfd) host memory into local GPU memory are staged through
// page-locked chunks in up to four lanes (data_path.cpp, staged_read): one lane (3 MiB + odd),
// two (40 MiB - odd) and four (72 MiB - odd), at odd offsets on both sides, several in one op;
// every byte checked.
TEST(Nvlink, PeerPlainHostIntoGpuIsStaged) {
  NEED_GPUS(1);
  ChildPeer peer;
  ASSERT_NO_FATAL_FAILURE(connect_child(&peer));
  auto& [child, e, ep] = peer;
  auto big = ep.remote_region("bigplain");
  ASSERT_TRUE(big);
  const auto want = pattern(72 << 20, 41);  // what the child put there
  auto dst = e.allocate(80 << 20, Location::cuda(0));
  std::vector<uint8_t> got;
  for (uint64_t n : {(3ull << 20) + 5, (40ull << 20) - 4093, (72ull << 20) - 777}) {
    CK(cudaMemset(dst.ptr, 0, 80 << 20));
    CK(cudaDeviceSynchronize());
    const uint64_t roff = (72ull << 20) - n, loff = 13;
    { auto st_ = ep.read({{dst.handle, loff, *big, roff, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
    got.assign(n, 0);
    CK(cudaMemcpy(got.data(), static_cast<uint8_t*>(dst.ptr) + loff, n, cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(got.data(), want.data() + roff, n), 0) << n << " bytes";
    uint8_t edge[2] = {1, 1};
    CK(cudaMemcpy(&edge[0], static_cast<uint8_t*>(dst.ptr) + loff - 1, 1, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&edge[1], static_cast<uint8_t*>(dst.ptr) + loff + n, 1, cudaMemcpyDeviceToHost));
    EXPECT_EQ(edge[0] | edge[1], 0) << "a byte outside the read was written (" << n << ")";
  }
  // Two pieces in one op, into two places.
  CK(cudaMemset(dst.ptr, 0, 80 << 20));
  CK(cudaDeviceSynchronize());
  {
    auto st_ = ep.read({{dst.handle, 0, *big, 100, 33 << 20}, {dst.handle, 40 << 20, *big, 7, 20 << 20}}).wait();
    ASSERT_TRUE(st_.ok()) << st_.to_string();
  }
  got.assign(33 << 20, 0);
  CK(cudaMemcpy(got.data(), dst.ptr, got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(got.data(), want.data() + 100, got.size()), 0);
  got.assign(20 << 20, 0);
  CK(cudaMemcpy(got.data(), static_cast<uint8_t*>(dst.ptr) + (40 << 20), got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(got.data(), want.data() + 7, got.size()), 0);
  ep.close();
}

// The thin post path to another process, every way a post goes: GPU to its cuMem and cudaIpc
// memory (copies on the post stream), a counter in its GPU memory (our kernel through the
// import), host to its memfd memory (mapped: a memcpy here), host to its plain host memory
// (PULL_WRITE), counters in its host memory (kSignal frames it applies). Checked by reading
// back over the same endpoint.
TEST(Nvlink, CrossProcessPosts) {
  NEED_GPUS(1);
  ChildPeer peer;
  ASSERT_NO_FATAL_FAILURE(connect_child(&peer));
  auto& [child, e, ep] = peer;
  ASSERT_TRUE(ep.capabilities().rma_post && ep.capabilities().signal);
  auto tensor = ep.remote_region("tensor"), alloc = ep.remote_region("alloc");
  auto hostalloc = ep.remote_region("hostalloc"), plain = ep.remote_region("plain");
  ASSERT_TRUE(tensor && alloc && hostalloc && plain);
  const size_t n = 1 << 20;
  auto src = e.allocate(2 * n, Location::cuda(0));
  auto data = pattern(n, 41);
  CK(cudaMemcpy(src.ptr, data.data(), n, cudaMemcpyHostToDevice));
  std::vector<uint8_t> hsrc(1 << 16);
  for (size_t i = 0; i < hsrc.size(); ++i) hsrc[i] = uint8_t(i * 7 + 3);
  auto hh = e.register_memory(hsrc.data(), hsrc.size());
  // Counters: 8 bytes at the end of each region written below (zeroed by a post first).
  std::vector<uint8_t> zero(64, 0);
  auto hz = e.register_memory(zero.data(), zero.size());
  const uint64_t gpu_sem = (4 << 20) - 64, host_sem = (1 << 16) - 64;
  ep.post_write(hz, 0, *alloc, gpu_sem, 8);
  ep.post_write(hz, 0, *hostalloc, host_sem, 8);
  ep.post_write(hz, 0, *plain, host_sem, 8);
  ep.flush();
  for (int round = 0; round < 8; ++round) {
    ep.post_write(src.handle, 0, *alloc, 0, n);
    ep.post_write(src.handle, 4096, *tensor, 100, n - 4096);
    ep.post_signal(*alloc, gpu_sem, 1);
    ep.post_write(hh, 0, *hostalloc, 0, 4096);
    ep.post_signal(*hostalloc, host_sem, 1);
    ep.post_write(hh, 0, *plain, 0, 8192);
    ep.post_signal(*plain, host_sem, 2);
  }
  ep.flush();
  auto back = e.allocate(2 * n, Location::cuda(0));
  std::vector<uint8_t> got(n);
  { auto st_ = ep.read({{back.handle, 0, *alloc, 0, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(got.data(), back.ptr, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(got == data) << "GPU -> the peer's cuMem memory";
  { auto st_ = ep.read({{back.handle, 0, *tensor, 100, n - 4096}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(got.data(), back.ptr, n - 4096, cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(got.data(), data.data() + 4096, n - 4096)) << "GPU -> the peer's cudaIpc memory";
  std::vector<uint8_t> hback(1 << 16, 0);
  auto hb = e.register_memory(hback.data(), hback.size());
  uint64_t v = 0;
  { auto st_ = ep.read({{hb, 0, *alloc, gpu_sem, 8}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::memcpy(&v, hback.data(), 8);
  EXPECT_EQ(8u, v) << "the counter in the peer's GPU memory";
  { auto st_ = ep.read({{hb, 0, *hostalloc, 0, hback.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(0, std::memcmp(hback.data(), hsrc.data(), 4096)) << "host -> the peer's memfd memory";
  std::memcpy(&v, hback.data() + host_sem, 8);
  EXPECT_EQ(8u, v) << "the counter in the peer's memfd memory";
  { auto st_ = ep.read({{hb, 0, *plain, 0, hback.size()}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(0, std::memcmp(hback.data(), hsrc.data(), 8192)) << "host -> the peer's plain host memory";
  std::memcpy(&v, hback.data() + host_sem, 8);
  EXPECT_EQ(16u, v) << "the counter in the peer's plain host memory";
  ep.close();
}

// AllGather with both ranks in this process (one thread each).
// A handle is bytes from a rendezvous socket: one that claims this process must name one of
// its AllGather buffers (else a forged one would aim our kernels at any other memory).
TEST(AllGather, ForgedInProcessHandlesAreRefused) {
  NEED_GPUS(1);
  cuda::AllGather a(1024, 2, cuda::DType::kBFloat16, 2, 0, 0);
  cuda::AllGather b(1024, 2, cuda::DType::kBFloat16, 2, 1, 0);
  std::string hb = b.handle();
  // Layout of the handle (src/cuda/allgather.cu): pid, device, ptr, size, ipc handle.
  struct H {
    int pid, device;
    uint64_t ptr, size;
    char ipc[64];
  };
  auto unhex = [](const std::string& t) {
    std::string out(t.size() / 2, '\0');
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(std::stoi(t.substr(2 * i, 2), nullptr, 16));
    return out;
  };
  auto hex = [](const std::string& bytes) {
    static const char* d = "0123456789abcdef";
    std::string t;
    for (unsigned char c : bytes) {
      t += d[c >> 4];
      t += d[c & 15];
    }
    return t;
  };
  std::string raw = unhex(hb);
  ASSERT_EQ(raw.size(), sizeof(H));
  H h;
  std::memcpy(&h, raw.data(), sizeof(h));
  void* other = nullptr;
  CK(cudaMalloc(&other, h.size));
  H forged = h;
  forged.ptr = reinterpret_cast<uint64_t>(other);  // real device memory of ours, not a buffer
  std::string fh = hex(std::string(reinterpret_cast<char*>(&forged), sizeof(forged)));
  ErrorCode code = ErrorCode::kOk;
  try {
    a.connect({a.handle(), fh});
  } catch (const Error& e) {
    code = e.code();
  }
  EXPECT_EQ(code, ErrorCode::kProtocol);
  // The genuine handle still connects.
  a.connect({a.handle(), hb});
  cudaFree(other);
}

TEST(AllGather, TwoRanksInProcessAndGraph) {
  NEED_GPUS(2);
  const int world = 2;
  const uint64_t max_bytes = 8 << 20;
  std::vector<std::unique_ptr<cuda::AllGather>> ag;
  std::vector<std::string> handles;
  for (int r = 0; r < world; ++r) {
    ag.push_back(std::make_unique<cuda::AllGather>(max_bytes / 2, 2, cuda::DType::kBFloat16, world, r, r));
    handles.push_back(ag[r]->handle());
  }
  for (int r = 0; r < world; ++r) ag[r]->connect(handles);
  std::vector<size_t> sizes = {8, 1000, 4096, 65536 + 24, 256 << 10, (256 << 10) + 16, 1 << 20, (3 << 20) + 48, max_bytes};
  std::vector<std::string> errors(world);
  auto run = [&](int r) {
    cudaSetDevice(r);
    cudaStream_t s;
    cudaStreamCreate(&s);
    uint8_t *in, *out;
    cudaMalloc(reinterpret_cast<void**>(&in), max_bytes);
    cudaMalloc(reinterpret_cast<void**>(&out), max_bytes * world);
    for (int graph = 0; graph < 2; ++graph) {
      for (size_t bytes : sizes) {
        auto mine = pattern(bytes, uint8_t(r * 50 + bytes));
        cudaMemcpy(in, mine.data(), bytes, cudaMemcpyHostToDevice);
        cudaMemset(out, 0xEE, bytes * world);
        cudaDeviceSynchronize();
        if (graph) {
          cudaGraph_t gr;
          cudaGraphExec_t ex;
          cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
          ag[r]->all_gather_bytes(in, out, bytes, s);
          cudaStreamEndCapture(s, &gr);
          cudaGraphInstantiate(&ex, gr, 0);
          for (int k = 0; k < 3; ++k) cudaGraphLaunch(ex, s);
          cudaStreamSynchronize(s);
          cudaGraphExecDestroy(ex);
          cudaGraphDestroy(gr);
        } else {
          for (int k = 0; k < 3; ++k) ag[r]->all_gather_bytes(in, out, bytes, s);
        }
        if (cudaStreamSynchronize(s) != cudaSuccess) {
          errors[r] = "cuda error";
          return;
        }
        std::vector<uint8_t> got(bytes * world);
        cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost);
        for (int p = 0; p < world; ++p) {
          auto want = pattern(bytes, uint8_t(p * 50 + bytes));
          if (std::memcmp(got.data() + p * bytes, want.data(), bytes) != 0) {
            errors[r] = "mismatch at " + std::to_string(bytes) + " bytes from rank " + std::to_string(p) +
                        (graph ? " (graph)" : "");
            return;
          }
        }
      }
    }
  };
  std::thread t0(run, 0), t1(run, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_THROW(ag[0]->all_gather_bytes(nullptr, nullptr, max_bytes + 1, nullptr), Error);
}

TEST(AllGather, TcpBootstrap) {
  NEED_GPUS(2);
  const std::string root = "127.0.0.1:" + std::to_string(20000 + ::getpid() % 20000);
  std::vector<std::unique_ptr<cuda::AllGather>> ag(2);
  std::vector<std::string> errors(2);
  auto run = [&](int r) {
    try {
      cudaSetDevice(r);
      ag[r] = std::make_unique<cuda::AllGather>(1024, 4, cuda::DType::kFloat32, 2, r, r);
      ag[r]->bootstrap(root, std::chrono::seconds(20));
      std::vector<float> mine(1000, float(r + 1));
      float *in, *out;
      cudaMalloc(reinterpret_cast<void**>(&in), 4000);
      cudaMalloc(reinterpret_cast<void**>(&out), 8000);
      cudaMemcpy(in, mine.data(), 4000, cudaMemcpyHostToDevice);
      ag[r]->all_gather(in, out, 1000, nullptr);
      std::vector<float> got(2000);
      cudaMemcpy(got.data(), out, 8000, cudaMemcpyDeviceToHost);
      for (int i = 0; i < 2000; ++i)
        if (got[i] != float(i / 1000 + 1)) {
          errors[r] = "mismatch at " + std::to_string(i);
          break;
        }
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::thread t0(run, 0), t1(run, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// tcp stages cuda memory through pinned host buffers on both sides.
TEST(Staging, TcpCudaToCuda) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  const size_t n = (9 << 20) + 123;
  auto src = a.allocate(n + 4096, Location::cuda(0));
  auto dst = b.allocate(n + 4096, Location::cuda(second_device()), "dst");
  std::vector<uint8_t> hbuf(n);
  auto hh = b.register_memory(hbuf.data(), n, Location::host(), "host");
  ConnectOptions o;
  o.transport = "tcp";
  auto ep = a.connect(b.local_info(), o);
  ASSERT_EQ(ep.transport(), "tcp");
  auto r = *ep.remote_region("dst");
  auto data = pattern(n, 21);
  CK(cudaMemcpy(static_cast<uint8_t*>(src.ptr) + 1, data.data(), n, cudaMemcpyHostToDevice));
  { auto st_ = ep.write({{src.handle, 1, r, 7, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), static_cast<uint8_t*>(dst.ptr) + 7, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
  CK(cudaMemset(src.ptr, 0, n + 4096));
  CK(cudaDeviceSynchronize());
  { auto st_ = ep.read({{src.handle, 3, r, 7, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  CK(cudaMemcpy(back.data(), static_cast<uint8_t*>(src.ptr) + 3, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
  // cuda here -> host there
  { auto st_ = ep.write({{src.handle, 3, *ep.remote_region("host"), 0, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_TRUE(hbuf == data);
  (void)hh;
}

// tcp SENDs into and out of cuda memory: received in place through pinned chunks
// (staging::receive), a striped one's rest pulled into a pinned buffer and uploaded
// (tcp.send_stripe_min; docs/wire-protocol.md), sent from cuda memory staged by the adapter.
// Whole and striped, exact, truncated, and before the recv (stashed in host memory).
TEST(Staging, TcpSendsIntoAndOutOfCudaMemory) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  const size_t max = (6 << 20) + 77;
  auto hsrc = a.allocate(max, Location::host());
  auto dsrc = a.allocate(max, Location::cuda(0));
  auto ddst = b.allocate(max + 4096, Location::cuda(second_device()));
  ConnectOptions o;
  o.transport = "tcp";
  auto ep = a.connect(b.local_info(), o);
  ASSERT_EQ(ep.transport(), "tcp");
  auto acc = b.accept(std::chrono::seconds(5));
  ASSERT_TRUE(acc.has_value());
  Endpoint peer = *acc;
  int seed = 40;
  for (bool from_cuda : {false, true}) {
    for (size_t n : {size_t(64 << 10), size_t(1 << 20), max}) {
      for (size_t cap : {n, n / 2 + 1}) {
        SCOPED_TRACE(std::string(from_cuda ? "cuda" : "host") + " -> cuda, " + std::to_string(n) + " into " +
                     std::to_string(cap));
        auto data = pattern(n, ++seed);
        if (from_cuda) CK(cudaMemcpy(dsrc.ptr, data.data(), n, cudaMemcpyHostToDevice));
        else std::memcpy(hsrc.ptr, data.data(), n);
        CK(cudaMemset(ddst.ptr, 0xEE, max + 4096));
        CK(cudaDeviceSynchronize());
        auto r = peer.recv(ddst.handle, 0, cap);
        auto s = ep.send(from_cuda ? dsrc.handle : hsrc.handle, 0, n);
        auto rs = r.wait();
        auto ss = s.wait();
        const size_t got = std::min(n, cap);
        if (cap >= n) {
          ASSERT_TRUE(rs.ok()) << rs.to_string();
          ASSERT_TRUE(ss.ok()) << ss.to_string();
        } else {
          EXPECT_EQ(rs.code, ErrorCode::kTruncated) << rs.to_string();
        }
        std::vector<uint8_t> back(max + 4096);
        CK(cudaMemcpy(back.data(), ddst.ptr, back.size(), cudaMemcpyDeviceToHost));
        EXPECT_EQ(0, std::memcmp(back.data(), data.data(), got));
        EXPECT_TRUE(std::all_of(back.begin() + got, back.end(), [](uint8_t v) { return v == 0xEE; }))
            << "bytes past the recv";
      }
    }
  }
  // Before its recv: stashed in host memory, then copied up.
  auto data = pattern(max, 99);
  std::memcpy(hsrc.ptr, data.data(), max);
  { auto st_ = ep.send(hsrc.handle, 0, max).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  { auto st_ = peer.recv(ddst.handle, 0, max).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> back(max);
  CK(cudaMemcpy(back.data(), ddst.ptr, max, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
}

// shm stages cuda memory on this side; the peer's cuda memory is out of its reach.
TEST(Staging, ShmCudaToHost) {
  NEED_GPUS(1);
  Engine a(quiet()), b(quiet());
  const size_t n = (5 << 20) + 5;
  auto src = a.allocate(n, Location::cuda(0));
  auto hdst = b.allocate(n, Location::host(), "host");
  auto ddst = b.allocate(4096, Location::cuda(0), "dev");
  ConnectOptions o;
  o.transport = "shm";
  auto ep = a.connect(b.local_info(), o);
  ASSERT_EQ(ep.transport(), "shm");
  auto data = pattern(n, 33);
  CK(cudaMemcpy(src.ptr, data.data(), n, cudaMemcpyHostToDevice));
  { auto st_ = ep.write({{src.handle, 0, *ep.remote_region("host"), 0, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  EXPECT_EQ(std::memcmp(hdst.ptr, data.data(), n), 0);
  CK(cudaMemset(src.ptr, 0, n));
  CK(cudaDeviceSynchronize());
  { auto st_ = ep.read({{src.handle, 0, *ep.remote_region("host"), 0, n}}).wait(); ASSERT_TRUE(st_.ok()) << st_.to_string(); }
  std::vector<uint8_t> back(n);
  CK(cudaMemcpy(back.data(), src.ptr, n, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == data);
  bool refused = false;
  try {
    refused = !ep.write({{src.handle, 0, *ep.remote_region("dev"), 0, 4096}}).wait().ok();
  } catch (const Error&) {
    refused = true;
  }
  EXPECT_TRUE(refused);
}

#endif  // SLUICE_TEST_CUDA

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--sluice-child=", 15) == 0) {
#ifdef SLUICE_TEST_CUDA
      return child_main(std::atoi(argv[i] + 15));
#else
      return 2;
#endif
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
