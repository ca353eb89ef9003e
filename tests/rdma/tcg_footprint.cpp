// tcg_footprint: how much user-space code run between two ibv_post_send calls slows the
// SoftRoCE system call down in a TCG guest (docs/rdma.md, "Latency under emulation").
//
// Raw verbs, no engine: two RC QPs of one device connected to each other (loopback); each
// iteration runs K small functions, then posts a 2-byte inline signalled RDMA WRITE and polls
// its completion. "distinct" calls K different functions (K different pieces of code), "same"
// calls one function K times (the same amount of work, one piece of code). Prints the mean
// time of ibv_post_send (SoftRoCE runs the whole exchange inside it) and of the iteration.
// Usage: tcg_footprint [iterations] (env RXE_DEV picks the device). Not a pass/fail test.
#include <infiniband/verbs.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

template <int N>
__attribute__((noinline)) int step(int x) {
  asm volatile("");
  return x * (N | 1) + N;
}
template <size_t... I>
constexpr auto make_steps(std::index_sequence<I...>) {
  return std::array<int (*)(int), sizeof...(I)>{&step<I>...};
}
constexpr size_t kSteps = 2048;
const auto kTable = make_steps(std::make_index_sequence<kSteps>{});
volatile int g_sink;

void run_code(int k, bool distinct) {
  int x = 1;
  for (int i = 0; i < k; ++i) x = kTable[distinct ? (i * 997) % kSteps : 0](x);
  g_sink = x;
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "tcg_footprint: %s failed (errno %d %s)\n", what, errno, std::strerror(errno));
  std::exit(2);
}

struct Loop {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq[2] = {};
  ibv_qp* qp[2] = {};
  ibv_mr* mr[2] = {};
  std::vector<uint8_t> buf[2] = {std::vector<uint8_t>(4096), std::vector<uint8_t>(4096)};
};

void to_rts(ibv_qp* qp, uint32_t remote, const ibv_gid& gid, int gid_index, ibv_mtu mtu) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) die("INIT");
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = mtu;
  a.dest_qp_num = remote;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.is_global = 1;
  a.ah_attr.grh.dgid = gid;
  a.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
  a.ah_attr.grh.hop_limit = 64;
  a.ah_attr.port_num = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    die("RTR");
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                IBV_QP_MAX_QP_RD_ATOMIC))
    die("RTS");
}

Loop open_loop() {
  Loop l;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  const char* want = std::getenv("RXE_DEV");
  for (int i = 0; i < n && !l.ctx; ++i)
    if (!want || std::strcmp(ibv_get_device_name(list[i]), want) == 0) l.ctx = ibv_open_device(list[i]);
  if (!l.ctx) die("opening the RDMA device");
  ibv_port_attr pa{};
  if (ibv_query_port(l.ctx, 1, &pa)) die("ibv_query_port");
  int gid_index = -1;
  ibv_gid gid{};
  static const uint8_t v4[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};  // an IPv4-mapped (RoCE v2) GID
  for (int i = 0; i < pa.gid_tbl_len && gid_index < 0; ++i)
    if (!ibv_query_gid(l.ctx, 1, i, &gid) && std::memcmp(gid.raw, v4, 12) == 0) gid_index = i;
  if (gid_index < 0) die("finding an IPv4 GID");
  if (!(l.pd = ibv_alloc_pd(l.ctx))) die("ibv_alloc_pd");
  for (int s = 0; s < 2; ++s) {
    if (!(l.cq[s] = ibv_create_cq(l.ctx, 256, nullptr, nullptr, 0))) die("ibv_create_cq");
    ibv_qp_init_attr qi{};
    qi.qp_type = IBV_QPT_RC;
    qi.send_cq = qi.recv_cq = l.cq[s];
    qi.cap.max_send_wr = 128;
    qi.cap.max_recv_wr = 1;
    qi.cap.max_send_sge = qi.cap.max_recv_sge = 1;
    qi.cap.max_inline_data = 64;
    if (!(l.qp[s] = ibv_create_qp(l.pd, &qi))) die("ibv_create_qp");
    if (!(l.mr[s] = ibv_reg_mr(l.pd, l.buf[s].data(), l.buf[s].size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)))
      die("ibv_reg_mr");
  }
  to_rts(l.qp[0], l.qp[1]->qp_num, gid, gid_index, pa.active_mtu);
  to_rts(l.qp[1], l.qp[0]->qp_num, gid, gid_index, pa.active_mtu);
  ibv_free_device_list(list);
  return l;
}

// Returns {mean post us, mean iteration us}.
std::pair<double, double> measure(Loop& l, int iters, int k, bool distinct) {
  double post_us = 0;
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    run_code(k, distinct);
    ibv_sge sge{reinterpret_cast<uintptr_t>(l.buf[0].data()), 2, l.mr[0]->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    wr.wr.rdma.remote_addr = reinterpret_cast<uintptr_t>(l.buf[1].data());
    wr.wr.rdma.rkey = l.mr[1]->rkey;
    auto p0 = Clock::now();
    if (ibv_post_send(l.qp[0], &wr, &bad)) die("ibv_post_send");
    post_us += std::chrono::duration<double, std::micro>(Clock::now() - p0).count();
    ibv_wc wc{};
    int got;
    while ((got = ibv_poll_cq(l.cq[0], 1, &wc)) == 0) {
    }
    if (got < 0 || wc.status != IBV_WC_SUCCESS) die("the write's completion");
  }
  double total = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  return {post_us / iters, total / iters};
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 3000;
  Loop l = open_loop();
  measure(l, iters / 10 + 1, 0, false);  // warm-up
  std::printf("%-10s %6s %12s %14s\n", "code", "calls", "post (us)", "iteration (us)");
  for (int k : {0, 100, 200, 400, 800})
    for (bool distinct : {false, true}) {
      if (k == 0 && distinct) continue;
      auto [post, it] = measure(l, iters, k, distinct);
      std::printf("%-10s %6d %12.1f %14.1f\n", k == 0 ? "none" : distinct ? "distinct" : "same", k, post, it);
    }
  return 0;
}
