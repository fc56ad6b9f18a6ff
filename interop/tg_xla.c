/* XLA FFI handlers that run captured tapegrad programs (plain C against xla/ffi/api/c_api.h).
 *
 * A program is found by its content hash (attribute `prog`, an i64) in a process-wide table that
 * interop fills from Program.native_abi(); nothing in the HLO is a raw pointer. Each handler copies
 * XLA's operands into the program's slots, calls the program's entry point, and copies the results
 * out. Leading batch dimensions (vmap with "broadcast_all") are looped over: every operand must hold
 * the same number B of slot-sized blocks, and every result gets B blocks.
 *
 * Targets (one handler each):
 *   tg_value           (params..., inputs...)                   -> (loss)
 *   tg_value_and_grad  (params..., inputs...)                   -> (loss, grads...)
 *   tg_episode         (params..., state..., count, inputs...)  -> (loss, params..., state..., count)
 *   tg_episode_flat    (flat state [params|state|count], inputs...) -> (loss, flat state)
 * The episode's params/state/count results alias their operands (input_output_aliases).
 * A program's calls are serialised by its own mutex (shards may call it from several threads).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*tg_fn)(void *);
typedef struct { char *ptr; int64_t n; } tg_slot;

typedef struct tg_prog {
  uint64_t hash;
  tg_fn forward, backward, episode;
  void *ctx;
  char *loss;
  double *scalars;          /* [count, s0, s1, s2, norm, clipped] */
  int64_t esize, np, ni, ns;
  tg_slot *params, *grads, *inputs, *state;
  pthread_mutex_t mu;
  struct tg_prog *next;
} tg_prog;

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

/* Load (or replace) a program. `desc` = [hash, forward, backward, episode, ctx, loss, scalars,
 * esize, np, ni, ns, then (ptr, n) for np params, np grads, ni inputs, ns state]. Entries are never
 * freed while the process runs (an executable may still name the hash); unloading only unlinks. */
int tg_load(const int64_t *desc) {
  tg_prog *p = calloc(1, sizeof *p);
  if (!p) return -1;
  p->hash = (uint64_t)desc[0];
  p->forward = (tg_fn)(intptr_t)desc[1];
  p->backward = (tg_fn)(intptr_t)desc[2];
  p->episode = (tg_fn)(intptr_t)desc[3];
  p->ctx = (void *)(intptr_t)desc[4];
  p->loss = (char *)(intptr_t)desc[5];
  p->scalars = (double *)(intptr_t)desc[6];
  p->esize = desc[7];
  p->np = desc[8];
  p->ni = desc[9];
  p->ns = desc[10];
  int64_t total = 2 * p->np + p->ni + p->ns;
  tg_slot *s = calloc(total ? total : 1, sizeof *s);
  if (!s) { free(p); return -1; }
  for (int64_t k = 0; k < total; k++) {
    s[k].ptr = (char *)(intptr_t)desc[11 + 2 * k];
    s[k].n = desc[12 + 2 * k];
  }
  p->params = s;
  p->grads = s + p->np;
  p->inputs = s + 2 * p->np;
  p->state = s + 2 * p->np + p->ni;
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
  XLA_FFI_Extension_Base *e = cf->extension_start;
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

typedef struct { char msg[256]; tg_prog *p; } tg_call;

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
  int64_t nargs = mode == TG_EPISODE ? p->np + p->ns + 1 + p->ni : mode == TG_EPISODE_FLAT ? 1 + p->ni
                 : p->np + p->ni;
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
    if (b->dtype != want) {
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

static XLA_FFI_Error *tg_run(XLA_FFI_CallFrame *cf, const char *who, int grads) {
  tg_call c;
  int meta;
  XLA_FFI_Error *err = tg_begin(cf, who, grads ? TG_VALUE_AND_GRAD : TG_VALUE, &c, &meta);
  if (err || meta || cf->stage != XLA_FFI_ExecutionStage_EXECUTE) return err;
  tg_prog *p = c.p;
  int64_t B = -1;
  for (int64_t k = 0; k < p->np + p->ni; k++) {
    tg_slot *s = k < p->np ? &p->params[k] : &p->inputs[k - p->np];
    B = tg_batch(cf, who, k, s->n, k < p->np ? "params" : "inputs", k < p->np ? k : k - p->np, B, &c);
    if (B < 0) return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  }
  if (grads && !p->backward) return tg_error(cf, XLA_FFI_Error_Code_UNIMPLEMENTED, "tg_value_and_grad: no backward");
  int64_t es = p->esize;
  pthread_mutex_lock(&p->mu);
  for (int64_t b = 0; b < B; b++) {
    for (int64_t k = 0; k < p->np + p->ni; k++) {
      tg_slot *s = k < p->np ? &p->params[k] : &p->inputs[k - p->np];
      XLA_FFI_Buffer *x = cf->args.args[k];
      memcpy(s->ptr, (char *)x->data + b * s->n * es, s->n * es);
    }
    p->forward(p->ctx);
    memcpy((char *)((XLA_FFI_Buffer *)cf->rets.rets[0])->data + b * es, p->loss, es);
    if (grads) {
      p->backward(p->ctx);
      for (int64_t k = 0; k < p->np; k++)
        memcpy((char *)((XLA_FFI_Buffer *)cf->rets.rets[1 + k])->data + b * p->grads[k].n * es,
               p->grads[k].ptr, p->grads[k].n * es);
    }
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

XLA_FFI_Error *tg_value(XLA_FFI_CallFrame *cf) { return tg_run(cf, "tg_value", 0); }
XLA_FFI_Error *tg_value_and_grad(XLA_FFI_CallFrame *cf) { return tg_run(cf, "tg_value_and_grad", 1); }

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
  int64_t total = 1;
  for (int64_t k = 0; k < np; k++) total += p->params[k].n;
  for (int64_t k = 0; k < ns; k++) total += p->state[k].n;
  int64_t first_input = flat ? 1 : np + ns + 1;
  if (flat && tg_batch(cf, who, 0, total, "flat state", 0, 1, &c) < 0)
    return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  for (int64_t k = flat ? first_input : 0; k < first_input + ni; k++) {
    int64_t n = k >= first_input ? p->inputs[k - first_input].n : k < np ? p->params[k].n
              : k < np + ns ? p->state[k - np].n : 1;
    const char *slot = k >= first_input ? "inputs" : k < np ? "params" : k < np + ns ? "opt_state" : "count";
    int64_t j = k >= first_input ? k - first_input : k < np ? k : k < np + ns ? k - np : 0;
    if (tg_batch(cf, who, k, n, slot, j, 1, &c) < 0)
      return tg_error(cf, XLA_FFI_Error_Code_INVALID_ARGUMENT, c.msg);
  }
  if (!p->episode) return tg_error(cf, XLA_FFI_Error_Code_UNIMPLEMENTED, "tg_episode: the program has no episode");
  char *in = flat ? ((XLA_FFI_Buffer *)cf->args.args[0])->data : NULL;
  char *out = flat ? ((XLA_FFI_Buffer *)cf->rets.rets[1])->data : NULL;
  pthread_mutex_lock(&p->mu);
  int64_t off = 0;
  for (int64_t k = 0; k < np + ns; k++) {
    tg_slot *s = k < np ? &p->params[k] : &p->state[k - np];
    memcpy(s->ptr, flat ? in + off : ((XLA_FFI_Buffer *)cf->args.args[k])->data, s->n * es);
    off += s->n * es;
  }
  char *cnt_in = flat ? in + off : ((XLA_FFI_Buffer *)cf->args.args[np + ns])->data;
  p->scalars[0] = es == 8 ? *(double *)cnt_in : (double)*(float *)cnt_in;
  for (int64_t k = 0; k < ni; k++)
    memcpy(p->inputs[k].ptr, ((XLA_FFI_Buffer *)cf->args.args[first_input + k])->data, p->inputs[k].n * es);
  p->episode(p->ctx);
  memcpy(((XLA_FFI_Buffer *)cf->rets.rets[0])->data, p->loss, es);
  off = 0;
  for (int64_t k = 0; k < np + ns; k++) {
    tg_slot *s = k < np ? &p->params[k] : &p->state[k - np];
    memcpy(flat ? out + off : ((XLA_FFI_Buffer *)cf->rets.rets[1 + k])->data, s->ptr, s->n * es);
    off += s->n * es;
  }
  char *cnt = flat ? out + off : ((XLA_FFI_Buffer *)cf->rets.rets[1 + np + ns])->data;
  if (es == 8) *(double *)cnt = p->scalars[0]; else *(float *)cnt = (float)p->scalars[0];
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

XLA_FFI_Error *tg_episode(XLA_FFI_CallFrame *cf) { return tg_episode_impl(cf, "tg_episode", 0); }
XLA_FFI_Error *tg_episode_flat(XLA_FFI_CallFrame *cf) { return tg_episode_impl(cf, "tg_episode_flat", 1); }
