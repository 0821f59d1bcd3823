/* The host side of the staged miss copy (kernels/swap/staged_copy.py): gather the rows a swap
 * plan missed from the host tier into pinned staging, in the miss copy's flat work order (every
 * request's list, clamped to [0, stride], one after another), so that one copy-engine memcpy
 * moves them and no SM reads host memory. `hg_gather` has the signature of a CUDA host function
 * (cuLaunchHostFunc): captured in a graph, it runs when the memcpys before it have landed the
 * lists in pinned memory, and reads the counts then. */
#include <stdint.h>
#include <string.h>

typedef struct {
  const uint8_t *host; /* the host tier: host_rows rows of d bytes */
  int64_t host_rows;
  int64_t d;
  const int64_t *src;  /* [groups, stride]: host row numbers */
  const int32_t *count; /* [groups]: live entries of each list */
  int64_t groups;
  int64_t stride;
  uint8_t *staging;    /* [budget, d] */
  int64_t budget;
  int64_t first;       /* the flat rows [first, last) this call gathers */
  int64_t last;
  int threads;
} hg_job;

static int64_t live(const hg_job *j, int64_t g) {
  int64_t c = j->count[g];
  return c < 0 ? 0 : c > j->stride ? j->stride : c;
}

/* Flat rows [a, b): find the request holding row a, then walk forward. Rows whose source lies
 * outside the tier are skipped (the device copy skips them too). */
static void walk(const hg_job *j, int64_t a, int64_t b) {
  int64_t g = 0, start = 0;
  while (g < j->groups && start + live(j, g) <= a) start += live(j, g++);
  for (int64_t f = a; f < b && g < j->groups; start += live(j, g++)) {
    int64_t end = start + live(j, g) < b ? start + live(j, g) : b;
    const int64_t *src = j->src + g * j->stride - start;
    for (; f < end; f++) {
      /* Each row is a random read from a large tier: ask for the next rows early. */
      if (f + 8 < end && src[f + 8] >= 0 && src[f + 8] < j->host_rows)
        __builtin_prefetch(j->host + src[f + 8] * j->d);
      int64_t s = src[f];
      if (s >= 0 && s < j->host_rows) memcpy(j->staging + f * j->d, j->host + s * j->d, j->d);
    }
  }
}

void hg_gather(void *arg) {
  const hg_job *j = (const hg_job *)arg;
  int64_t total = 0;
  for (int64_t g = 0; g < j->groups; g++) total += live(j, g);
  int64_t hi = j->last < total ? j->last : total;
  hi = hi < j->budget ? hi : j->budget;
  int64_t lo = j->first, n = hi - lo;
  if (n <= 0) return;
  int t = j->threads > 0 ? j->threads : 1;
#pragma omp parallel for num_threads(t) schedule(static, 1)
  for (int i = 0; i < t; i++) walk(j, lo + n * i / t, lo + n * (i + 1) / t);
}
