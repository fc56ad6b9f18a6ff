/* tg_gpu_episode: one training episode of a CuPy-captured program as an XLA custom call on the CUDA
 * platform. Plain C against xla/ffi/api/c_api.h, compiled after tg_xla.c (whose FFI helpers it uses)
 * and tapegrad/native/step_scalars.c (the step scalars every CPU backend computes): no CUDA header,
 * no nvcc, no link against libcuda. The driver is opened at the first call (libcuda.so.1, or the
 * file $TAPEGRAD_LIBCUDA names) and each entry point resolved with cuGetProcAddress at the CUDA 12.0
 * ABI, so the versioned symbols (cuMemcpyHtoDAsync_v2, ...) are the ones cuda.h would have picked.
 *
 * Operands (params..., opt_state..., count, inputs...) -> results (loss, params..., opt_state..., count);
 * the params, state and count results alias their operands. Attributes (interop/xla/gpu_call.py):
 *   graph      the episode's cudaGraphExec_t (forward + backward + optimizer, captured by CuPy)
 *   settab     the CUfunction of the program's settab kernel; table: its pointer table's device address;
 *              table_len: the table's entries
 *   ctl        the device address of the control buffer (TG_CTL doubles) the optimizer kernels read
 *   slots      i64[operands]: each operand's table entry (-1: none); loss_slot: the loss's entry
 *   home       i64[operands]: the entries' own addresses (put back after the replay); loss_home
 *   device     the CUDA device the program lives on
 *   opt        0 none, 1 SGD, 2 Adam; hat: Adam's eps form; lr, b1, b2 (f64)
 * Per call, all on XLA's stream: read the count (one small copy and a synchronisation), upload
 * count + 1 and the step scalars, point the table at XLA's buffers (settab), replay the graph, point
 * the table back. The table travels in settab's by-value parameter, so nothing on the host outlives
 * the call. Traits 0: the call launches its own graph, so XLA must not capture it into a command buffer.
 */
#include <dlfcn.h>

#define TG_SETTAB 64   /* table entries one settab launch sets (tapegrad.gpu.source.SETTAB) */
#define TG_CTL 8       /* doubles in the control buffer (tapegrad.gpu.runner.CTL) */
#define TG_CUDA_ABI 12000

typedef int tg_cu_result;
typedef unsigned long long tg_cu_ptr;
typedef tg_cu_result (*tg_cu_getproc2_t)(const char *, void **, int, unsigned long long, int *);
typedef tg_cu_result (*tg_cu_getproc1_t)(const char *, void **, int, unsigned long long);

/* The driver entry points the handler calls (signatures as cuda.h declares them). */
static struct {
  int loaded;            /* 1: usable; -1: failed (msg says why, and every call reports it) */
  char msg[1024];
  char path[256];
  tg_cu_result (*Init)(unsigned);
  tg_cu_result (*DeviceGet)(int *, int);
  tg_cu_result (*DevicePrimaryCtxRetain)(void **, int);
  tg_cu_result (*CtxPushCurrent)(void *);
  tg_cu_result (*CtxPopCurrent)(void **);
  tg_cu_result (*LaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void *, void **, void **);
  tg_cu_result (*GraphLaunch)(void *, void *);
  tg_cu_result (*MemcpyDtoHAsync)(void *, tg_cu_ptr, size_t, void *);
  tg_cu_result (*MemcpyHtoDAsync)(tg_cu_ptr, const void *, size_t, void *);
  tg_cu_result (*MemcpyDtoDAsync)(tg_cu_ptr, tg_cu_ptr, size_t, void *);
  tg_cu_result (*StreamSynchronize)(void *);
  tg_cu_result (*GetErrorName)(tg_cu_result, const char **);
  tg_cu_result (*GetErrorString)(tg_cu_result, const char **);
  void *ctx[TG_MAX_DEVICES];   /* retained primary contexts */
} tg_cu;
static pthread_mutex_t tg_cu_mu = PTHREAD_MUTEX_INITIALIZER;

/* "CUDA_ERROR_X (text)" for a driver result. */
static void tg_cu_describe(tg_cu_result r, char *out, size_t n) {
  const char *name = NULL, *text = NULL;
  if (!tg_cu.GetErrorName || tg_cu.GetErrorName(r, &name) || !name) name = "an unknown CUDA error";
  if (!tg_cu.GetErrorString || tg_cu.GetErrorString(r, &text) || !text) text = "no description";
  snprintf(out, n, "%s (%d: %s)", name, r, text);
}

static const char *tg_cu_load_locked(void) {
  const char *env = getenv("TAPEGRAD_LIBCUDA");
  snprintf(tg_cu.path, sizeof tg_cu.path, "%s", env && *env ? env : "libcuda.so.1");
  void *lib = dlopen(tg_cu.path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *e = dlerror();
    snprintf(tg_cu.msg, sizeof tg_cu.msg, "no CUDA driver: cannot load %s (%s); this custom call needs an "
             "NVIDIA GPU and its driver (set TAPEGRAD_LIBCUDA to the driver library's path if it is elsewhere)",
             tg_cu.path, e ? e : "dlopen failed");
    return tg_cu.msg;
  }
  tg_cu_getproc2_t get2 = (tg_cu_getproc2_t)dlsym(lib, "cuGetProcAddress_v2");
  tg_cu_getproc1_t get1 = get2 ? NULL : (tg_cu_getproc1_t)dlsym(lib, "cuGetProcAddress");
  if (!get2 && !get1) {
    snprintf(tg_cu.msg, sizeof tg_cu.msg, "the CUDA driver %s has no cuGetProcAddress (a driver older than "
             "CUDA 11.3); update the NVIDIA driver", tg_cu.path);
    return tg_cu.msg;
  }
  static const char *const names[] = {"cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent",
                                      "cuCtxPopCurrent", "cuLaunchKernel", "cuGraphLaunch", "cuMemcpyDtoHAsync",
                                      "cuMemcpyHtoDAsync", "cuMemcpyDtoDAsync", "cuStreamSynchronize",
                                      "cuGetErrorName", "cuGetErrorString"};
  void **slot[] = {(void **)&tg_cu.Init, (void **)&tg_cu.DeviceGet, (void **)&tg_cu.DevicePrimaryCtxRetain,
                   (void **)&tg_cu.CtxPushCurrent, (void **)&tg_cu.CtxPopCurrent, (void **)&tg_cu.LaunchKernel,
                   (void **)&tg_cu.GraphLaunch, (void **)&tg_cu.MemcpyDtoHAsync, (void **)&tg_cu.MemcpyHtoDAsync,
                   (void **)&tg_cu.MemcpyDtoDAsync, (void **)&tg_cu.StreamSynchronize,
                   (void **)&tg_cu.GetErrorName, (void **)&tg_cu.GetErrorString};
  for (size_t k = 0; k < sizeof names / sizeof *names; k++) {
    void *fn = NULL;
    int status = 0;
    /* flags 1 (CU_GET_PROC_ADDRESS_LEGACY_STREAM): every call names XLA's stream explicitly */
    tg_cu_result r = get2 ? get2(names[k], &fn, TG_CUDA_ABI, 1, &status) : get1(names[k], &fn, TG_CUDA_ABI, 1);
    if (r || !fn) {
      snprintf(tg_cu.msg, sizeof tg_cu.msg, "the CUDA driver %s gives no %s for the CUDA 12.0 ABI "
               "(cuGetProcAddress returned %d, status %d); a driver for CUDA 12 or later is needed",
               tg_cu.path, names[k], r, status);
      return tg_cu.msg;
    }
    *slot[k] = fn;
  }
  tg_cu_result r = tg_cu.Init(0);
  if (r) {
    char d[160];
    tg_cu_describe(r, d, sizeof d);
    snprintf(tg_cu.msg, sizeof tg_cu.msg, "no GPU is available: cuInit failed with %s (driver %s)", d, tg_cu.path);
    return tg_cu.msg;
  }
  return NULL;
}

/* Open the driver once per process; NULL when usable, else why not (the same answer every time). */
static const char *tg_cu_load(void) {
  pthread_mutex_lock(&tg_cu_mu);
  if (!tg_cu.loaded) tg_cu.loaded = tg_cu_load_locked() ? -1 : 1;
  pthread_mutex_unlock(&tg_cu_mu);
  return tg_cu.loaded > 0 ? NULL : tg_cu.msg;
}

/* For tests and diagnostics: 0 when the driver is usable, else -1 with the reason in msg. */
int tg_gpu_driver(char *msg, int64_t n) {
  const char *why = tg_cu_load();
  snprintf(msg, (size_t)n, "%s", why ? why : "");
  return why ? -1 : 0;
}

/* ── the pure parts (exported for tests) ───────────────────────────────── */

int64_t tg_gpu_settab_capacity(void) { return TG_SETTAB; }

/* The control buffer of step `count` (1-based): the step scalars of tapegrad.gpu.runner's write_ctl. */
void tg_gpu_ctl(int64_t opt, int64_t hat, double lr, double b1, double b2, double count, double *ctl) {
  for (int k = 0; k < TG_CTL; k++) ctl[k] = 0.0;
  if (opt == 2) tg_adam_scalars(lr, b1, b2, (int)hat, count, ctl);
}

/* The settab entries of a call: (table index, address) of each operand with an entry -- the first nw
 * (written: params and state) at their results rets[1 + k], the others at the operands -- then the
 * loss's entry at rets[0]. Returns the number of entries. */
int64_t tg_gpu_plan(int64_t nargs, int64_t nw, const int64_t *slots, int64_t loss_slot, char *const *args,
                    char *const *rets, int64_t *idx, int64_t *ptr) {
  int64_t n = 0;
  for (int64_t k = 0; k < nargs; k++) {
    if (slots[k] < 0) continue;
    idx[n] = slots[k];
    ptr[n++] = (int64_t)(intptr_t)(k < nw ? rets[1 + k] : args[k]);
  }
  idx[n] = loss_slot;
  ptr[n++] = (int64_t)(intptr_t)rets[0];
  return n;
}

/* ── attributes ────────────────────────────────────────────────────────── */

typedef struct {
  int64_t graph, settab, table, table_len, ctl, loss_slot, loss_home, device, opt, hat;
  double lr, b1, b2;
  const int64_t *slots, *home;
  int64_t nslots, nhome;
} tg_gpu_attrs;

/* The attribute `name` of type `type`, or NULL. */
static void *tg_attr(XLA_FFI_CallFrame *cf, const char *name, XLA_FFI_AttrType type) {
  size_t len = strlen(name);
  for (int64_t k = 0; k < cf->attrs.size; k++) {
    XLA_FFI_ByteSpan *nm = cf->attrs.names[k];
    if (nm->len == len && !memcmp(nm->ptr, name, len) && cf->attrs.types[k] == type) return cf->attrs.attrs[k];
  }
  return NULL;
}

static const char *tg_gpu_decode(XLA_FFI_CallFrame *cf, tg_gpu_attrs *a, char *msg, size_t n) {
  static const char *const i64s[] = {"graph", "settab", "table", "table_len", "ctl", "loss_slot", "loss_home",
                                     "device", "opt", "hat"};
  int64_t *i64v[] = {&a->graph, &a->settab, &a->table, &a->table_len, &a->ctl, &a->loss_slot, &a->loss_home,
                     &a->device, &a->opt, &a->hat};
  for (size_t k = 0; k < sizeof i64s / sizeof *i64s; k++)
    if (!tg_attr_i64(cf, i64s[k], i64v[k])) {
      snprintf(msg, n, "tg_gpu_episode: missing i64 attribute '%s' (build the call with "
               "interop.program_episode_gpu)", i64s[k]);
      return msg;
    }
  static const char *const f64s[] = {"lr", "b1", "b2"};
  double *f64v[] = {&a->lr, &a->b1, &a->b2};
  for (size_t k = 0; k < sizeof f64s / sizeof *f64s; k++) {
    XLA_FFI_Scalar *s = tg_attr(cf, f64s[k], XLA_FFI_AttrType_SCALAR);
    if (!s || s->dtype != XLA_FFI_DataType_F64) {
      snprintf(msg, n, "tg_gpu_episode: missing f64 attribute '%s' (the optimizer's configuration)", f64s[k]);
      return msg;
    }
    *f64v[k] = *(double *)s->value;
  }
  static const char *const arrs[] = {"slots", "home"};
  const int64_t **arrv[] = {&a->slots, &a->home};
  int64_t *lens[] = {&a->nslots, &a->nhome};
  for (size_t k = 0; k < 2; k++) {
    XLA_FFI_Array *x = tg_attr(cf, arrs[k], XLA_FFI_AttrType_ARRAY);
    if (!x || x->dtype != XLA_FFI_DataType_S64) {
      snprintf(msg, n, "tg_gpu_episode: missing i64 array attribute '%s'", arrs[k]);
      return msg;
    }
    *arrv[k] = x->data;
    *lens[k] = (int64_t)x->size;
  }
  if (a->opt < 0 || a->opt > 2 || a->hat < 0 || a->hat > 1) {
    snprintf(msg, n, "tg_gpu_episode: attribute 'opt' must be 0 (none), 1 (SGD) or 2 (Adam) and 'hat' 0 or 1, "
             "got opt=%lld hat=%lld", (long long)a->opt, (long long)a->hat);
    return msg;
  }
  if (!a->graph || !a->settab || !a->table || !a->ctl) {
    snprintf(msg, n, "tg_gpu_episode: attributes graph, settab, table and ctl must be nonzero handles, got "
             "graph=%lld settab=%lld table=%lld ctl=%lld", (long long)a->graph, (long long)a->settab,
             (long long)a->table, (long long)a->ctl);
    return msg;
  }
  return NULL;
}

/* Arity, dtypes and sizes of the call against its attributes. */
static const char *tg_gpu_check(XLA_FFI_CallFrame *cf, const tg_gpu_attrs *a, char *msg, size_t n) {
  int64_t nargs = cf->args.size, nrets = cf->rets.size, nw = nrets - 2;
  if (nrets < 2 || nargs < nw + 1) {
    snprintf(msg, n, "tg_gpu_episode: the call has %lld operands and %lld results; an episode takes (params..., "
             "state..., count, inputs...) and gives (loss, params..., state..., count)", (long long)nargs,
             (long long)nrets);
    return msg;
  }
  if (a->nslots != nargs || a->nhome != nargs) {
    snprintf(msg, n, "tg_gpu_episode: attributes 'slots' and 'home' have %lld and %lld entries, the call has "
             "%lld operands", (long long)a->nslots, (long long)a->nhome, (long long)nargs);
    return msg;
  }
  for (int64_t k = -1; k < nargs; k++) {
    int64_t s = k < 0 ? a->loss_slot : a->slots[k];
    if (s < -1 || s >= a->table_len || (k < 0 && s < 0) || (k == nw && s != -1)) {
      snprintf(msg, n, "tg_gpu_episode: %s %lld names table entry %lld; the table has %lld entries%s",
               k < 0 ? "the loss" : "operand", (long long)(k < 0 ? 0 : k), (long long)s,
               (long long)a->table_len, k == nw ? " (and the count, operand nw, has none: -1)" : "");
      return msg;
    }
  }
  XLA_FFI_DataType dt = ((XLA_FFI_Buffer *)cf->rets.rets[0])->dtype;
  if (dt != XLA_FFI_DataType_F64 && dt != XLA_FFI_DataType_F32) {
    snprintf(msg, n, "tg_gpu_episode: the loss has XLA dtype %d; the program runs in float32 or float64", (int)dt);
    return msg;
  }
  for (int64_t k = 0; k < nargs + nrets; k++) {
    XLA_FFI_Buffer *b = k < nargs ? cf->args.args[k] : cf->rets.rets[k - nargs];
    int64_t e = tg_elems(b), want = k < nw ? tg_elems(cf->rets.rets[1 + k]) : k == nw || k == nargs ? 1 : e;
    if (b->dtype != dt || e != want) {
      snprintf(msg, n, "tg_gpu_episode: %s %lld has XLA dtype %d and %lld elements; expected dtype %d and %lld "
               "elements", k < nargs ? "operand" : "result", (long long)(k < nargs ? k : k - nargs), (int)b->dtype,
               (long long)e, (int)dt, (long long)want);
      return msg;
    }
  }
  return NULL;
}

/* ── the call ──────────────────────────────────────────────────────────── */

typedef struct { long long idx[TG_SETTAB]; long long ptr[TG_SETTAB]; int n; } tg_settab_arg;

/* settab over n (index, address) pairs, TG_SETTAB per launch; 0 or the failing driver result. */
static tg_cu_result tg_gpu_settab(const tg_gpu_attrs *a, void *stream, const int64_t *idx, const int64_t *ptr,
                                  int64_t n) {
  for (int64_t at = 0; at < n; at += TG_SETTAB) {
    tg_settab_arg tab;
    memset(&tab, 0, sizeof tab);
    tab.n = (int)(n - at < TG_SETTAB ? n - at : TG_SETTAB);
    for (int j = 0; j < tab.n; j++) {
      tab.idx[j] = idx[at + j];
      tab.ptr[j] = ptr[at + j];
    }
    void *vt = (void *)(intptr_t)a->table;
    void *params[] = {&vt, &tab};
    tg_cu_result r = tg_cu.LaunchKernel((void *)(intptr_t)a->settab, 1, 1, 1, TG_SETTAB, 1, 1, 0, stream, params,
                                        NULL);
    if (r) return r;
  }
  return 0;
}

static pthread_mutex_t tg_gpu_mu = PTHREAD_MUTEX_INITIALIZER;

#define TG_CU(call, what)                                                                   \
  do {                                                                                     \
    tg_cu_result r_ = (call);                                                              \
    if (r_) {                                                                              \
      char d_[160];                                                                        \
      tg_cu_describe(r_, d_, sizeof d_);                                                   \
      snprintf(msg, sizeof msg, "tg_gpu_episode: %s failed: %s", what, d_);                \
      goto fail;                                                                           \
    }                                                                                      \
  } while (0)

XLA_FFI_Error *tg_gpu_episode(XLA_FFI_CallFrame *cf) {
  if (tg_metadata(cf) || cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  char msg[1400];
  tg_gpu_attrs a;
  const char *why = tg_gpu_decode(cf, &a, msg, sizeof msg);
  if (!why) why = tg_gpu_check(cf, &a, msg, sizeof msg);
  if (why) return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, why);
  why = tg_cu_load();
  if (why) {
    snprintf(msg, sizeof msg, "tg_gpu_episode: %s", why);
    return tg_error(cf, XLA_FFI_Error_Code_FAILED_PRECONDITION, msg);
  }
  XLA_FFI_Stream_Get_Args sg;
  memset(&sg, 0, sizeof sg);
  sg.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  sg.ctx = cf->ctx;
  XLA_FFI_Error *e = cf->api->XLA_FFI_Stream_Get(&sg);
  if (e || !sg.stream) {
    const char *text = "no stream";
    XLA_FFI_Error_GetDetails_Args gm;
    memset(&gm, 0, sizeof gm);
    gm.struct_size = XLA_FFI_Error_GetDetails_Args_STRUCT_SIZE;
    gm.error = e;
    if (e) {
      cf->api->XLA_FFI_Error_GetDetails(&gm);
      if (gm.message) text = gm.message;
    }
    snprintf(msg, sizeof msg, "tg_gpu_episode: XLA gives this call no CUDA stream (%s); the target runs on the "
             "CUDA platform only", text);
    if (e) tg_drop_error(cf, e);
    return tg_error(cf, XLA_FFI_Error_Code_FAILED_PRECONDITION, msg);
  }
  void *stream = sg.stream;
  int device = tg_device(cf);
  if (device != a.device || device < 0 || device >= TG_MAX_DEVICES) {
    snprintf(msg, sizeof msg, "tg_gpu_episode: the program lives on CUDA device %lld, this call runs on device %d "
             "(capture one program per device)", (long long)a.device, device);
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, msg);
  }
  int64_t nargs = cf->args.size, nw = cf->rets.size - 2;
  size_t es = ((XLA_FFI_Buffer *)cf->rets.rets[0])->dtype == XLA_FFI_DataType_F64 ? 8 : 4;
  char *args[nargs], *rets[nw + 2];
  for (int64_t k = 0; k < nargs; k++) args[k] = tg_data(cf, 0, k);
  for (int64_t k = 0; k < nw + 2; k++) rets[k] = tg_data(cf, 1, k);
  int64_t idx[nargs + 1], ptr[nargs + 1], home[nargs + 1];
  int64_t nset = tg_gpu_plan(nargs, nw, a.slots, a.loss_slot, args, rets, idx, ptr);
  for (int64_t k = 0, j = 0; k < nargs; k++)
    if (a.slots[k] >= 0) home[j++] = a.home[k];
  home[nset - 1] = a.loss_home;

  pthread_mutex_lock(&tg_gpu_mu);
  int pushed = 0;
  void *ctx = tg_cu.ctx[device];
  if (!ctx) {
    int dev = 0;
    TG_CU(tg_cu.DeviceGet(&dev, device), "cuDeviceGet");
    TG_CU(tg_cu.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    tg_cu.ctx[device] = ctx;
  }
  TG_CU(tg_cu.CtxPushCurrent(ctx), "cuCtxPushCurrent");
  pushed = 1;
  for (int64_t k = 0; k < nw; k++)   /* aliased results are their operands; copy if XLA gave others */
    if (args[k] != rets[1 + k])
      TG_CU(tg_cu.MemcpyDtoDAsync((tg_cu_ptr)(intptr_t)rets[1 + k], (tg_cu_ptr)(intptr_t)args[k],
                                  (size_t)tg_elems(cf->rets.rets[1 + k]) * es, stream), "cuMemcpyDtoDAsync");
  union { double d; int32_t i; } cnt;   /* float32 programs: int32's bits (exact past 2**24) */
  TG_CU(tg_cu.MemcpyDtoHAsync(&cnt, (tg_cu_ptr)(intptr_t)args[nw], es, stream), "reading the count (cuMemcpyDtoHAsync)");
  TG_CU(tg_cu.StreamSynchronize(stream), "cuStreamSynchronize");
  double count = (es == 8 ? cnt.d : (double)cnt.i) + 1.0;
  double ctl[TG_CTL];
  tg_gpu_ctl(a.opt, a.hat, a.lr, a.b1, a.b2, count, ctl);
  if (es == 8) cnt.d = count; else cnt.i = (int32_t)count;
  /* host sources are pageable stack memory: the driver has staged them when these calls return */
  TG_CU(tg_cu.MemcpyHtoDAsync((tg_cu_ptr)a.ctl, ctl, sizeof ctl, stream), "uploading ctl (cuMemcpyHtoDAsync)");
  TG_CU(tg_gpu_settab(&a, stream, idx, ptr, nset), "settab (cuLaunchKernel)");
  TG_CU(tg_cu.GraphLaunch((void *)(intptr_t)a.graph, stream), "replaying the episode (cuGraphLaunch)");
  TG_CU(tg_gpu_settab(&a, stream, idx, home, nset), "settab back (cuLaunchKernel)");
  TG_CU(tg_cu.MemcpyHtoDAsync((tg_cu_ptr)(intptr_t)rets[nw + 1], &cnt, es, stream), "writing the count (cuMemcpyHtoDAsync)");
  TG_CU(tg_cu.CtxPopCurrent(&ctx), "cuCtxPopCurrent");
  pthread_mutex_unlock(&tg_gpu_mu);
  return NULL;
fail:
  if (pushed) tg_cu.CtxPopCurrent(&ctx);
  pthread_mutex_unlock(&tg_gpu_mu);
  return tg_error(cf, XLA_FFI_Error_Code_INTERNAL, msg);
}
