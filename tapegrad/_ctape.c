/* The eager tape's two hot loops in C: Tape.apply's common path and Schedule.replay.
 *
 * Both do what tapegrad/tape.py and tapegrad/schedule.py do, with the same objects, in the same order;
 * only the interpreter's bookkeeping goes. apply handles the path every training step takes (float
 * Vars of this tape, a memoised shape, a cached arena view, no kept buffers, no check_finite, not
 * ordered). Anything else, it hands to the Python method Tape._apply_py before it has changed
 * anything, so the rare paths and every error message exist once, in Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyObject *TapeCls, *Var, *Node, *DATA, *SHAPES, *PKG, *BAD;
static PyObject *np_add, *np_add_reduce, *np_copyto;
static Py_ssize_t off_tape, off_id, off_epoch;   /* Var's slots */
static PyObject *s_ordered, *s_check_finite, *s_sources, *s_nodes, *s_val, *s_grad, *s_gpass, *s_vals, *s_tmp,
    *s_epoch, *s_si, *s_off, *s_views, *s_rewind, *s_apply_py, *s_data, *s_fwd, *s_grads, *s_arena_grads,
    *s_pass, *s_kept, *s_axis, *s_out, *s_reshape, *kw_axis_out, *kw_out;
static PyObject *zero, *minus_one;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

enum { INTO, ADOPT, NEW, COPY, ADD, DIRECT };
#define SUMMED 8

/* The first frame outside the package, as tape._user_frame: (code, bytecode offset), or None.
 * NULL with no exception set: this Python cannot say (the caller hands over to Python). Whether a code
 * object is the package's own is cached by its address, holding the code so the address stays its. */
#define OURS_CACHE 512
static struct { PyObject *code; int ours; } ours_cache[OURS_CACHE];

static int is_ours(PyCodeObject *code)
{
    size_t slot = ((size_t)code >> 4) % OURS_CACHE;
    if (ours_cache[slot].code == (PyObject *)code)
        return ours_cache[slot].ours;
    int ours = PyUnicode_Tailmatch(code->co_filename, PKG, 0, PY_SSIZE_T_MAX, -1);
    if (ours >= 0) {
        Py_XSETREF(ours_cache[slot].code, Py_NewRef((PyObject *)code));
        ours_cache[slot].ours = ours;
    }
    return ours;
}

static PyObject *user_frame(void)
{
#if PY_VERSION_HEX >= 0x030B0000
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        int ours = is_ours(code);
        if (ours < 0) {
            Py_DECREF(code);
            Py_DECREF(f);
            return NULL;
        }
        if (!ours) {
            PyObject *src = Py_BuildValue("(Ni)", code, PyFrame_GetLasti(f));
            Py_DECREF(f);
            return src;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_RETURN_NONE;
#else
    return NULL;
#endif
}

/* An instance attribute, read from the instance's dict (a borrowed reference; NULL if absent). Tape,
 * Arena and Op keep everything read here in their instances' dicts. */
static PyObject *field(PyObject *dict, PyObject *name)
{
    return dict == NULL ? NULL : PyDict_GetItemWithError(dict, name);
}

/* The node of Var v if it is a live Var of this tape (a borrowed reference), else NULL. */
static PyObject *node_of(PyObject *tape, PyObject *nodes, PyObject *v)
{
    if (Py_TYPE(v) != (PyTypeObject *)Var || SLOT(v, off_tape) != tape || SLOT(v, off_id) == NULL ||
        !PyLong_CheckExact(SLOT(v, off_id)) || SLOT(v, off_epoch) == NULL)   /* (NULL: a Var never initialised) */
        return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(SLOT(v, off_id));
    if (i < 0 || i >= PyList_GET_SIZE(nodes)) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *n = PyList_GET_ITEM(nodes, i);
    int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(n, 5), SLOT(v, off_epoch), Py_EQ);
    if (same != 1) {
        PyErr_Clear();
        return NULL;
    }
    return PyTuple_GET_ITEM(n, 0) == DATA ? NULL : n;
}

/* What Tape.apply does on its common path. NULL with no exception set: nothing was changed, and Python
 * must do it (whatever stopped this path, Python meets it again and reports it its own way). */
static PyObject *fast_apply(PyObject *tape, PyObject *op, PyObject *a, PyObject *b, PyObject *s)
{
    PyObject *res = NULL, *key = NULL, *vkey = NULL, *pos = NULL, *node = NULL, *idx = NULL, *src = NULL;
    PyObject *shape = NULL;
    PyObject *memo, *hit, *na, *nb = NULL, *out, *r;
    PyObject *td = PyObject_GenericGetDict(tape, NULL), *od = PyObject_GenericGetDict(op, NULL);
    PyObject *nodes = field(td, s_nodes), *vals = field(td, s_val), *arena = field(td, s_vals);
    PyObject *tmp = field(td, s_tmp), *ordered = field(td, s_ordered), *check = field(td, s_check_finite);
    PyObject *sources = field(td, s_sources), *epoch = field(td, s_epoch), *grad = field(td, s_grad);
    PyObject *gpass = field(td, s_gpass), *fwd = field(od, s_fwd), *data = field(od, s_data);
    PyObject *ad = arena ? PyObject_GenericGetDict(arena, NULL) : NULL;
    PyObject *md = tmp ? PyObject_GenericGetDict(tmp, NULL) : NULL;
    PyObject *si = field(ad, s_si), *off = field(ad, s_off), *views = field(ad, s_views);
    if (md == NULL || gpass == NULL || sources == NULL || epoch == NULL || fwd == NULL || data == NULL ||
        si == NULL || off == NULL || views == NULL || ordered != Py_None || check != Py_False || data != Py_False || !PyList_CheckExact(nodes) ||
        !PyList_CheckExact(vals) || !PyList_CheckExact(grad) || !PyList_CheckExact(gpass) ||
        !PyDict_CheckExact(views) || (na = node_of(tape, nodes, a)) == NULL ||
        (b != Py_None && (nb = node_of(tape, nodes, b)) == NULL))
        goto python;
    key = PyTuple_Pack(4, op, PyTuple_GET_ITEM(na, 8), nb ? PyTuple_GET_ITEM(nb, 8) : Py_None, s);
    memo = key ? PyDict_GetItemWithError(SHAPES, key) : NULL;
    if (memo == NULL || PyTuple_GET_ITEM(memo, 2) != Py_None)   /* not seen yet, or kept buffers (Op.keep) */
        goto python;
    shape = Py_NewRef(PyTuple_GET_ITEM(memo, 0));   /* (the memo may be cleared while the forward runs) */
    if (PyTuple_GET_ITEM(na, 7) != Py_False || (nb && PyTuple_GET_ITEM(nb, 7) != Py_False))   /* lazy */
        goto python;
    int req = PyTuple_GET_ITEM(na, 4) == Py_True || (nb && PyTuple_GET_ITEM(nb, 4) == Py_True);
    /* the arena's take, where it hands out a view it carved before: (slab, offset, shape) -> (view, end) */
    vkey = PyTuple_Pack(3, si, off, shape);
    hit = vkey ? PyDict_GetItemWithError(views, vkey) : NULL;
    if (hit == NULL)
        goto python;
    out = Py_NewRef(PyTuple_GET_ITEM(hit, 0));   /* (the hit's owner is a dict a rule may clear) */
    Py_INCREF(off);   /* the arena's offset before the take (its dict entry is about to be replaced) */
    if (PyDict_SetItem(ad, s_off, PyTuple_GET_ITEM(hit, 1)) < 0)
        goto fail_out;
    PyObject *args[5] = {PyList_GET_ITEM(vals, PyLong_AsSsize_t(SLOT(a, off_id))),
                         nb ? PyList_GET_ITEM(vals, PyLong_AsSsize_t(SLOT(b, off_id))) : Py_None, s, out, tmp};
    r = PyObject_Vectorcall(fwd, args, 5, NULL);
    Py_XDECREF(r);
    if (r == NULL) {
        if (!PyErr_ExceptionMatches(BAD))
            goto fail_out;
        PyErr_Clear();   /* a value the op cannot take: Python rewinds and reports it */
        goto undo;
    }
    PyObject *tsi = field(md, s_si), *toff = field(md, s_off);
    if (tsi == NULL || toff == NULL || PyObject_IsTrue(tsi) || PyObject_IsTrue(toff)) {   /* tmp.rewind() */
        r = PyObject_CallMethodNoArgs(tmp, s_rewind);
        if (r == NULL)
            goto fail_out;
        Py_DECREF(r);
    }
    int want = PyObject_IsTrue(sources);
    src = want < 0 ? NULL : want ? user_frame() : Py_NewRef(Py_None);
    if (src == NULL) {
        if (PyErr_Occurred())
            goto fail_out;
        goto undo;   /* this Python has no frame API for it: Python records the op */
    }
    pos = PyTuple_Pack(2, si, off);
    node = pos ? PyType_GenericAlloc((PyTypeObject *)Node, 11) : NULL;
    idx = node ? PyLong_FromSsize_t(PyList_GET_SIZE(nodes)) : NULL;
    if (idx == NULL)
        goto fail_out;
    PyObject *items[11] = {op, SLOT(a, off_id), nb ? SLOT(b, off_id) : minus_one, s, req ? Py_True : Py_False,
                           epoch, src, Py_False, shape, pos, minus_one};
    for (int k = 0; k < 11; k++)
        PyTuple_SET_ITEM(node, k, Py_NewRef(items[k]));
    if (PyList_Append(nodes, node) < 0 || PyList_Append(vals, out) < 0 || PyList_Append(grad, Py_None) < 0 ||
        PyList_Append(gpass, zero) < 0)
        goto fail_out;
    res = PyType_GenericAlloc((PyTypeObject *)Var, 0);
    if (res != NULL) {
        SLOT(res, off_tape) = Py_NewRef(tape);
        SLOT(res, off_id) = Py_NewRef(idx);
        SLOT(res, off_epoch) = Py_NewRef(epoch);
    }
    goto fail_out;
undo:
    if (PyDict_SetItem(ad, s_off, off) == 0) {
        Py_DECREF(out);
        Py_DECREF(off);
        goto python;
    }
fail_out:
    Py_DECREF(out);
    Py_DECREF(off);
    goto done;
python:
    PyErr_Clear();
done:
    Py_XDECREF(td);
    Py_XDECREF(od);
    Py_XDECREF(ad);
    Py_XDECREF(md);
    Py_XDECREF(key);
    Py_XDECREF(vkey);
    Py_XDECREF(pos);
    Py_XDECREF(node);
    Py_XDECREF(idx);
    Py_XDECREF(src);
    Py_XDECREF(shape);
    return res;
}

/* An op as a Var method or operator (Var.tanh, Var.__mul__): the C path of Tape.apply straight from the
 * call, where the arguments are Vars of one tape; otherwise the Python function it stands for. */
typedef struct {
    PyObject_HEAD
    PyObject *op, *fallback;
    int arity;
    vectorcallfunc vectorcall;
} Method;

static PyObject *method_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Method *m = (Method *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && n == m->arity && Py_TYPE(args[0]) == (PyTypeObject *)Var && SLOT(args[0], off_tape) &&
        Py_TYPE(SLOT(args[0], off_tape)) == (PyTypeObject *)TapeCls &&   /* (a subclass may have its own apply) */
        (n == 1 || (Py_TYPE(args[1]) == (PyTypeObject *)Var && SLOT(args[1], off_tape) == SLOT(args[0], off_tape)))) {
        PyObject *res = fast_apply(SLOT(args[0], off_tape), m->op, args[0], n == 2 ? args[1] : Py_None, Py_None);
        if (res != NULL || PyErr_Occurred())
            return res;
    }
    return PyObject_Vectorcall(m->fallback, args, nargsf, kwnames);
}

static PyObject *method_get(PyObject *self, PyObject *obj, PyObject *type)
{
    return obj == NULL || obj == Py_None ? Py_NewRef(self) : PyMethod_New(self, obj);
}

static int method_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((Method *)self)->op);
    Py_VISIT(((Method *)self)->fallback);
    return 0;
}

static int method_clear(PyObject *self)
{
    Py_CLEAR(((Method *)self)->op);
    Py_CLEAR(((Method *)self)->fallback);
    return 0;
}

static void method_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    method_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *method_attr(PyObject *self, void *name)
{
    return PyObject_GetAttrString(((Method *)self)->fallback, name);
}

static PyObject *method_wrapped(PyObject *self, void *unused)
{
    return Py_NewRef(((Method *)self)->fallback);
}

static PyGetSetDef method_getset[] = {
    {"__doc__", method_attr, NULL, NULL, "__doc__"},
    {"__name__", method_attr, NULL, NULL, "__name__"},
    {"__qualname__", method_attr, NULL, NULL, "__qualname__"},
    {"__module__", method_attr, NULL, NULL, "__module__"},
    {"__wrapped__", method_wrapped, NULL, "the Python function it stands for", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *method_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<op method %R>", ((Method *)self)->op);
}

static PyTypeObject MethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tapegrad._ctape.Method",
    .tp_basicsize = sizeof(Method),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_vectorcall_offset = offsetof(Method, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_traverse = method_traverse,
    .tp_clear = method_clear,
    .tp_dealloc = method_dealloc,
    .tp_getset = method_getset,
    .tp_repr = method_repr,
};

/* method(op, arity, fallback): a Method */
static PyObject *method(PyObject *self, PyObject *args)
{
    PyObject *op, *fallback;
    int arity;
    if (!PyArg_ParseTuple(args, "OiO", &op, &arity, &fallback))
        return NULL;
    if (arity != 1 && arity != 2) {
        PyErr_Format(PyExc_ValueError, "method: arity must be 1 or 2, got %d", arity);
        return NULL;
    }
    Method *m = PyObject_GC_New(Method, &MethodType);
    if (m == NULL)
        return NULL;
    m->op = Py_NewRef(op);
    m->fallback = Py_NewRef(fallback);
    m->arity = arity;
    m->vectorcall = method_call;
    PyObject_GC_Track(m);
    return (PyObject *)m;
}

/* Tape.apply(op, a, b=None, s=None, c=None) */
static PyObject *apply(PyObject *tape, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (kwnames == NULL && nargs >= 2 && nargs <= 4) {
        PyObject *res = fast_apply(tape, args[0], args[1], nargs > 2 ? args[2] : Py_None,
                                   nargs > 3 ? args[3] : Py_None);
        if (res != NULL || PyErr_Occurred())
            return res;
    }
    PyObject *py = PyObject_GetAttr(tape, s_apply_py);
    if (py == NULL)
        return NULL;
    PyObject *res = PyObject_Vectorcall(py, args, nargs, kwnames);
    Py_DECREF(py);
    return res;
}

static PyObject *call_kw(PyObject *f, PyObject **args, Py_ssize_t n, PyObject *kwnames)
{
    return PyObject_Vectorcall(f, args, n - PyTuple_GET_SIZE(kwnames), kwnames);
}

/* What Tape._accumulate did with contribution c to node j's gradient, as the sweep recorded it (code,
 * buf); steals c. ADOPT and NEW make c (or buf) the gradient and list it as living in the scratch arena. */
static int accumulate(long code, PyObject *grads, Py_ssize_t j, PyObject *jobj, PyObject *c, PyObject *buf,
                      PyObject *kept)
{
    PyObject *r, *gj = PyList_GET_ITEM(grads, j);
    if (code == ADOPT || code == NEW) {
        if (code == NEW) {
            PyObject *cp[2] = {buf, c};
            r = PyObject_Vectorcall(np_copyto, cp, 2, NULL);
            Py_DECREF(c);
            if (r == NULL)
                return -1;
            Py_DECREF(r);
            c = Py_NewRef(buf);
        }
        PyList_SetItem(grads, j, c);
        return PyList_Append(kept, jobj);
    }
    if (code == ADD) {
        PyObject *ad[3] = {gj, c, gj};
        r = call_kw(np_add, ad, 3, kw_out);
    } else if (code == COPY) {
        PyObject *cp[2] = {gj, c};
        r = PyObject_Vectorcall(np_copyto, cp, 2, NULL);
    } else {   /* INTO: np.add.reduce(c, axis=buf[0], out=grads[j].reshape(buf[1])) */
        PyObject *view = PyObject_CallMethodOneArg(gj, s_reshape, PyTuple_GET_ITEM(buf, 1));
        r = NULL;
        if (view != NULL) {
            PyObject *kw[3] = {c, PyTuple_GET_ITEM(buf, 0), view};
            r = call_kw(np_add_reduce, kw, 3, kw_axis_out);
            Py_DECREF(view);
        }
    }
    Py_DECREF(c);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* Schedule.replay: steps are (k, j, a, b, x, rule, f, t, pos, code, buf) as schedule.py writes them. */
static PyObject *replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "replay(steps, end, tape)");
        return NULL;
    }
    PyObject *steps = args[0], *end = args[1], *tape = args[2], *res = NULL;
    PyObject *nodes = PyObject_GetAttr(tape, s_nodes), *vals = PyObject_GetAttr(tape, s_val);
    PyObject *grads = PyObject_GetAttr(tape, s_grad), *gpass = PyObject_GetAttr(tape, s_gpass);
    PyObject *ws = PyObject_GetAttr(tape, s_grads), *kept = PyObject_GetAttr(tape, s_arena_grads);
    PyObject *p = PyObject_GetAttr(tape, s_pass), *kept_bufs = NULL;
    if (p == NULL || ws == NULL || kept == NULL || !PyList_CheckExact(nodes) || !PyList_CheckExact(vals) ||
        !PyList_CheckExact(grads) || !PyList_CheckExact(gpass) || !PyList_CheckExact(kept)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "replay: the tape's lists are not lists");
        goto done;
    }
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(steps); n++) {
        PyObject *st = PyList_GET_ITEM(steps, n);
        Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 0)), j = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 1));
        Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 2)), b = PyLong_AsSsize_t(PyTuple_GET_ITEM(st, 3));
        long x = PyLong_AsLong(PyTuple_GET_ITEM(st, 4)), code = PyLong_AsLong(PyTuple_GET_ITEM(st, 9));
        PyObject *rule = PyTuple_GET_ITEM(st, 5), *f = PyTuple_GET_ITEM(st, 6), *t = PyTuple_GET_ITEM(st, 7);
        PyObject *buf = PyTuple_GET_ITEM(st, 10), *c;
        if (PyErr_Occurred())
            goto done;
        PyObject *call[7] = {PyList_GET_ITEM(grads, k), PyList_GET_ITEM(vals, k), PyList_GET_ITEM(vals, a),
                             b < 0 ? Py_None : PyList_GET_ITEM(vals, b), PyTuple_GET_ITEM(PyList_GET_ITEM(nodes, k), 3),
                             NULL, NULL};
        if (f != Py_None) {
            call[5] = code == DIRECT ? PyList_GET_ITEM(grads, j) : t;
            PyObject *r = PyObject_Vectorcall(f, call, 6, NULL);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
            if (code == DIRECT) {
                PyList_SetItem(gpass, j, Py_NewRef(p));
                continue;
            }
            c = Py_NewRef(t);
        } else {
            /* ws.rewind(pos), unless the arena stands there already (then rewinding changes nothing) */
            PyObject *pos = PyTuple_GET_ITEM(st, 8), *wsi = PyObject_GetAttr(ws, s_si);
            PyObject *woff = wsi ? PyObject_GetAttr(ws, s_off) : NULL;
            int there = woff == NULL ? -1 : PyObject_RichCompareBool(wsi, PyTuple_GET_ITEM(pos, 0), Py_EQ);
            if (there == 1)
                there = PyObject_RichCompareBool(woff, PyTuple_GET_ITEM(pos, 1), Py_EQ);
            Py_XDECREF(wsi);
            Py_XDECREF(woff);
            if (there < 0)
                goto done;
            if (!there) {
                PyObject *r = PyObject_CallMethodOneArg(ws, s_rewind, pos);
                if (r == NULL)
                    goto done;
                Py_DECREF(r);
            }
            call[5] = ws;
            if (x == -2) {
                Py_XDECREF(kept_bufs);
                kept_bufs = PyObject_GetAttr(tape, s_kept);
                call[6] = kept_bufs ? PyDict_GetItemWithError(kept_bufs, PyTuple_GET_ITEM(st, 0)) : NULL;
                if (call[6] == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(st, 0));
                    goto done;
                }
            } else if (x != -1) {
                call[6] = PyList_GET_ITEM(vals, x);
            }
            c = PyObject_Vectorcall(rule, call, x == -1 ? 6 : 7, NULL);
            if (c == NULL)
                goto done;
        }
        if (code & SUMMED) {   /* np.add.reduce(c, axis=buf[1], out=buf[0]); c = buf[2] */
            PyObject *kw[3] = {c, PyTuple_GET_ITEM(buf, 1), PyTuple_GET_ITEM(buf, 0)};
            PyObject *r = call_kw(np_add_reduce, kw, 3, kw_axis_out);
            Py_DECREF(c);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
            c = Py_NewRef(PyTuple_GET_ITEM(buf, 2));
            buf = Py_None;
            code &= 7;
        }
        if (accumulate(code, grads, j, PyTuple_GET_ITEM(st, 1), c, buf, kept) < 0)
            goto done;
        PyList_SetItem(gpass, j, Py_NewRef(p));
    }
    res = PyObject_CallMethodOneArg(ws, s_rewind, end);
done:
    Py_XDECREF(nodes);
    Py_XDECREF(vals);
    Py_XDECREF(grads);
    Py_XDECREF(gpass);
    Py_XDECREF(ws);
    Py_XDECREF(kept);
    Py_XDECREF(p);
    Py_XDECREF(kept_bufs);
    return res;
}

static PyMethodDef apply_def = {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL | METH_KEYWORDS,
    "apply(op, a, b=None, s=None, c=None)\n--\n\n"
    "Append one registry op applied to Vars a (and b, c) with static operand s (the C path of Tape.apply)."};

static Py_ssize_t slot_offset(PyObject *cls, const char *name)
{
    PyObject *d = PyObject_GetAttrString(cls, name);
    Py_ssize_t off = -1;
    if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type))
        off = ((PyMemberDescrObject *)d)->d_member->offset;
    else if (d != NULL)
        PyErr_Format(PyExc_TypeError, "Var.%s is not a slot", name);
    Py_XDECREF(d);
    return off;
}

/* install(Tape, Var, Node, DATA, SHAPES, PKG, Bad) -> the method descriptor for Tape.apply */
static PyObject *install(PyObject *self, PyObject *args)
{
    PyObject *numpy;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!UO", &PyType_Type, &TapeCls, &PyType_Type, &Var, &PyType_Type, &Node,
                          &DATA, &PyDict_Type, &SHAPES, &PKG, &BAD))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)Node, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "install: Node must be a tuple type");
        return NULL;
    }
    if ((off_tape = slot_offset(Var, "tape")) < 0 || (off_id = slot_offset(Var, "id")) < 0 ||
        (off_epoch = slot_offset(Var, "epoch")) < 0)
        return NULL;
    numpy = PyImport_ImportModule("numpy");
    if (numpy == NULL)
        return NULL;
    np_add = PyObject_GetAttrString(numpy, "add");
    np_add_reduce = np_add ? PyObject_GetAttrString(np_add, "reduce") : NULL;
    np_copyto = PyObject_GetAttrString(numpy, "copyto");
    Py_DECREF(numpy);
    if (np_add_reduce == NULL || np_copyto == NULL)
        return NULL;
    PyObject *refs[] = {TapeCls, Var, Node, DATA, SHAPES, PKG, BAD};
    for (size_t k = 0; k < sizeof refs / sizeof *refs; k++)
        Py_INCREF(refs[k]);
    return PyDescr_NewMethod((PyTypeObject *)TapeCls, &apply_def);
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS, "install(Tape, Var, Node, DATA, SHAPES, PKG, Bad): Tape.apply's C method"},
    {"method", method, METH_VARARGS, "method(op, arity, fallback): op as a Var method, with fallback for the rest"},
    {"replay", (PyCFunction)(void (*)(void))replay, METH_FASTCALL, "replay(steps, end, tape): Schedule.replay in C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_ctape", .m_doc = "The eager tape's hot loops in C.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__ctape(void)
{
    struct { PyObject **slot; const char *text; } names[] = {
        {&s_ordered, "_ordered"}, {&s_check_finite, "check_finite"}, {&s_sources, "sources"}, {&s_nodes, "_nodes"},
        {&s_val, "_val"}, {&s_grad, "_grad"}, {&s_gpass, "_gpass"}, {&s_vals, "_vals"}, {&s_tmp, "_tmp"},
        {&s_epoch, "_epoch"}, {&s_si, "si"}, {&s_off, "off"}, {&s_views, "views"}, {&s_rewind, "rewind"},
        {&s_apply_py, "_apply_py"}, {&s_data, "data"}, {&s_fwd, "fwd"}, {&s_grads, "_grads"},
        {&s_arena_grads, "_arena_grads"}, {&s_pass, "_pass"}, {&s_kept, "_kept"}, {&s_axis, "axis"},
        {&s_out, "out"}, {&s_reshape, "reshape"},
    };
    for (size_t k = 0; k < sizeof names / sizeof *names; k++)
        if ((*names[k].slot = PyUnicode_InternFromString(names[k].text)) == NULL)
            return NULL;
    kw_axis_out = PyTuple_Pack(2, s_axis, s_out);
    kw_out = PyTuple_Pack(1, s_out);
    zero = PyLong_FromLong(0);
    minus_one = PyLong_FromLong(-1);
    if (kw_axis_out == NULL || kw_out == NULL || zero == NULL || minus_one == NULL)
        return NULL;
    if (PyType_Ready(&MethodType) < 0)
        return NULL;
    return PyModule_Create(&module);
}
