// cma-scaling: how fast one block is copied into another process by one or several
// threads, with memcpy (a shared mapping: nothing pinned) and with process_vm_writev
// (CMA, what libfabric's shm uses for large RMA: the kernel pins the pages of the
// other process, 4 KiB at a time under that process's page-table lock). The block
// starts OFF bytes after a 2 MiB boundary of the pinned buffer and is split evenly over
// T pinned threads (cpus 2..). Median of 61 timed rounds after 5 warm-up ones.
//
//   cc -O2 -pthread -o cma-scaling tools/bench/cma-scaling.c && ./cma-scaling
//
// Measured on the GPU machine (16 vCPUs, 4 KiB pages) — see issue 14's stop-21 note:
// one thread falls from 18-29 GB/s (memcpy) / 10-13 GB/s (CMA) at 1 MiB to 12.8 / 8-11
// at 2 MiB (the core's 2 MiB L2); memcpy scales with threads (2 MiB over 2 threads:
// 60 GB/s), CMA only when the threads' pieces lie in different 2 MiB page-table
// regions (2 MiB at offset 1 MiB over 2 threads: 20-22 GB/s; at offset 0: 9-10).
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BUF (64ul << 20)
#define MIB2 (2ul << 20)
#define THREADS 4
#define ROUNDS 66
#define WARMUP 5

static char *src, *dst;
static pid_t child;
static atomic_int go, finished;
static size_t g_size, g_off;
static int g_threads, g_cma;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void *worker(void *arg) {
  long k = (long)arg;
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(2 + k, &cpus);
  pthread_setaffinity_np(pthread_self(), sizeof cpus, &cpus);
  for (int seen = 0;;) {
    int g;
    while ((g = atomic_load(&go)) == seen)
      ;
    seen = g;
    if (g < 0)
      return NULL;
    if (k < g_threads) {
      size_t part = g_size / g_threads, off = g_off + part * k;
      if (!g_cma) {
        memcpy(dst + off, src + off, part);
      } else {
        struct iovec local = {src + off, part}, remote = {dst + off, part};
        if (process_vm_writev(child, &local, 1, &remote, 1, 0) != (ssize_t)part) {
          perror("process_vm_writev");
          exit(1);
        }
      }
    }
    atomic_fetch_add(&finished, 1);
  }
}

static double gbps(size_t size, size_t off, int threads, int cma) {
  double t[ROUNDS];
  g_size = size, g_off = off, g_threads = threads, g_cma = cma;
  for (int i = 0; i < ROUNDS; i++) {
    atomic_store(&finished, 0);
    double t0 = now();
    atomic_fetch_add(&go, 1);
    while (atomic_load(&finished) < THREADS)
      ;
    t[i] = now() - t0;
  }
  qsort(t + WARMUP, ROUNDS - WARMUP, sizeof(double), by_value);
  return size / t[WARMUP + (ROUNDS - WARMUP) / 2] / 1e9;
}

static char *aligned_map(int flags) {
  char *p = mmap(NULL, BUF + MIB2, PROT_READ | PROT_WRITE, flags | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  p = (char *)(((unsigned long)p + MIB2 - 1) & ~(MIB2 - 1));
  madvise(p, BUF, MADV_NOHUGEPAGE);
  return p;
}

int main(void) {
  if (sysconf(_SC_NPROCESSORS_ONLN) < THREADS + 2) {
    fprintf(stderr, "cma-scaling: needs %d cpus (its threads spin, pinned)\n", THREADS + 2);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(1, &cpus);
  sched_setaffinity(0, sizeof cpus, &cpus);
  src = aligned_map(MAP_PRIVATE);
  char *theirs = aligned_map(MAP_PRIVATE), *shared = aligned_map(MAP_SHARED);
  memset(src, 1, BUF), memset(theirs, 3, BUF), memset(shared, 2, BUF);
  child = fork();
  if (child == 0) {
    memset(theirs, 4, BUF); // the child's own pages, at the same address
    pause();
    return 0;
  }
  usleep(200000);
  pthread_t th[THREADS];
  for (long k = 0; k < THREADS; k++)
    pthread_create(&th[k], NULL, worker, (void *)k);
  const size_t sizes[] = {1ul << 20, 2ul << 20, 4ul << 20};
  const size_t offs[] = {0, 512ul << 10, 1ul << 20};
  const int ts[] = {1, 2, 4};
  printf("GB/s    KiB  off KiB   memcpy T1/T2/T4        CMA T1/T2/T4\n");
  for (int i = 0; i < 3; i++)
    for (int o = 0; o < 3; o++) {
      printf("%12zu %8zu ", sizes[i] >> 10, offs[o] >> 10);
      dst = shared;
      for (int j = 0; j < 3; j++)
        printf(" %6.2f", gbps(sizes[i], offs[o], ts[j], 0));
      dst = theirs;
      printf("   ");
      for (int j = 0; j < 3; j++)
        printf(" %6.2f", gbps(sizes[i], offs[o], ts[j], 1));
      printf("\n");
    }
  atomic_store(&go, -1);
  kill(child, SIGKILL);
  wait(NULL);
  return 0;
}
