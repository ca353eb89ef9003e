// Open MPI adapter for bench/peers (issue 16): `mpirun -np 2 mpi_peer CELLS_FILE FOOTPRINT`.
// CELLS_FILE: one cell a line, "op size batch conc iters" (op: read | write | send).
// read/write: MPI_Rget/MPI_Rput into an MPI_Win_create window (passive target, lock_all);
// under btl vader the window's single copy is CMA. send: MPI_Isend/MPI_Irecv.
// A batch is `batch` requests completed with MPI_Waitall; `conc` batches are in flight.
// Rank 0 prints one RESULT JSON line per cell (same fields as common.emit); every byte of one
// batch is checked after the cell (read: against the target's pattern; write: put then get
// back; send: rank 1 compares what it received and prints a CHECK line).
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peers_mem.h"

static void fill(unsigned char* p, size_t n, uint64_t seed) {  // = common.pattern
  for (size_t i = 0; i < n; i++) {
    uint64_t j = (uint64_t)i + seed;
    p[i] = (unsigned char)(((j * 2654435761ull) >> 13) + (j >> 21));
  }
}
static uint64_t check_seed(const char* op, size_t size) {
  return size * 7 + 1 + (!strcmp(op, "write") ? 1 : !strcmp(op, "send") ? 2 : 0);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc < 3) {
    if (!rank) fprintf(stderr, "usage: mpi_peer CELLS_FILE FOOTPRINT\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  size_t foot = strtoull(argv[2], 0, 0);
  unsigned char *local, *check, *win_buf;
  // The window is our memory, like every engine's region (MPI_Win_create takes any memory).
  local = peers_alloc(foot), check = peers_alloc(foot), win_buf = peers_alloc(foot);
  if (!local || !check || !win_buf) {
    fprintf(stderr, "mpi_peer: cannot allocate %zu bytes\n", foot);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  fill(local, foot, 0), fill(win_buf, foot, 0), memset(check, 0, foot);
  MPI_Win win;
  MPI_Win_create(win_buf, foot, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win);
  MPI_Win_lock_all(0, win);
  FILE* f = fopen(argv[1], "r");
  if (!f) {
    perror(argv[1]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  char op[16];
  size_t size;
  int batch, conc, iters;
  while (fscanf(f, "%15s %zu %d %d %d", op, &size, &batch, &conc, &iters) == 5) {
    int send = !strcmp(op, "send"), rd = !strcmp(op, "read");
    size_t slots = foot / size ? foot / size : 1;
    int warm = iters / 10 + 1 < 8 ? iters / 10 + 1 : 8, total = warm + iters;
    MPI_Request* rq = malloc(sizeof(MPI_Request) * (size_t)batch * conc);
    double* t_post = malloc(sizeof(double) * conc);
    double lat = 0, t0 = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < total; i++) {
      if (i == warm) {
        // drain the warm-up, then time
        for (int k = 0; k < conc && k < i; k++) MPI_Waitall(batch, rq + (size_t)((i - 1 - k) % conc) * batch, MPI_STATUSES_IGNORE);
        MPI_Barrier(MPI_COMM_WORLD);
        lat = 0, t0 = MPI_Wtime();
      }
      int ring = i % conc, fill_count = i - (i >= warm ? warm : 0);
      if (fill_count >= conc) {  // the ring slot still holds the batch from conc ago
        MPI_Waitall(batch, rq + (size_t)ring * batch, MPI_STATUSES_IGNORE);
        if (i >= warm) lat += MPI_Wtime() - t_post[ring];
      }
      t_post[ring] = MPI_Wtime();
      for (int j = 0; j < batch; j++) {
        size_t off = (((size_t)i * batch + j) % slots) * size;
        MPI_Request* r = rq + (size_t)ring * batch + j;
        if (send && rank == 0) MPI_Isend(local + off, size, MPI_BYTE, 1, 1, MPI_COMM_WORLD, r);
        else if (send) MPI_Irecv(win_buf + off, size, MPI_BYTE, 0, 1, MPI_COMM_WORLD, r);
        else if (rank != 0) *r = MPI_REQUEST_NULL;
        else if (rd) MPI_Rget(local + off, size, MPI_BYTE, 1, off, size, MPI_BYTE, win, r);
        else MPI_Rput(local + off, size, MPI_BYTE, 1, off, size, MPI_BYTE, win, r);
      }
    }
    int left = iters < conc ? iters : conc;
    for (int k = left; k >= 1; k--) {
      int ring = (total - k) % conc;
      MPI_Waitall(batch, rq + (size_t)ring * batch, MPI_STATUSES_IGNORE);
      lat += MPI_Wtime() - t_post[ring];
    }
    double secs = MPI_Wtime() - t0;
    // the byte check: one batch's worth of slots
    size_t n = (size_t)batch < slots ? (size_t)batch : slots;
    int ok = 1;
    uint64_t seed = check_seed(op, size);
    if (send) {
      if (rank == 0) {
        fill(local, n * size, seed);
        for (size_t j = 0; j < n; j++) MPI_Isend(local + j * size, size, MPI_BYTE, 1, 2, MPI_COMM_WORLD, rq + j);
      } else {
        for (size_t j = 0; j < n; j++) MPI_Irecv(win_buf + j * size, size, MPI_BYTE, 0, 2, MPI_COMM_WORLD, rq + j);
      }
      MPI_Waitall((int)n, rq, MPI_STATUSES_IGNORE);
      if (rank == 1) {
        fill(check, n * size, seed);
        ok = !memcmp(check, win_buf, n * size);
        fill(win_buf, n * size, 0);
      } else {
        fill(local, n * size, 0);
      }
    } else if (rank == 0) {
      if (!rd) {
        fill(local, n * size, seed);
        MPI_Put(local, n * size, MPI_BYTE, 1, 0, n * size, MPI_BYTE, win);
        MPI_Win_flush(1, win);
      }
      MPI_Get(check, n * size, MPI_BYTE, 1, 0, n * size, MPI_BYTE, win);
      MPI_Win_flush(1, win);
      ok = !memcmp(check, local, n * size);
      if (!rd) {
        fill(local, n * size, 0);
        MPI_Put(local, n * size, MPI_BYTE, 1, 0, n * size, MPI_BYTE, win);
        MPI_Win_flush(1, win);
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0)
      printf("RESULT {\"op\": \"%s\", \"size\": %zu, \"batch\": %d, \"conc\": %d, \"iters\": %d, \"secs\": %.9f, "
             "\"lat_ms\": %.9f, \"checked\": %s, \"error\": \"%s\", \"mbps\": %.3f}\n",
             op, size, batch, conc, iters, secs, lat / iters * 1e3, ok ? "true" : "false", ok ? "" : "byte check failed",
             (double)size * batch * iters / secs / 1e6);
    else if (send)
      printf("CHECK {\"key\": \"%s/%zu/%d/%d\", \"ok\": %s}\n", op, size, batch, conc, ok ? "true" : "false");
    fflush(stdout);
    free(rq), free(t_post);
  }
  fclose(f);
  MPI_Win_unlock_all(win);
  MPI_Win_free(&win);
  free(win_buf), free(local), free(check);
  MPI_Finalize();
  return 0;
}
