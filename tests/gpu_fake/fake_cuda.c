/* A stand-in CUDA driver for testing interop/xla/tg_gpu.c on a machine without a GPU: the handler loads it
 * through $TAPEGRAD_LIBCUDA. "Device" memory is host memory, copies are memcpy, a kernel launch is the
 * settab kernel's effect (vt[idx[j]] = ptr[j], the same by-value table the handler builds), and a graph
 * launch calls back into the test (which runs the program's launch lists in the host emulation). Every
 * call is noted in a log the test reads, with a mark when it names a stream other than the expected one. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef int CUresult;
typedef struct { long long idx[64]; long long ptr[64]; int n; } tab_t;

static char log_[16384];
static size_t nlog;
static void *stream_want;
static int init_result;
static void (*graph_cb)(void *);

static void note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(log_ + nlog, sizeof log_ - nlog, fmt, ap);
  va_end(ap);
  if (k > 0 && nlog + (size_t)k + 1 < sizeof log_) {
    nlog += (size_t)k;
    log_[nlog++] = ';';
    log_[nlog] = 0;
  }
}

static void on(void *stream) { if (stream != stream_want) note("WRONG-STREAM"); }

void fake_setup(void *stream, int init, void (*cb)(void *)) {
  stream_want = stream;
  init_result = init;
  graph_cb = cb;
  nlog = 0;
  log_[0] = 0;
}
const char *fake_log(void) { return log_; }
void fake_clear(void) { nlog = 0; log_[0] = 0; }

static CUresult f_init(unsigned flags) { note("init %u", flags); return init_result; }
static CUresult f_device_get(int *d, int ordinal) { *d = ordinal; note("device %d", ordinal); return 0; }
static CUresult f_retain(void **ctx, int dev) { *ctx = (void *)(intptr_t)(0x100 + dev); note("retain %d", dev); return 0; }
static CUresult f_push(void *ctx) { note("push %lx", (unsigned long)(intptr_t)ctx); return 0; }
static CUresult f_pop(void **ctx) { *ctx = NULL; note("pop"); return 0; }
static CUresult f_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned smem, void *stream, void **params, void **extra) {
  on(stream);
  long long *vt = *(long long **)params[0];
  const tab_t *tab = params[1];
  for (int j = 0; j < tab->n; j++) vt[tab->idx[j]] = tab->ptr[j];
  note("settab %lx %u,%u,%u %u,%u,%u %u %d%s", (unsigned long)(intptr_t)f, gx, gy, gz, bx, by, bz, smem, tab->n,
       extra ? " extra" : "");
  return 0;
}
static CUresult f_graph(void *g, void *stream) { on(stream); note("graph %lx", (unsigned long)(intptr_t)g); graph_cb(g); return 0; }
static CUresult f_dtoh(void *dst, unsigned long long src, size_t n, void *s) { on(s); memcpy(dst, (void *)(intptr_t)src, n); note("dtoh %zu", n); return 0; }
static CUresult f_htod(unsigned long long dst, const void *src, size_t n, void *s) { on(s); memcpy((void *)(intptr_t)dst, src, n); note("htod %zu", n); return 0; }
static CUresult f_dtod(unsigned long long dst, unsigned long long src, size_t n, void *s) { on(s); memcpy((void *)(intptr_t)dst, (void *)(intptr_t)src, n); note("dtod %zu", n); return 0; }
static CUresult f_sync(void *s) { on(s); note("sync"); return 0; }
static CUresult f_err_name(CUresult r, const char **s) { *s = r == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN"; return 0; }
static CUresult f_err_string(CUresult r, const char **s) { *s = r == 100 ? "no CUDA-capable device is detected" : "unknown error"; return 0; }

static const struct { const char *name; void *fn; } table[] = {
    {"cuInit", (void *)f_init}, {"cuDeviceGet", (void *)f_device_get}, {"cuDevicePrimaryCtxRetain", (void *)f_retain},
    {"cuCtxPushCurrent", (void *)f_push}, {"cuCtxPopCurrent", (void *)f_pop}, {"cuLaunchKernel", (void *)f_launch},
    {"cuGraphLaunch", (void *)f_graph}, {"cuMemcpyDtoHAsync", (void *)f_dtoh}, {"cuMemcpyHtoDAsync", (void *)f_htod},
    {"cuMemcpyDtoDAsync", (void *)f_dtod}, {"cuStreamSynchronize", (void *)f_sync},
    {"cuGetErrorName", (void *)f_err_name}, {"cuGetErrorString", (void *)f_err_string}};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
  *pfn = NULL;
  for (size_t k = 0; k < sizeof table / sizeof *table; k++)
    if (!strcmp(table[k].name, symbol)) *pfn = table[k].fn;
  if (status) *status = *pfn ? 0 : 1;
  note("proc %s %d %llu", symbol, version, flags);
  return 0;
}
