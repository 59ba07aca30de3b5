/* Records: the registry's entries, their holders, the live list, and the release of a
 * record no stream used (the hot path). The stream-ordered release of a record some
 * stream used is Python's (registry._begin_release, the reaper): it waits anyway.
 *
 * The Python class exchange.registry.Record derives from RecordBase and adds the
 * read-only views (origin, holders, streams, describe); the pure-Python path has a
 * Python RecordBase with the same attributes. */
#include "native.h"

#include <structmember.h>

static const char *STATE_NAMES[] = {"live", "releasing", "released"};
static const char *KIND_NAMES[] = {"allocated", "imported", "borrowed"};
static PyObject *state_str[3], *kind_str[3];

/* -- the live list ------------------------------------------------------------------------ */
static void link_record(RecordObject *r) {
    Py_INCREF(r);
    r->prev = S.tail;
    r->next = NULL;
    if (S.tail) S.tail->next = r;
    else S.head = r;
    S.tail = r;
    S.live++;
}

/* The record leaves the live set and the counts (once: a record not linked is left). */
void record_gone(RecordObject *r) {
    int linked = r->prev != NULL || S.head == r;
    r->state = RELEASED;
    if (!linked) return;
    if (r->prev) r->prev->next = r->next;
    else S.head = r->next;
    if (r->next) r->next->prev = r->prev;
    else S.tail = r->prev;
    r->prev = r->next = NULL;
    S.live--;
    S.released++;
    bytes_add(r->slot, -r->nbytes);
    if (r->kind == KIND_IMPORTED) S.imports_gone++;
#ifndef EXCHANGE_NO_TRACE
    /* tx.trace's note (set only while a trace records); whatever error is pending stays */
    if (S.note_gone != NULL && !S.finalizing) {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *res = PyObject_CallOneArg(S.note_gone, (PyObject *)r);
        if (res == NULL) PyErr_WriteUnraisable(S.note_gone);
        Py_XDECREF(res);
        PyErr_Restore(et, ev, tb);
    }
#endif
    Py_DECREF(r); /* the list's reference */
}

RecordObject *record_new(PyObject *device, Py_ssize_t slot, int32_t dev_type, int32_t dev_id, uintptr_t address,
                         long long nbytes, PyObject *origin, int kind, PyObject *release, void *managed, int versioned,
                         PyObject *owner, long long *token_out) {
    PyTypeObject *type = (PyTypeObject *)(S.record_type ? S.record_type : (PyObject *)&RecordBase_Type);
    RecordObject *r = (RecordObject *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    Py_INCREF(device);
    r->device = device;
    r->address = address;
    r->nbytes = nbytes;
    Py_INCREF(origin);
    r->origin = origin;
    r->kind = (uint8_t)kind;
    r->state = LIVE;
    r->flags = versioned ? F_VERSIONED : 0;
    r->slot = (int32_t)slot;
    r->dev_type = (uint8_t)dev_type;
    r->dev_id = dev_id;
    if (managed != NULL) {
        r->flags |= F_NATIVE;
        r->rel.managed = managed;
    } else if (release != NULL && release != Py_None) {
        r->rel.release = Py_NewRef(release);
    }
    Py_XINCREF(owner);
    r->owner = owner;
    if (token_out != NULL) {
        long long token = S.next_token++;
        r->holders[0].token = token; /* "tx.Tensor" */
        r->nholders = 1;
        *token_out = token;
    }
    r->id = S.next_id++;
    link_record(r);
    bytes_add(slot, nbytes);
    if (kind == KIND_IMPORTED) S.imports++;
#ifndef EXCHANGE_NO_TRACE
    /* The creation note for tx.track() blocks and tx.trace() (only while one is open).
     * EXCHANGE_NO_TRACE leaves it out, and record_gone's note: a core for the bench's
     * "trace_off_hop_ratio" only (exchange/cli/bench_trace.py), in which track() and
     * trace() see no records. */
    if (S.tracking && S.note_tracked != NULL) {
        PyObject *res = PyObject_CallOneArg(S.note_tracked, (PyObject *)r);
        if (res == NULL) PyErr_WriteUnraisable(S.note_tracked);
        Py_XDECREF(res);
    }
#endif
    if (S.debug && S.where != NULL) {
        PyObject *where = PyObject_CallNoArgs(S.where);
        if (where == NULL || PyObject_SetAttrString((PyObject *)r, "where", where) < 0) PyErr_WriteUnraisable(S.where);
        Py_XDECREF(where);
    }
    return r;
}

/* The record's {id(stream): stream} dict (borrowed), or NULL when no stream used it. */
PyObject *record_streams(RecordObject *r) {
    if (r->dict == NULL) return NULL;
    PyObject *streams = PyDict_GetItemWithError(r->dict, S.str_streams);
    if (streams == NULL) PyErr_Clear();
    return streams != NULL && PyDict_Check(streams) ? streams : NULL;
}

static PyObject *more_holders(RecordObject *r, int create) {
    if (r->dict == NULL) {
        if (!create) return NULL;
        if ((r->dict = PyDict_New()) == NULL) return NULL;
    }
    PyObject *more = PyDict_GetItemWithError(r->dict, S.str_more);
    if (more == NULL && !PyErr_Occurred() && create) {
        more = PyDict_New();
        if (more == NULL || PyDict_SetItem(r->dict, S.str_more, more) < 0) {
            Py_XDECREF(more);
            return NULL;
        }
        Py_DECREF(more); /* the dict holds it */
    }
    return more;
}

/* -- holders ------------------------------------------------------------------------------- */
long long record_add_holder(RecordObject *r, long long ctx, PyObject *desc) {
    if (r->state != LIVE) {
        PyErr_Format(S.lifetime_error ? S.lifetime_error : PyExc_RuntimeError,
                     "record #%lld is already %s; it cannot get a new holder", r->id, STATE_NAMES[r->state]);
        return -1;
    }
    long long token = S.next_token++;
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        Holder *h = &r->holders[i];
        if (h->token != 0) continue;
        h->token = token;
        if (ctx) {
            h->u.ctx = ctx;
            r->flags |= F_EXPORT0 << i;
        } else {
            h->u.desc = Py_XNewRef(desc);
            r->flags &= ~(F_EXPORT0 << i);
        }
        r->nholders++;
        return token;
    }
    PyObject *more = more_holders(r, 1);
    if (more == NULL) return -1;
    PyObject *key = PyLong_FromLongLong(token);
    PyObject *value = desc != NULL ? Py_NewRef(desc) : ctx ? PyLong_FromLongLong(ctx) : Py_NewRef(S.str_tensor);
    int rc = key && value ? PyDict_SetItem(more, key, value) : -1;
    Py_XDECREF(key);
    Py_XDECREF(value);
    if (rc < 0) return -1;
    r->nholders++;
    return token;
}

static int take_holder(RecordObject *r, long long token) {
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        Holder *h = &r->holders[i];
        if (h->token != token) continue;
        h->token = 0;
        if (r->flags & (F_EXPORT0 << i)) r->flags &= ~(F_EXPORT0 << i);
        else Py_CLEAR(h->u.desc);
        h->u.ctx = 0;
        return 1;
    }
    PyObject *more = more_holders(r, 0);
    if (more == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *key = PyLong_FromLongLong(token);
    int found = key ? PyDict_Contains(more, key) : 0;
    if (found == 1 && PyDict_DelItem(more, key) < 0) found = 0;
    if (found < 0) found = 0;
    PyErr_Clear();
    Py_XDECREF(key);
    return found;
}

static void run_release(RecordObject *r, PyObject *release, void *managed, int versioned) {
    if (S.finalizing) return; /* a late release must not call into a finalising interpreter */
    if (managed != NULL) {
        call_managed_deleter(managed, versioned);
        return;
    }
    if (release == NULL) return;
    PyObject *res;
    if (PyTuple_CheckExact(release) && PyTuple_GET_SIZE(release) >= 1) {
        PyObject *args = PyTuple_GetSlice(release, 1, PyTuple_GET_SIZE(release));
        res = args ? PyObject_Call(PyTuple_GET_ITEM(release, 0), args, NULL) : NULL;
        Py_XDECREF(args);
    } else {
        res = PyObject_CallNoArgs(release);
    }
    if (res != NULL) {
        Py_DECREF(res);
        return;
    }
    /* a release never raises into a deleter: it becomes a warning */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *text = ev ? PyObject_Str(ev) : NULL;
    const char *name = et ? ((PyTypeObject *)et)->tp_name : "error";
    PyObject *msg = PyUnicode_FromFormat("release of record #%lld failed (%s: %U); the memory may have leaked",
                                         r->id, name, text ? text : Py_None);
    if (text == NULL || msg == NULL) PyErr_Clear();
    if (msg != NULL) warn_message(PyUnicode_AsUTF8(msg));
    Py_XDECREF(msg);
    Py_XDECREF(text);
    Py_XDECREF(et);
    Py_XDECREF(ev);
    Py_XDECREF(tb);
}

/* Drop a holder; the last one starts the release: stream-ordered through Python when
 * a stream used the memory, else at once, here. Never fails (errors are warnings). */
int record_remove_holder(RecordObject *r, long long token) {
    /* a deleter may run with an exception pending (a Tensor dying while an error
     * unwinds): saved before anything here can clear or replace it (take_holder clears
     * its own lookup errors and may drop a holder's object) */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    if (!take_holder(r, token) || --r->nholders > 0 || r->state != LIVE) {
        PyErr_Restore(et, ev, tb);
        return 0;
    }
    Py_INCREF(r);
    PyObject *streams = record_streams(r);
    if (streams != NULL && PyDict_GET_SIZE(streams) > 0) {
        r->state = RELEASING;
        PyObject *list = PyDict_Values(streams);
        PyObject *res = list ? PyObject_CallFunctionObjArgs(S.begin_release, (PyObject *)r, list, NULL) : NULL;
        if (res == NULL) PyErr_WriteUnraisable(S.begin_release);
        Py_XDECREF(res);
        Py_XDECREF(list);
    } else {
        int native = r->flags & F_NATIVE;
        PyObject *release = native ? NULL : r->rel.release, *owner = r->owner;
        void *managed = native ? r->rel.managed : NULL;
        r->rel.release = NULL;
        r->flags &= ~F_NATIVE;
        r->owner = NULL;
        /* released from here on, but counted until its release ran: stats() never
         * says memory is gone while it is still mapped */
        r->state = RELEASED;
        run_release(r, release, managed, r->flags & F_VERSIONED);
        record_gone(r);
        Py_XDECREF(release);
        Py_XDECREF(owner); /* dropping a producer's object may release one of our exports */
    }
    PyErr_Restore(et, ev, tb);
    Py_DECREF(r);
    return 0;
}

/* -- the Python face ------------------------------------------------------------------------ */
static PyObject *Record_new_refused(PyTypeObject *t, PyObject *a, PyObject *k) {
    PyErr_SetString(PyExc_TypeError, "records are made by the registry (tx.empty, tx.from_dlpack, tx.borrow)");
    return NULL;
}

/* Records are instances of the heap type make_type("record") made, which hold a
 * reference to their type (a subclass's own traverse visits it instead). */
static int Record_traverse(RecordObject *r, visitproc visit, void *arg) {
    if (Py_TYPE(r)->tp_traverse == (traverseproc)Record_traverse && (Py_TYPE(r)->tp_flags & Py_TPFLAGS_HEAPTYPE))
        Py_VISIT(Py_TYPE(r));
    Py_VISIT(r->owner);
    if (!(r->flags & F_NATIVE)) Py_VISIT(r->rel.release);
    Py_VISIT(r->dict);
    for (int i = 0; i < INLINE_HOLDERS; i++)
        if (r->holders[i].token && !(r->flags & (F_EXPORT0 << i))) Py_VISIT(r->holders[i].u.desc);
    return 0;
}

static int Record_clear(RecordObject *r) {
    Py_CLEAR(r->owner);
    if (!(r->flags & F_NATIVE)) Py_CLEAR(r->rel.release);
    Py_CLEAR(r->dict);
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        if (r->holders[i].token && !(r->flags & (F_EXPORT0 << i))) Py_CLEAR(r->holders[i].u.desc);
        r->holders[i].token = 0;
    }
    return 0;
}

static void Record_dealloc(RecordObject *r) {
    PyTypeObject *type = Py_TYPE(r);
    PyObject_GC_UnTrack(r);
    if (r->weaklist) PyObject_ClearWeakRefs((PyObject *)r);
    Record_clear(r);
    Py_CLEAR(r->device);
    Py_CLEAR(r->origin);
    type->tp_free((PyObject *)r);
    if (type->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(type);
}

static PyObject *get_state(RecordObject *r, void *c) { return Py_NewRef(state_str[r->state]); }

static int set_state(RecordObject *r, PyObject *v, void *c) {
    for (int i = 0; i < 3; i++) {
        if (v != NULL && PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, STATE_NAMES[i]) == 0) {
            r->state = i;
            return 0;
        }
    }
    PyErr_SetString(PyExc_ValueError, "state must be 'live', 'releasing' or 'released'");
    return -1;
}

static PyObject *get_kind(RecordObject *r, void *c) { return Py_NewRef(kind_str[r->kind]); }

static PyObject *get_release(RecordObject *r, void *c) {
    if (r->flags & F_NATIVE)
        return Py_BuildValue("(ONO)", S.call_deleter, PyLong_FromVoidPtr(r->rel.managed),
                             r->flags & F_VERSIONED ? Py_True : Py_False);
    return Py_NewRef(r->rel.release ? r->rel.release : Py_None);
}

static int set_release(RecordObject *r, PyObject *v, void *c) {
    if (v == NULL || v == Py_None) v = NULL;
    PyObject *old = r->flags & F_NATIVE ? NULL : r->rel.release;
    r->flags &= ~F_NATIVE;
    r->rel.release = Py_XNewRef(v);
    Py_XDECREF(old);
    return 0;
}

static PyObject *get_owner(RecordObject *r, void *c) { return Py_NewRef(r->owner ? r->owner : Py_None); }
static int set_owner(RecordObject *r, PyObject *v, void *c) {
    if (v == Py_None) v = NULL;
    Py_XINCREF(v);
    Py_XSETREF(r->owner, v);
    return 0;
}
static PyObject *get_address(RecordObject *r, void *c) { return PyLong_FromVoidPtr((void *)r->address); }

/* _holder_items() -> [(token, description)]: description a str, or an int export id. */
static PyObject *Record_holder_items(RecordObject *r, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (int i = 0; i < INLINE_HOLDERS; i++) {
        Holder *h = &r->holders[i];
        if (h->token == 0) continue;
        PyObject *item = r->flags & (F_EXPORT0 << i) ? Py_BuildValue("(LL)", h->token, h->u.ctx)
                                                     : Py_BuildValue("(LO)", h->token, h->u.desc ? h->u.desc : S.str_tensor);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    PyObject *more = more_holders(r, 0);
    if (more != NULL) {
        PyObject *items = PyDict_Items(more);
        if (items == NULL) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
            if (PyList_Append(out, PyList_GET_ITEM(items, i)) < 0) {
                Py_DECREF(items);
                Py_DECREF(out);
                return NULL;
            }
        }
        Py_DECREF(items);
    } else if (PyErr_Occurred()) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyMemberDef Record_members[] = {
    {"id", T_LONGLONG, offsetof(RecordObject, id), READONLY, "increasing, from 1"},
    {"device", T_OBJECT, offsetof(RecordObject, device), READONLY, "tx.Device"},
    {"nbytes", T_LONGLONG, offsetof(RecordObject, nbytes), READONLY, "bytes"},
    {"_origin", T_OBJECT, offsetof(RecordObject, origin), READONLY, NULL},
    {"_nholders", T_INT, offsetof(RecordObject, nholders), READONLY, NULL},
    {NULL},
};

static PyGetSetDef Record_getset[] = {
    {"state", (getter)get_state, (setter)set_state, "'live', 'releasing' or 'released'", NULL},
    {"kind", (getter)get_kind, NULL, "'allocated', 'imported' or 'borrowed'", NULL},
    {"address", (getter)get_address, NULL, "lowest byte (int)", NULL},
    {"_release", (getter)get_release, (setter)set_release, NULL, NULL},
    {"_owner", (getter)get_owner, (setter)set_owner, NULL, NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMethodDef Record_methods[] = {
    {"_holder_items", (PyCFunction)Record_holder_items, METH_NOARGS, "[(token, description)] of the holders"},
    {NULL},
};

PyTypeObject RecordBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "exchange._native.RecordBase",
    .tp_basicsize = sizeof(RecordObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Storage of a registry record (exchange.registry.Record adds the views).",
    .tp_new = Record_new_refused,
    .tp_dealloc = (destructor)Record_dealloc,
    .tp_traverse = (traverseproc)Record_traverse,
    .tp_clear = (inquiry)Record_clear,
    .tp_members = Record_members,
    .tp_getset = Record_getset,
    .tp_methods = Record_methods,
    .tp_weaklistoffset = offsetof(RecordObject, weaklist),
    .tp_dictoffset = offsetof(RecordObject, dict),
};

/* -- module functions ------------------------------------------------------------------------ */
static int parse_kind(PyObject *kind) {
    for (int i = 0; i < 3; i++)
        if (PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, KIND_NAMES[i]) == 0) return i;
    PyErr_SetString(PyExc_ValueError, "kind must be 'allocated', 'imported' or 'borrowed'");
    return -1;
}

/* new_record(device, address, nbytes, origin, kind, release, owner, label, holder) -> (record, token) */
static PyObject *py_new_record(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "new_record takes 9 arguments");
        return NULL;
    }
    uintptr_t address = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    long long nbytes = PyLong_AsLongLong(args[2]);
    int kind = parse_kind(args[4]);
    if (PyErr_Occurred()) return NULL;
    PyObject *holder = args[8];
    long long token = 0;
    PyObject *type = PyObject_GetAttrString(args[0], "type"), *id = PyObject_GetAttrString(args[0], "id");
    long dev_type = type ? PyLong_AsLong(type) : -1, dev_id = id ? PyLong_AsLong(id) : -1;
    Py_XDECREF(type);
    Py_XDECREF(id);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t slot = device_slot(args[0]);
    if (slot < 0) return NULL;
    RecordObject *r = record_new(args[0], slot, (int32_t)dev_type, (int32_t)dev_id, address, nbytes, args[3], kind,
                                 args[5], NULL, 0, args[6], holder != Py_None ? &token : NULL);
    if (r == NULL) return NULL;
    if (holder != Py_None && PyUnicode_Check(holder) && PyUnicode_Compare(holder, S.str_tensor) != 0)
        r->holders[0].u.desc = Py_NewRef(holder);
    if (args[7] != Py_None && PyObject_SetAttrString((PyObject *)r, "label", args[7]) < 0) {
        record_gone(r);
        Py_DECREF(r);
        return NULL;
    }
    return Py_BuildValue("(NL)", (PyObject *)r, token);
}

static RecordObject *record_arg(PyObject *o) {
    if (!Record_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected a registry Record");
        return NULL;
    }
    return (RecordObject *)o;
}

/* add_holder(record, description) -> token (LifetimeError unless the record is live) */
static PyObject *py_add_holder(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    RecordObject *r = nargs == 2 ? record_arg(args[0]) : NULL;
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "add_holder(record, description)");
        return NULL;
    }
    PyObject *desc = args[1];
    long long token = record_add_holder(r, 0, PyUnicode_Check(desc) && PyUnicode_Compare(desc, S.str_tensor) == 0 ? NULL : desc);
    if (token < 0) return NULL;
    return PyLong_FromLongLong(token);
}

/* remove_holder(record, token): the last holder starts the release. */
static PyObject *py_remove_holder(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    RecordObject *r = nargs == 2 ? record_arg(args[0]) : NULL;
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "remove_holder(record, token)");
        return NULL;
    }
    long long token = PyLong_AsLongLong(args[1]);
    if (token == -1 && PyErr_Occurred()) return NULL;
    record_remove_holder(r, token);
    Py_RETURN_NONE;
}

/* record_gone(record): it leaves the live set (its release ran, or it was discarded). */
static PyObject *py_record_gone(PyObject *mod, PyObject *arg) {
    RecordObject *r = record_arg(arg);
    if (r == NULL) return NULL;
    record_gone(r);
    Py_RETURN_NONE;
}

/* live_records() -> [records], oldest first. */
static PyObject *py_live_records(PyObject *mod, PyObject *unused) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (RecordObject *r = S.head; r != NULL; r = r->next) {
        if (PyList_Append(out, (PyObject *)r) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

PyMethodDef registry_methods[] = {
    {"new_record", (PyCFunction)(void (*)(void))py_new_record, METH_FASTCALL, "Register memory (and a first holder)."},
    {"add_holder", (PyCFunction)(void (*)(void))py_add_holder, METH_FASTCALL, "Add a holder; returns its token."},
    {"remove_holder", (PyCFunction)(void (*)(void))py_remove_holder, METH_FASTCALL, "Drop a holder."},
    {"record_gone", py_record_gone, METH_O, "The record leaves the live set."},
    {"live_records", py_live_records, METH_NOARGS, "The records not yet released, oldest first."},
    {NULL, NULL, 0, NULL},
};

PyObject *record_heap_type(void) {
    /* tp_dealloc given: else PyType_FromSpec puts subtype_dealloc there */
    static PyType_Slot slots[] = {{Py_tp_traverse, (void *)Record_traverse}, {Py_tp_clear, (void *)Record_clear},
                                  {Py_tp_dealloc, (void *)Record_dealloc}, {0, NULL}};
    static PyType_Spec spec = {"exchange.registry.Record", 0, 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, slots};
    return PyType_FromSpecWithBases(&spec, (PyObject *)&RecordBase_Type);
}

int registry_types_ready(PyObject *module) {
    for (int i = 0; i < 3; i++) {
        state_str[i] = PyUnicode_InternFromString(STATE_NAMES[i]);
        kind_str[i] = PyUnicode_InternFromString(KIND_NAMES[i]);
        if (state_str[i] == NULL || kind_str[i] == NULL) return -1;
    }
    if (PyType_Ready(&RecordBase_Type) < 0) return -1;
    Py_INCREF(&RecordBase_Type);
    return PyModule_AddObject(module, "RecordBase", (PyObject *)&RecordBase_Type);
}
