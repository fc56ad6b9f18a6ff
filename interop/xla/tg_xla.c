/* XLA FFI handlers that run captured tapegrad programs (plain C against xla/ffi/api/c_api.h).
 *
 * A program is found by its content hash (attribute `prog`, an i64) in a process-wide table that
 * interop fills from Program.native_abi(); nothing in the HLO is a raw pointer. The handlers run the
 * program on XLA's buffers: each device has its own instance of the program -- a private copy of its
 * pointer table, and (every device but the first to run it) private copies of its value, gradient
 * and scratch buffers -- whose slot entries (parameters, inputs, optimizer state, gradients) are pointed at the
 * operands and results XLA passes before the program's entry point runs. Nothing is copied but the
 * loss and the step counter. Shards on different host devices run in parallel; calls on one device
 * take that instance's mutex. Leading batch dimensions (vmap with "broadcast_all") are looped over:
 * every operand must hold the same number B of slot-sized blocks, and every result gets B blocks.
 *
 * Aliasing: the generated functions declare their buffers `restrict`, which C allows for buffers
 * that alias as long as none of them is written through. Operands are only read, so XLA may pass one
 * buffer for several of them. Written slots (the episode's parameters and optimizer state) are
 * pointed at XLA's results (the same buffers as their aliased operands), which XLA never shares with
 * another operand; a written slot that overlaps an input anyway runs on the instance's own buffer,
 * copied in and out.
 *
 * Targets (one handler each):
 *   tg_value           (params..., inputs...)                   -> (loss)
 *   tg_value_and_grad  (params..., inputs...)                   -> (loss, grads...)
 *   tg_episode         (params..., state..., count, inputs...)  -> (loss, params..., state..., count)
 *   tg_episode_flat    (flat state [params|state|count], inputs...) -> (loss, flat state)
 * The episode's params/state/count results alias their operands (input_output_aliases). A float32
 * program's count carries int32's bits (exact past 2**24); a float64 one holds the value. With the
 * attribute `data` = 1 every call also passes the program's data slots (int32/int64, bool) last; with
 * `lr` = 1 an episode passes this step's learning rate (a scalar, before the data). With `steps` = K
 * an episode runs K steps in one call: its inputs, learning rate and data hold K blocks (one per step,
 * in order), the state is carried in place from step to step, and the loss result holds K values.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*tg_fn)(void *);
#define TG_MAX_DEVICES 256

/* The generated code's view of a thread pool (runtime.c's tg_team, at table entry 6). */
typedef struct tg_team {
  void (*run)(struct tg_team *self, int parts, void (*fn)(void *, int), void *arg);
  long min_mnk;
  int parts;
  long min_upd;
} tg_team;

/* One device's instance: `base` is the table the program runs on between calls (its own buffers),
 * `run` the copy whose slot entries point at XLA's buffers, `snap` the program's table it was made
 * from (a changed table -- an optimizer attached since -- rebuilds the instance). */
typedef struct {
  tg_team pool;             /* first: the generated code's tg_team is this instance */
  XLA_FFI_CallFrame *cf;    /* the call running on this instance (its ctx schedules pool tasks) */
  void (*fn)(void *, int);  /* the split product being run: part i is fn(arg, i) */
  void *arg;
  uint64_t state;           /* generation << 32 | parts << 16 | next part to claim */
  int64_t splits;           /* products split so far (diagnostics) */
  int done;                 /* parts finished */
  uint64_t *snap, *base, *run;
  double sc[8];
  int64_t *pairs, npairs;   /* (table index, slot) for every entry that names a slot's buffer */
  void **owned;             /* buffers this instance allocated (every device but the first) */
  int64_t nowned;
  int ns, nm;               /* optimizer state slots the table has: nm per parameter (Adam's mu and nu: 2;
                               momentum SGD's trace: 1) */
  pthread_mutex_t mu;
} tg_inst;

typedef struct tg_prog {
  uint64_t hash;
  tg_fn forward, backward, episode;
  const uint64_t *table;    /* the program's own pointer table (Program.native_abi()["ctx"]) */
  const int64_t *sizes;     /* byte size of each table entry's buffer */
  int64_t tlen, esize, np, ni, ns, loss;
  int64_t *index;           /* table index of each slot: np params, ni inputs, np grads (-1: none) */
  int64_t nd;               /* data slots (integer, bool) a call may pass after its float operands */
  int64_t *dindex, *dsize;  /* their table indices and element sizes (8: int64, 1: bool) */
  int (*blas_get)(void);    /* OpenBLAS's thread count get/set (NULL: not OpenBLAS) */
  void (*blas_set)(int);
  int64_t big;              /* products large enough for OpenBLAS to start its own threads */
  int64_t min_mnk;          /* products split over XLA's thread pool from this size (0: never) */
  int64_t min_upd;          /* optimizer updates split over it from this many parameters (0: never) */
  tg_inst *inst[TG_MAX_DEVICES];   /* instances in the order devices first ran the program */
  int32_t device[TG_MAX_DEVICES];  /* their device ordinals (XLA's ids: 2048+ in another process) */
  pthread_mutex_t mu;       /* guards creating instances */
  struct tg_prog *next;
} tg_prog;

/* slot numbering in tg_inst.pairs: params, inputs, grads, then optimizer state */
#define TG_SLOT_INPUT(p, k) ((p)->np + (k))
#define TG_SLOT_GRAD(p, k) ((p)->np + (p)->ni + (k))
#define TG_SLOT_STATE(p, k) (2 * (p)->np + (p)->ni + (k))
#define TG_NSLOTS(p) (2 * (p)->np + (p)->ni + (p)->ns)

#define TG_BUCKETS 64
static tg_prog *tg_table[TG_BUCKETS];
static pthread_mutex_t tg_table_mu = PTHREAD_MUTEX_INITIALIZER;

static tg_prog *tg_find(uint64_t hash) {
  pthread_mutex_lock(&tg_table_mu);
  tg_prog *p = tg_table[hash % TG_BUCKETS];
  while (p && p->hash != hash) p = p->next;
  pthread_mutex_unlock(&tg_table_mu);
  return p;
}

/* Load (or replace) a program. `desc` = [hash, forward, backward, episode, table, sizes, table_len,
 * loss_index, esize, np, ni, ns, then np param indices, ni input indices, np grad indices, then
 * blas_get, blas_set, big, min_mnk, min_upd, nd, then nd data indices, nd data element sizes]. Entries are never freed while the process runs (an executable
 * may still name the hash); unloading only unlinks. */
int tg_load(const int64_t *desc) {
  tg_prog *p = calloc(1, sizeof *p);
  if (!p) return -1;
  p->hash = (uint64_t)desc[0];
  p->forward = (tg_fn)(intptr_t)desc[1];
  p->backward = (tg_fn)(intptr_t)desc[2];
  p->episode = (tg_fn)(intptr_t)desc[3];
  p->table = (const uint64_t *)(intptr_t)desc[4];
  p->sizes = (const int64_t *)(intptr_t)desc[5];
  p->tlen = desc[6];
  p->loss = desc[7];
  p->esize = desc[8];
  p->np = desc[9];
  p->ni = desc[10];
  p->ns = desc[11];
  int64_t n = 2 * p->np + p->ni;
  p->index = malloc((n ? n : 1) * sizeof *p->index);
  if (!p->index) { free(p); return -1; }
  memcpy(p->index, desc + 12, n * sizeof *p->index);
  p->blas_get = (int (*)(void))(intptr_t)desc[12 + n];
  p->blas_set = (void (*)(int))(intptr_t)desc[13 + n];
  p->big = desc[14 + n];
  p->min_mnk = desc[15 + n];
  p->min_upd = desc[16 + n];
  p->nd = desc[17 + n];
  p->dindex = malloc((2 * p->nd + 1) * sizeof *p->dindex);
  if (!p->dindex) { free(p->index); free(p); return -1; }
  memcpy(p->dindex, desc + 18 + n, 2 * p->nd * sizeof *p->dindex);
  p->dsize = p->dindex + p->nd;
  pthread_mutex_init(&p->mu, NULL);
  pthread_mutex_lock(&tg_table_mu);
  tg_prog **at = &tg_table[p->hash % TG_BUCKETS];
  for (tg_prog **q = at; *q; q = &(*q)->next)
    if ((*q)->hash == p->hash) { *q = (*q)->next; break; }   /* the old entry is leaked on purpose */
  p->next = *at;
  *at = p;
  pthread_mutex_unlock(&tg_table_mu);
  return 0;
}

int tg_unload(int64_t hash) {
  pthread_mutex_lock(&tg_table_mu);
  int found = 0;
  for (tg_prog **q = &tg_table[(uint64_t)hash % TG_BUCKETS]; *q; q = &(*q)->next)
    if ((*q)->hash == (uint64_t)hash) { *q = (*q)->next; found = 1; break; }
  pthread_mutex_unlock(&tg_table_mu);
  return found;
}

/* ── per-device instances ──────────────────────────────────────────────── */

#define TG_FIRST 8

static void tg_inst_clear(tg_inst *in) {
  for (int64_t k = 0; k < in->nowned; k++) free(in->owned[k]);
  free(in->owned);
  free(in->snap);
  free(in->base);
  free(in->run);
  free(in->pairs);
  in->owned = NULL;
  in->snap = in->base = in->run = NULL;
  in->pairs = NULL;
  in->nowned = in->npairs = 0;
}

/* The table index of optimizer state slot j (0-based among the state slots): row j / nm of the parameter
 * table (T[4]), its mu (or trace) or nu column. */
static int64_t tg_state_entry(const tg_inst *in, const long long *pinfo, int64_t j) {
  return TG_FIRST + pinfo[8 * (j / in->nm) + 3 + j % in->nm];
}

/* (Re)build `in` from the program's current table. The first device that ran the program (slot 0)
 * runs on the program's own buffers; the others get copies of every buffer (entries naming one
 * buffer keep naming one copy). */
static const char *tg_inst_build(tg_prog *p, tg_inst *in, int slot) {
  int64_t n = p->tlen;
  tg_inst_clear(in);
  in->snap = malloc(n * sizeof *in->snap);
  in->base = malloc(n * sizeof *in->base);
  in->run = malloc(n * sizeof *in->run);
  in->pairs = malloc(2 * n * sizeof *in->pairs);
  in->owned = calloc(n, sizeof *in->owned);
  if (!in->snap || !in->base || !in->run || !in->pairs || !in->owned) return "out of memory";
  memcpy(in->snap, p->table, n * sizeof *in->snap);
  memcpy(in->base, p->table, n * sizeof *in->base);
  memcpy(in->sc, (const double *)(intptr_t)p->table[2], sizeof in->sc);
  in->base[2] = (uint64_t)(intptr_t)in->sc;
  if (slot > 0)
    for (int64_t i = TG_FIRST; i < n; i++) {
      if (!in->snap[i]) continue;
      int64_t j = TG_FIRST;
      while (j < i && in->snap[j] != in->snap[i]) j++;
      if (j < i) { in->base[i] = in->base[j]; continue; }
      size_t sz = (size_t)p->sizes[i];
      /* entries sharing a pointer (a reshape's view, nodes placed by liveness) share one buffer of the
         largest of their sizes */
      for (int64_t k = i + 1; k < n; k++)
        if (in->snap[k] == in->snap[i] && (size_t)p->sizes[k] > sz) sz = (size_t)p->sizes[k];
      void *b = aligned_alloc(64, sz ? (sz + 63) / 64 * 64 : 64);
      if (!b) return "out of memory for a device's buffers";
      memcpy(b, (void *)(intptr_t)in->snap[i], sz);
      in->owned[in->nowned++] = b;
      in->base[i] = (uint64_t)(intptr_t)b;
    }
  /* the optimizer's state slots are its [mu, nu] rows in the parameter table (T[4]) */
  const double *cfg = (const double *)(intptr_t)p->table[3];
  const long long *pinfo = (const long long *)(intptr_t)p->table[4];
  int nopt = (int)cfg[8];
  in->nm = cfg[0] == 2.0 ? 2 : cfg[0] == 1.0 && cfg[9] != 0.0 ? 1 : 0;
  in->ns = in->nm * nopt;
  int64_t nslots = TG_NSLOTS(p);
  in->npairs = 0;
  memcpy(in->run, in->base, n * sizeof *in->run);
  for (int64_t s = 0; s < nslots; s++) {
    int64_t primary;
    if (s < TG_SLOT_STATE(p, 0)) primary = p->index[s];
    else {
      int64_t k = s - TG_SLOT_STATE(p, 0);
      primary = k < in->ns ? tg_state_entry(in, pinfo, k) : -1;
    }
    if (primary < 0) continue;
    for (int64_t i = TG_FIRST; i < n; i++)
      if (in->snap[i] == in->snap[primary]) {
        in->pairs[2 * in->npairs] = i;
        in->pairs[2 * in->npairs + 1] = s;
        in->npairs++;
      }
  }
  return NULL;
}

/* The instance for `device`, current with the program's table, locked; NULL with *why set. */
static tg_inst *tg_acquire(tg_prog *p, int device, const char **why) {
  int slot = 0;
  tg_inst *in = NULL;
  for (; slot < TG_MAX_DEVICES && (in = __atomic_load_n(&p->inst[slot], __ATOMIC_ACQUIRE)); slot++)
    if (p->device[slot] == device) break;
  if (slot == TG_MAX_DEVICES) in = NULL;
  if (!in) {   /* the device's first call: a new instance in the next free slot */
    pthread_mutex_lock(&p->mu);
    for (slot = 0; slot < TG_MAX_DEVICES && p->inst[slot] && p->device[slot] != device; slot++)
      ;
    if (slot == TG_MAX_DEVICES) {
      pthread_mutex_unlock(&p->mu);
      *why = "more devices than the handler has instances for (256)";
      return NULL;
    }
    in = p->inst[slot];
    if (!in) {
      in = calloc(1, sizeof *in);
      if (in) {
        pthread_mutex_init(&in->mu, NULL);
        p->device[slot] = device;
        __atomic_store_n(&p->inst[slot], in, __ATOMIC_RELEASE);
      }
    }
    pthread_mutex_unlock(&p->mu);
    if (!in) { *why = "out of memory"; return NULL; }
  }
  pthread_mutex_lock(&in->mu);
  if (!in->snap || memcmp(in->snap, p->table, p->tlen * sizeof *in->snap)) {
    *why = tg_inst_build(p, in, slot);
    if (*why) { tg_inst_clear(in); pthread_mutex_unlock(&in->mu); return NULL; }
  }
  return in;
}

/* An error XLA returned that the caller handles itself: freed, not passed on. */
static void tg_drop_error(XLA_FFI_CallFrame *cf, XLA_FFI_Error *e) {
  XLA_FFI_Error_Destroy_Args d;
  memset(&d, 0, sizeof d);
  d.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  d.error = e;
  cf->api->XLA_FFI_Error_Destroy(&d);
}

/* ── the thread pool the generated code splits large products over ──────── */

/* Claim parts of the current split product until none is left (the caller and pool tasks alike). */
static void tg_pool_work(tg_inst *in) {
  for (;;) {
    uint64_t s = __atomic_load_n(&in->state, __ATOMIC_ACQUIRE);
    uint64_t next = s & 0xffff, parts = (s >> 16) & 0xffff;
    if (next >= parts) return;
    if (!__atomic_compare_exchange_n(&in->state, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
    in->fn(in->arg, (int)next);
    __atomic_add_fetch(&in->done, 1, __ATOMIC_RELEASE);
  }
}

/* A pool task. It may start late, after its product is finished (it then finds no part to claim)
 * or during a later one (it helps with that): instances are never freed, so `in` stays valid. */
static void tg_pool_task(void *data) { tg_pool_work((tg_inst *)data); }

/* tg_team.run: parts-1 tasks on XLA's intra-op pool, the calling thread claiming parts too, so the
 * product completes even if no task ever runs (XLA promises no parallelism); returns when all are done. */
static void tg_pool_run(tg_team *self, int parts, void (*fn)(void *, int), void *arg) {
  tg_inst *in = (tg_inst *)self;
  XLA_FFI_CallFrame *cf = in->cf;
  in->splits++;
  in->fn = fn;
  in->arg = arg;
  __atomic_store_n(&in->done, 0, __ATOMIC_RELAXED);
  uint64_t gen = (__atomic_load_n(&in->state, __ATOMIC_RELAXED) >> 32) + 1;
  __atomic_store_n(&in->state, gen << 32 | (uint64_t)parts << 16, __ATOMIC_RELEASE);
  for (int t = 1; t < parts; t++) {
    XLA_FFI_ThreadPool_Schedule_Args a;
    memset(&a, 0, sizeof a);
    a.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
    a.ctx = cf->ctx;
    a.task = tg_pool_task;
    a.data = in;
    XLA_FFI_Error *e = cf->api->XLA_FFI_ThreadPool_Schedule(&a);
    if (e) {
      tg_drop_error(cf, e);
      break;
    }
  }
  tg_pool_work(in);
  while (__atomic_load_n(&in->done, __ATOMIC_ACQUIRE) < parts) sched_yield();
}

/* Parts per split product: XLA's intra-op pool size (1, never split, when it has none). */
static int tg_pool_parts(XLA_FFI_CallFrame *cf) {
  XLA_FFI_ThreadPool_NumThreads_Args a;
  int64_t n = 0;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
  a.ctx = cf->ctx;
  a.num_threads = &n;
  XLA_FFI_Error *e = cf->api->XLA_FFI_ThreadPool_NumThreads(&a);
  if (e) {
    tg_drop_error(cf, e);
    return 1;
  }
  return n < 1 ? 1 : n > 64 ? 64 : (int)n;
}

/* While any handler runs a program with large products, OpenBLAS runs single-threaded: its own
 * spinning threads next to XLA's on the same cores stalled calls by up to ~100 ms; XLA's pool does
 * the parallel work instead (tg_pool_run). The count is restored when the last such handler ends. */
static pthread_mutex_t tg_blas_mu = PTHREAD_MUTEX_INITIALIZER;
static int tg_blas_users, tg_blas_saved;

static void tg_blas_enter(tg_prog *p) {
  if (!p->big || !p->blas_set) return;
  pthread_mutex_lock(&tg_blas_mu);
  if (tg_blas_users++ == 0) {
    tg_blas_saved = p->blas_get ? p->blas_get() : 1;
    if (tg_blas_saved != 1) p->blas_set(1);
  }
  pthread_mutex_unlock(&tg_blas_mu);
}

static void tg_blas_leave(tg_prog *p) {
  if (!p->big || !p->blas_set) return;
  pthread_mutex_lock(&tg_blas_mu);
  if (--tg_blas_users == 0 && tg_blas_saved != 1) p->blas_set(tg_blas_saved);
  pthread_mutex_unlock(&tg_blas_mu);
}

/* Before running an instance for call frame cf: its pool (table entry 6) and BLAS's thread count. */
static void tg_begin_run(tg_prog *p, tg_inst *in, XLA_FFI_CallFrame *cf) {
  in->cf = cf;
  in->pool.run = tg_pool_run;
  in->pool.min_mnk = p->min_mnk;
  in->pool.min_upd = p->min_upd;
  in->pool.parts = p->min_mnk > 0 || p->min_upd > 0 ? tg_pool_parts(cf) : 1;
  in->run[6] = (uint64_t)(intptr_t)&in->pool;
  tg_blas_enter(p);
}

/* Point the run table's slot entries at `ptr[slot]` (NULL: the instance's own buffer). */
static void tg_point(tg_inst *in, char **ptr) {
  for (int64_t k = 0; k < in->npairs; k++) {
    int64_t i = in->pairs[2 * k];
    char *q = ptr[in->pairs[2 * k + 1]];
    in->run[i] = q ? (uint64_t)(intptr_t)q : in->base[i];
  }
}

/* ── FFI plumbing ──────────────────────────────────────────────────────── */

static XLA_FFI_Error *tg_error(XLA_FFI_CallFrame *cf, XLA_FFI_Error_Code code, const char *msg) {
  XLA_FFI_Error_Create_Args a;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  a.message = msg;
  a.errc = code;
  return cf->api->XLA_FFI_Error_Create(&a);
}

/* Answer XLA's registration-time metadata query; 1 when it was one. */
static int tg_metadata(XLA_FFI_CallFrame *cf) {
  XLA_FFI_InternalExtension *e = cf->extension_start;
  if (!e || e->type != XLA_FFI_Extension_Metadata) return 0;
  XLA_FFI_Metadata_Extension *m = (XLA_FFI_Metadata_Extension *)e;
  m->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
  m->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
  m->metadata->traits = 0;
  return 1;
}

static int tg_attr_i64(XLA_FFI_CallFrame *cf, const char *name, int64_t *out) {
  size_t len = strlen(name);
  for (int64_t k = 0; k < cf->attrs.size; k++) {
    XLA_FFI_ByteSpan *n = cf->attrs.names[k];
    if (n->len == len && !memcmp(n->ptr, name, len) && cf->attrs.types[k] == XLA_FFI_AttrType_SCALAR) {
      XLA_FFI_Scalar *s = cf->attrs.attrs[k];
      if (s->dtype != XLA_FFI_DataType_S64) return 0;
      *out = *(int64_t *)s->value;
      return 1;
    }
  }
  return 0;
}

static int64_t tg_elems(XLA_FFI_Buffer *b) {
  int64_t n = 1;
  for (int64_t k = 0; k < b->rank; k++) n *= b->dims[k];
  return n;
}

typedef struct { char msg[256]; tg_prog *p; int64_t nd, lr; } tg_call;

/* Whether an operand of XLA dtype t can fill a data slot of elements of `size` bytes. */
static int tg_data_fits(int t, int64_t size) {
  if (size == 8) return t == XLA_FFI_DataType_S32 || t == XLA_FFI_DataType_S64;
  return t == XLA_FFI_DataType_PRED || t == XLA_FFI_DataType_S8 || t == XLA_FFI_DataType_U8;
}

/* Copy batch element b of data operand `x` (n elements) into the slot buffer `dst`, widening int32. */
static void tg_data_copy(char *dst, int64_t size, const XLA_FFI_Buffer *x, int64_t n, int64_t b) {
  if (size == 8 && x->dtype == XLA_FFI_DataType_S32) {
    const int32_t *src = (const int32_t *)x->data + b * n;
    for (int64_t i = 0; i < n; i++) ((int64_t *)dst)[i] = src[i];
  } else if (size == 8) {
    memcpy(dst, (const int64_t *)x->data + b * n, n * 8);
  } else {
    const unsigned char *src = (const unsigned char *)x->data + b * n;
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] != 0;
  }
}

/* Common prologue: metadata, stage, program lookup, arity. NULL on success (p set). */
enum { TG_VALUE, TG_VALUE_AND_GRAD, TG_EPISODE, TG_EPISODE_FLAT };

static XLA_FFI_Error *tg_begin(XLA_FFI_CallFrame *cf, const char *who, int mode, tg_call *c, int *meta) {
  c->p = NULL;
  *meta = tg_metadata(cf);
  if (*meta || cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  int64_t h;
  if (!tg_attr_i64(cf, "prog", &h)) {
    snprintf(c->msg, sizeof c->msg, "%s: missing i64 attribute 'prog' (the program's content hash)", who);
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c->msg);
  }
  c->p = tg_find((uint64_t)h);
  if (!c->p) {
    snprintf(c->msg, sizeof c->msg, "%s: tapegrad program %016llx is not loaded in this process; "
             "build the call with interop.program_call/program_episode(program) here first", who,
             (unsigned long long)(uint64_t)h);
    return tg_error(cf, XLA_FFI_Error_Code_FAILED_PRECONDITION, c->msg);
  }
  tg_prog *p = c->p;
  int64_t data = 0, lr = 0;
  tg_attr_i64(cf, "data", &data);
  if (tg_attr_i64(cf, "lr", &lr) && lr && mode != TG_EPISODE && mode != TG_EPISODE_FLAT) {
    snprintf(c->msg, sizeof c->msg, "%s: a learning-rate operand is taken by the episodes only", who);
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c->msg);
  }
  c->nd = data ? p->nd : 0;
  c->lr = lr != 0;
  int64_t nargs = (mode == TG_EPISODE ? p->np + p->ns + 1 + p->ni : mode == TG_EPISODE_FLAT ? 1 + p->ni
                   : p->np + p->ni) + c->lr + c->nd;
  int64_t nrets = mode == TG_VALUE ? 1 : mode == TG_VALUE_AND_GRAD ? 1 + p->np : mode == TG_EPISODE_FLAT ? 2
                 : 1 + p->np + p->ns + 1;
  if (cf->args.size != nargs || cf->rets.size != nrets) {
    snprintf(c->msg, sizeof c->msg, "%s: program %016llx takes %lld operands and gives %lld results, "
             "the call has %lld and %lld", who, (unsigned long long)p->hash, (long long)nargs,
             (long long)nrets, (long long)cf->args.size, (long long)cf->rets.size);
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c->msg);
  }
  XLA_FFI_DataType want = p->esize == 8 ? XLA_FFI_DataType_F64 : XLA_FFI_DataType_F32;
  for (int64_t k = 0; k < cf->args.size; k++) {
    XLA_FFI_Buffer *b = cf->args.args[k];
    int64_t d = k - (cf->args.size - c->nd);   /* >= 0: data operand d */
    if (d >= 0 && !tg_data_fits(b->dtype, p->dsize[d])) {
      snprintf(c->msg, sizeof c->msg, "%s: data operand %lld has XLA dtype %d; the program's data[%lld] holds %s",
               who, (long long)d, (int)b->dtype, (long long)d,
               p->dsize[d] == 8 ? "integers (int32 or int64)" : "booleans (bool, int8 or uint8)");
      return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c->msg);
    }
    if (d < 0 && b->dtype != want) {
      snprintf(c->msg, sizeof c->msg, "%s: operand %lld has XLA dtype %d, the program runs in %s", who,
               (long long)k, (int)b->dtype, p->esize == 8 ? "float64" : "float32");
      return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c->msg);
    }
  }
  return NULL;
}

/* The batch count B of operand k against slot size n (B·n elements), or -1 with a message. */
static int64_t tg_batch(XLA_FFI_CallFrame *cf, const char *who, int64_t k, int64_t n, const char *slot,
                        int64_t j, int64_t B, tg_call *c) {
  int64_t e = tg_elems(cf->args.args[k]);
  int64_t b = n ? e / n : 1;
  if (!n || b * n != e || (B >= 0 && b != B)) {
    snprintf(c->msg, sizeof c->msg, "%s: operand %lld has %lld elements; the program's %s[%lld] holds %lld%s",
             who, (long long)k, (long long)e, slot, (long long)j, (long long)n,
             B >= 0 ? " per batch element, and the batch must match the other operands" : "");
    return -1;
  }
  return b;
}

static int64_t tg_slot_elems(tg_prog *p, int64_t s) {
  int64_t i = p->index[s < TG_SLOT_GRAD(p, 0) ? s : s - p->np - p->ni];   /* a grad has its param's size */
  return p->sizes[i] / p->esize;
}

/* The device this call runs on (0 when the runtime cannot say). */
static int tg_device(XLA_FFI_CallFrame *cf) {
  XLA_FFI_DeviceOrdinal_Get_Args a;
  memset(&a, 0, sizeof a);
  a.struct_size = XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE;
  a.ctx = cf->ctx;
  if (cf->api->struct_size < XLA_FFI_Api_STRUCT_SIZE || !cf->api->XLA_FFI_DeviceOrdinal_Get) return 0;
  XLA_FFI_Error *e = cf->api->XLA_FFI_DeviceOrdinal_Get(&a);
  if (e) {
    tg_drop_error(cf, e);
    return 0;
  }
  return a.device_ordinal;
}

static char *tg_data(XLA_FFI_CallFrame *cf, int ret, int64_t k) {
  return ((XLA_FFI_Buffer *)(ret ? cf->rets.rets[k] : cf->args.args[k]))->data;
}

static XLA_FFI_Error *tg_run(XLA_FFI_CallFrame *cf, const char *who, int grads) {
  tg_call c;
  int meta;
  XLA_FFI_Error *err = tg_begin(cf, who, grads ? TG_VALUE_AND_GRAD : TG_VALUE, &c, &meta);
  if (err || meta || cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return err;
  tg_prog *p = c.p;
  int64_t B = -1;
  for (int64_t k = 0; k < p->np + p->ni; k++) {
    B = tg_batch(cf, who, k, tg_slot_elems(p, k), k < p->np ? "params" : "inputs", k < p->np ? k : k - p->np,
                 B, &c);
    if (B < 0) return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  }
  for (int64_t d = 0; d < c.nd; d++) {
    B = tg_batch(cf, who, p->np + p->ni + d, p->sizes[p->dindex[d]] / p->dsize[d], "data", d, B, &c);
    if (B < 0) return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  }
  if (grads && !p->backward) return tg_error(cf, XLA_FFI_Error_Code_UNIMPLEMENTED, "tg_value_and_grad: no backward");
  const char *why = NULL;
  tg_inst *in = tg_acquire(p, tg_device(cf), &why);
  if (!in) {
    snprintf(c.msg, sizeof c.msg, "%s: %s", who, why);
    return tg_error(cf, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, c.msg);
  }
  int64_t es = p->esize, nslots = TG_NSLOTS(p);
  char *ptr[nslots ? nslots : 1];
  memset(ptr, 0, sizeof ptr);
  tg_begin_run(p, in, cf);
  for (int64_t b = 0; b < B; b++) {
    for (int64_t k = 0; k < p->np + p->ni; k++)
      ptr[k] = tg_data(cf, 0, k) + b * tg_slot_elems(p, k) * es;
    for (int64_t k = 0; grads && k < p->np; k++) {
      char *g = tg_data(cf, 1, 1 + k) + b * tg_slot_elems(p, k) * es;
      if (p->index[TG_SLOT_GRAD(p, k)] >= 0) ptr[TG_SLOT_GRAD(p, k)] = g;
      else memset(g, 0, tg_slot_elems(p, k) * es);   /* backward does not reach it: zeros */
    }
    tg_point(in, ptr);
    for (int64_t d = 0; d < c.nd; d++) {
      int64_t i = p->dindex[d], n = p->sizes[i] / p->dsize[d];
      tg_data_copy((char *)(intptr_t)in->base[i], p->dsize[d], cf->args.args[p->np + p->ni + d], n, b);
    }
    p->forward(in->run);
    if (grads) p->backward(in->run);
    memcpy(tg_data(cf, 1, 0) + b * es, (char *)(intptr_t)in->run[p->loss], es);
  }
  tg_blas_leave(p);
  pthread_mutex_unlock(&in->mu);
  return NULL;
}

XLA_FFI_Error *tg_value(XLA_FFI_CallFrame *cf) { return tg_run(cf, "tg_value", 0); }
XLA_FFI_Error *tg_value_and_grad(XLA_FFI_CallFrame *cf) { return tg_run(cf, "tg_value_and_grad", 1); }

static int tg_overlap(const char *a, int64_t na, const char *b, int64_t nb) {
  return a < b + nb && b < a + na;
}

/* The episode, in two operand layouts: separate buffers (params..., state..., count, inputs...) ->
 * (loss, params..., state..., count), or one flat state vector [params | state | count] (fewer
 * operands: less dispatch work for XLA per call): (state, inputs...) -> (loss, state). */
static XLA_FFI_Error *tg_episode_impl(XLA_FFI_CallFrame *cf, const char *who, int flat) {
  tg_call c;
  int meta;
  XLA_FFI_Error *err = tg_begin(cf, who, flat ? TG_EPISODE_FLAT : TG_EPISODE, &c, &meta);
  if (err || meta || cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return err;
  tg_prog *p = c.p;
  int64_t np = p->np, ns = p->ns, ni = p->ni, es = p->esize;
  if (!p->episode) return tg_error(cf, XLA_FFI_Error_Code_UNIMPLEMENTED, "tg_episode: the program has no episode");
  const char *why = NULL;
  tg_inst *in = tg_acquire(p, tg_device(cf), &why);
  if (!in) {
    snprintf(c.msg, sizeof c.msg, "%s: %s", who, why);
    return tg_error(cf, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, c.msg);
  }
  if (in->ns != ns) {
    pthread_mutex_unlock(&in->mu);
    snprintf(c.msg, sizeof c.msg, "%s: the program's optimizer has %d state arrays, the call passes %lld; "
             "rebuild the call after attaching an optimizer", who, in->ns, (long long)ns);
    return tg_error(cf, XLA_FFI_Error_Code_FAILED_PRECONDITION, c.msg);
  }
  /* sizes of the written slots: params, then state (each state array has its parameter's size) */
  const long long *pinfo = (const long long *)(intptr_t)p->table[4];
  int64_t nw = np + ns, total = 1;
  int64_t wn[nw ? nw : 1];
  for (int64_t k = 0; k < nw; k++) {
    wn[k] = k < np ? tg_slot_elems(p, k) : pinfo[8 * ((k - np) / in->nm) + 5];
    total += wn[k];
  }
  int64_t first_input = flat ? 1 : nw + 1, first_data = first_input + ni + c.lr, K = 1;
  if (tg_attr_i64(cf, "steps", &K) && K < 1) K = 1;
  int bad = flat && tg_batch(cf, who, 0, total, "flat state", 0, 1, &c) < 0;
  bad = bad || (c.lr && tg_batch(cf, who, first_input + ni, 1, "lr", 0, K, &c) < 0);
  for (int64_t d = 0; !bad && d < c.nd; d++)
    bad = tg_batch(cf, who, first_data + d, p->sizes[p->dindex[d]] / p->dsize[d], "data", d, K, &c) < 0;
  for (int64_t k = flat ? first_input : 0; !bad && k < first_input + ni; k++) {
    int64_t n = k >= first_input ? tg_slot_elems(p, TG_SLOT_INPUT(p, k - first_input)) : k < nw ? wn[k] : 1;
    const char *slot = k >= first_input ? "inputs" : k < np ? "params" : k < nw ? "opt_state" : "count";
    int64_t j = k >= first_input ? k - first_input : k < np ? k : k < nw ? k - np : 0;
    bad = tg_batch(cf, who, k, n, slot, j, k >= first_input ? K : 1, &c) < 0;
  }
  if (!bad && tg_elems(cf->rets.rets[0]) != K) {
    snprintf(c.msg, sizeof c.msg, "%s: the loss result holds %lld values for %lld steps", who,
             (long long)tg_elems(cf->rets.rets[0]), (long long)K);
    bad = 1;
  }
  if (bad) {
    pthread_mutex_unlock(&in->mu);
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  }
  int64_t nslots = TG_NSLOTS(p);
  char *ptr[nslots ? nslots : 1], *src[nw ? nw : 1], *dst[nw ? nw : 1];
  memset(ptr, 0, sizeof ptr);
  for (int64_t k = 0; k < ni; k++)
    ptr[TG_SLOT_INPUT(p, k)] = tg_data(cf, 0, first_input + k);
  int64_t off = 0;
  for (int64_t k = 0; k < nw; k++) {   /* written slots work in the result (aliased to the operand) */
    src[k] = flat ? tg_data(cf, 0, 0) + off : tg_data(cf, 0, k);
    dst[k] = flat ? tg_data(cf, 1, 1) + off : tg_data(cf, 1, 1 + k);
    off += wn[k] * es;
    if (src[k] != dst[k]) memmove(dst[k], src[k], wn[k] * es);
    int clash = 0;
    for (int64_t j = 0; j < ni; j++)
      clash |= tg_overlap(dst[k], wn[k] * es, ptr[TG_SLOT_INPUT(p, j)],
                          K * tg_slot_elems(p, TG_SLOT_INPUT(p, j)) * es);
    ptr[k < np ? k : TG_SLOT_STATE(p, k - np)] = clash ? NULL : dst[k];
  }
  tg_point(in, ptr);
  for (int64_t k = 0; k < nw; k++)   /* a clashing slot runs on the instance's own buffer */
    if (!ptr[k < np ? k : TG_SLOT_STATE(p, k - np)]) {
      int64_t i = k < np ? p->index[k] : tg_state_entry(in, pinfo, k - np);
      memcpy((char *)(intptr_t)in->base[i], dst[k], wn[k] * es);
    }
  char *cnt_in = flat ? tg_data(cf, 0, 0) + off : tg_data(cf, 0, nw);
  in->sc[0] = es == 8 ? *(double *)cnt_in : (double)*(int32_t *)cnt_in;   /* float32: int32's bits */
  tg_begin_run(p, in, cf);
  for (int64_t t = 0; t < K; t++) {
    if (t > 0) {   /* step t's inputs: block t of each */
      for (int64_t k = 0; k < ni; k++)
        ptr[TG_SLOT_INPUT(p, k)] = tg_data(cf, 0, first_input + k) + t * tg_slot_elems(p, TG_SLOT_INPUT(p, k)) * es;
      tg_point(in, ptr);
    }
    for (int64_t d = 0; d < c.nd; d++) {
      int64_t i = p->dindex[d];
      tg_data_copy((char *)(intptr_t)in->base[i], p->dsize[d], cf->args.args[first_data + d],
                   p->sizes[i] / p->dsize[d], t);
    }
    if (c.lr) {   /* this step's learning rate (a schedule's value), for this call only */
      char *lr = tg_data(cf, 0, first_input + ni) + t * es;
      in->sc[6] = 1.0;
      in->sc[7] = es == 8 ? *(double *)lr : (double)*(float *)lr;
    }
    p->episode(in->run);
    memcpy(tg_data(cf, 1, 0) + t * es, (char *)(intptr_t)in->run[p->loss], es);
  }
  tg_blas_leave(p);
  in->sc[6] = 0.0;
  for (int64_t k = 0; k < nw; k++)
    if (!ptr[k < np ? k : TG_SLOT_STATE(p, k - np)]) {
      int64_t i = k < np ? p->index[k] : tg_state_entry(in, pinfo, k - np);
      memcpy(dst[k], (char *)(intptr_t)in->base[i], wn[k] * es);
    }
  char *cnt = flat ? tg_data(cf, 1, 1) + off : tg_data(cf, 1, 1 + nw);
  if (es == 8) *(double *)cnt = in->sc[0]; else *(int32_t *)cnt = (int32_t)in->sc[0];
  pthread_mutex_unlock(&in->mu);
  return NULL;
}

XLA_FFI_Error *tg_episode(XLA_FFI_CallFrame *cf) { return tg_episode_impl(cf, "tg_episode", 0); }
XLA_FFI_Error *tg_episode_flat(XLA_FFI_CallFrame *cf) { return tg_episode_impl(cf, "tg_episode_flat", 1); }

/* out = [device instances made, products split over XLA's pool] of a loaded program (for tests and
 * diagnostics); returns 0, or -1 when it is not loaded. */
int tg_stats(int64_t hash, int64_t *out) {
  tg_prog *p = tg_find((uint64_t)hash);
  if (!p) return -1;
  out[0] = out[1] = 0;
  for (int d = 0; d < TG_MAX_DEVICES; d++) {
    tg_inst *in = __atomic_load_n(&p->inst[d], __ATOMIC_ACQUIRE);
    if (!in) break;
    pthread_mutex_lock(&in->mu);
    out[0]++;
    out[1] += in->splits;
    pthread_mutex_unlock(&in->mu);
  }
  return 0;
}
