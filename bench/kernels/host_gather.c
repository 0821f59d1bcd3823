/* Rows host[idx[i]] -> out[i] on `threads` OpenMP threads (bench/kernels/host_gather.py's native
 * gather). The next rows are prefetched: each row is a random 656-byte read from a large tier,
 * so a thread otherwise waits on DRAM once a row. */
#include <stdint.h>
#include <string.h>

void gather_rows(const uint8_t *host, const int64_t *idx, int64_t n, int64_t d, uint8_t *out,
                 int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    if (i + 8 < n) __builtin_prefetch(host + idx[i + 8] * d);
    memcpy(out + i * d, host + idx[i] * d, (size_t)d);
  }
}

/* One gather as a CUDA host function's argument (cuLaunchHostFunc, capturable in a graph): the
 * row count is read when the function runs, from pinned memory a memcpy before it wrote. */
typedef struct {
  const uint8_t *host;
  const int64_t *idx;
  const int64_t *count;
  int64_t d;
  uint8_t *out;
  int threads;
} gather_job;

void gather_job_run(void *arg) {
  const gather_job *j = (const gather_job *)arg;
  gather_rows(j->host, j->idx, *j->count, j->d, j->out, j->threads);
}
