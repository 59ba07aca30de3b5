/* exchange._native.HostQueue: a host stream's ordered work queue and its worker's loop
 * (devices/cpu.py's HostStream runs on it; the pure-Python twin is
 * exchange/_core/_pure/hostqueue.py, the same API and behaviour).
 *
 * Why in C: a pipelined chain hands every batch from stage to stage through these queues,
 * and on the stages' own threads each Python step of a hand-off (the poster's lock and
 * counter, the worker's loop) costs about twice what it does inline. Here a put is one
 * call that checks, counts and queues under the GIL (nothing runs between those steps, so
 * no lock of its own is needed), and the worker's loop makes no Python frame per item.
 *
 * An item is fn(*args), run in `context` when one was given (put_in); fn NULL is the stop
 * that close() queues. The worker waits as queue.SimpleQueue's get does: it holds `lock`
 * while it may wait, and a put that finds it waiting releases it. One worker per queue. */
#include "native.h"

#include <pythread.h>
#include <structmember.h>

typedef struct {
    PyObject *fn, *args, *tag, *context; /* fn NULL: the stop */
    PyObject *argv[2]; /* args NULL: the call's arguments, nargv of them (put_in: no tuple per item) */
    int nargv;
} Item;

typedef struct {
    PyObject_HEAD
    Item *items; /* a ring of cap entries, count of them from head */
    Py_ssize_t cap, head, count;
    long long seq, done; /* items put (not the stop); items the worker has finished */
    char closed, dropping, locked;
    PyThread_type_lock lock;
} HostQueueObject;

static int push(HostQueueObject *q, PyObject *fn, PyObject *args, PyObject *tag, PyObject *context,
                PyObject *const *argv, int nargv) {
    if (q->count == q->cap) {
        Py_ssize_t cap = q->cap ? q->cap * 2 : 16;
        Item *grown = PyMem_Malloc((size_t)cap * sizeof(Item));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < q->count; i++) grown[i] = q->items[(q->head + i) % q->cap];
        PyMem_Free(q->items);
        q->items = grown;
        q->cap = cap;
        q->head = 0;
    }
    Item *it = &q->items[(q->head + q->count) % q->cap];
    it->fn = Py_XNewRef(fn);
    it->args = Py_XNewRef(args);
    it->tag = Py_XNewRef(tag);
    it->context = Py_XNewRef(context);
    it->nargv = nargv;
    for (int i = 0; i < nargv; i++) it->argv[i] = Py_NewRef(argv[i]);
    q->count++;
    if (q->locked) { /* the worker may be waiting: wake it */
        q->locked = 0;
        PyThread_release_lock(q->lock);
    }
    return 0;
}

static Item pop(HostQueueObject *q) {
    Item it = q->items[q->head];
    q->head = (q->head + 1) % q->cap;
    q->count--;
    return it;
}

static void clear_item(Item *it) {
    Py_CLEAR(it->fn);
    Py_CLEAR(it->args);
    Py_CLEAR(it->tag);
    Py_CLEAR(it->context);
    for (int i = 0; i < it->nargv; i++) Py_CLEAR(it->argv[i]);
    it->nargv = 0;
}

static PyObject *HostQueue_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "HostQueue() takes no arguments");
        return NULL;
    }
    HostQueueObject *q = (HostQueueObject *)type->tp_alloc(type, 0);
    if (q == NULL) return NULL;
    q->lock = PyThread_allocate_lock();
    if (q->lock == NULL) {
        Py_DECREF(q);
        PyErr_SetString(PyExc_MemoryError, "HostQueue: cannot allocate a lock");
        return NULL;
    }
    return (PyObject *)q;
}

static int HostQueue_traverse(HostQueueObject *q, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < q->count; i++) {
        Item *it = &q->items[(q->head + i) % q->cap];
        Py_VISIT(it->fn);
        Py_VISIT(it->args);
        Py_VISIT(it->tag);
        Py_VISIT(it->context);
        for (int k = 0; k < it->nargv; k++) Py_VISIT(it->argv[k]);
    }
    return 0;
}

static int HostQueue_clear(HostQueueObject *q) {
    while (q->count) {
        Item it = pop(q);
        clear_item(&it);
    }
    return 0;
}

static void HostQueue_dealloc(HostQueueObject *q) {
    PyObject_GC_UnTrack(q);
    HostQueue_clear(q);
    PyMem_Free(q->items);
    if (q->lock) {
        if (q->locked) PyThread_release_lock(q->lock);
        PyThread_free_lock(q->lock);
    }
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* put(fn, args, tag) -> bool: queue fn(*args) (args a tuple, not a subclass: as the twin);
 * False once closed. */
static PyObject *HostQueue_put(HostQueueObject *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyCallable_Check(args[0]) || !PyTuple_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "put(fn, args, tag) takes a callable, a tuple and a tag");
        return NULL;
    }
    if (q->closed) Py_RETURN_FALSE;
    if (push(q, args[0], args[1], args[2], NULL, NULL, 0) < 0) return NULL;
    q->seq++;
    Py_RETURN_TRUE;
}

/* put_in(context, fn, *args) -> bool: queue context.run(fn, *args); False once closed. */
static PyObject *HostQueue_put_in(HostQueueObject *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || !PyContext_CheckExact(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "put_in(context, fn, *args) takes a contextvars.Context and a callable");
        return NULL;
    }
    if (q->closed) Py_RETURN_FALSE;
    int pushed;
    if (nargs - 2 <= 2) { /* the common case (a chain's hand-off: the task and its batch): no tuple */
        pushed = push(q, args[1], NULL, NULL, args[0], args + 2, (int)(nargs - 2));
    } else {
        PyObject *call_args = PyTuple_New(nargs - 2);
        if (call_args == NULL) return NULL;
        for (Py_ssize_t i = 2; i < nargs; i++) PyTuple_SET_ITEM(call_args, i - 2, Py_NewRef(args[i]));
        pushed = push(q, args[1], call_args, NULL, args[0], NULL, 0);
        Py_DECREF(call_args);
    }
    if (pushed < 0) return NULL;
    q->seq++;
    Py_RETURN_TRUE;
}

/* close() -> bool: no more puts; the worker stops once what is queued has run. False when
 * it was closed already. */
static PyObject *HostQueue_close(HostQueueObject *q, PyObject *unused) {
    if (q->closed) Py_RETURN_FALSE;
    q->closed = 1;
    if (push(q, NULL, NULL, NULL, NULL, NULL, 0) < 0) return NULL;
    Py_RETURN_TRUE;
}

/* Wait, without the GIL, until an item is queued (SimpleQueue's scheme). -1 with the
 * exception set when a signal's handler raised while it waited (KeyboardInterrupt on the
 * main thread: SimpleQueue.get, which the pure twin waits in, lets it out too). */
static int wait_for_item(HostQueueObject *q) {
    while (q->count == 0) {
        PyLockStatus r = PyThread_acquire_lock_timed(q->lock, 0, 0);
        if (r == PY_LOCK_FAILURE) {
            Py_BEGIN_ALLOW_THREADS
            r = PyThread_acquire_lock_timed(q->lock, -1, 1);
            Py_END_ALLOW_THREADS
        }
        if (r == PY_LOCK_INTR && Py_MakePendingCalls() < 0) return -1;
        if (r == PY_LOCK_ACQUIRED) q->locked = 1; /* interrupted: look again */
    }
    if (q->locked) {
        q->locked = 0;
        PyThread_release_lock(q->lock);
    }
    return 0;
}

static void call_quietly(PyObject *fn, PyObject *a, PyObject *b) {
    PyObject *r = b ? PyObject_CallFunctionObjArgs(fn, a, b, NULL)
                    : a ? PyObject_CallOneArg(fn, a) : PyObject_CallNoArgs(fn);
    if (r == NULL) PyErr_WriteUnraisable(fn);
    Py_XDECREF(r);
}

/* Run one item; what it lets out goes to on_error(exc, fn). */
static void run_item(Item *it, PyObject *on_error) {
    PyObject *r = NULL;
    if (it->context == NULL) {
        r = PyObject_Call(it->fn, it->args, NULL);
    } else if (PyContext_Enter(it->context) == 0) {
        r = it->args ? PyObject_Call(it->fn, it->args, NULL) : PyObject_Vectorcall(it->fn, it->argv, it->nargv, NULL);
        if (PyContext_Exit(it->context) < 0) Py_CLEAR(r);
    }
    if (r != NULL) {
        Py_DECREF(r);
        return;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    call_quietly(on_error, value ? value : Py_None, it->fn);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* run(on_stop, on_error, drop): the worker's loop. Each item in order: fn(*args) (in its
 * context), what it lets out to on_error(exc, fn); while `dropping`, drop(fn, tag)
 * instead. At the stop: on_stop(), and return. */
static PyObject *HostQueue_run(HostQueueObject *q, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "run(on_stop, on_error, drop) takes 3 arguments");
        return NULL;
    }
    PyObject *on_stop = args[0], *on_error = args[1], *drop = args[2];
    for (;;) {
        if (wait_for_item(q) < 0) return NULL;
        Item it = pop(q);
        if (it.fn == NULL) {
            call_quietly(on_stop, NULL, NULL);
            Py_RETURN_NONE;
        }
        if (q->dropping) call_quietly(drop, it.fn, it.tag ? it.tag : Py_None);
        else run_item(&it, on_error);
        clear_item(&it); /* the task's arguments go now, not when the next item comes */
        q->done++;
    }
}

/* after_fork() -> [(fn, args, tag)]: in a forked child, where no worker runs: closed and
 * dropping from now on, a new lock (the old one may be held by a thread that is not
 * here), and every queued item taken out unrun, for the caller to drop. */
static PyObject *HostQueue_after_fork(HostQueueObject *q, PyObject *unused) {
    PyThread_type_lock lock = PyThread_allocate_lock();
    if (lock == NULL) return PyErr_NoMemory();
    q->lock = lock; /* the old one is left as it is */
    q->locked = 0;
    q->closed = q->dropping = 1;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    while (q->count) {
        Item it = pop(q);
        if (it.fn != NULL) {
            PyObject *args = it.args ? Py_NewRef(it.args) : PyTuple_New(it.nargv);
            for (int i = 0; args != NULL && it.args == NULL && i < it.nargv; i++)
                PyTuple_SET_ITEM(args, i, Py_NewRef(it.argv[i]));
            PyObject *entry = args ? PyTuple_Pack(3, it.fn, args, it.tag ? it.tag : Py_None) : NULL;
            Py_XDECREF(args);
            if (entry == NULL || PyList_Append(out, entry) < 0) {
                Py_XDECREF(entry);
                clear_item(&it);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(entry);
        }
        clear_item(&it);
    }
    q->done = q->seq;
    return out;
}

static PyObject *get_pending(HostQueueObject *q, void *c) { return PyLong_FromLongLong(q->seq - q->done); }

static PyObject *get_dropping(HostQueueObject *q, void *c) { return PyBool_FromLong(q->dropping); }

static int set_dropping(HostQueueObject *q, PyObject *v, void *c) {
    int value = v ? PyObject_IsTrue(v) : 0;
    if (value < 0) return -1;
    q->dropping = (char)value;
    return 0;
}

static PyObject *get_closed(HostQueueObject *q, void *c) { return PyBool_FromLong(q->closed); }

static PyMethodDef HostQueue_methods[] = {
    {"put", (PyCFunction)(void (*)(void))HostQueue_put, METH_FASTCALL, "Queue fn(*args); False once closed."},
    {"put_in", (PyCFunction)(void (*)(void))HostQueue_put_in, METH_FASTCALL,
     "Queue context.run(fn, *args); False once closed."},
    {"close", (PyCFunction)HostQueue_close, METH_NOARGS, "No more puts; the worker stops after what is queued."},
    {"run", (PyCFunction)(void (*)(void))HostQueue_run, METH_FASTCALL, "The worker's loop."},
    {"after_fork", (PyCFunction)HostQueue_after_fork, METH_NOARGS, "In a forked child: the queued items, unrun."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef HostQueue_members[] = {
    {"seq", T_LONGLONG, offsetof(HostQueueObject, seq), READONLY, "Items put (the stop not counted)."},
    {"done", T_LONGLONG, offsetof(HostQueueObject, done), READONLY, "Items the worker has finished."},
    {NULL},
};

static PyGetSetDef HostQueue_getset[] = {
    {"pending", (getter)get_pending, NULL, "Items queued or running.", NULL},
    {"dropping", (getter)get_dropping, (setter)set_dropping, "Whether queued items are dropped, not run.", NULL},
    {"closed", (getter)get_closed, NULL, "Whether puts are refused.", NULL},
    {NULL},
};

PyTypeObject HostQueue_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "exchange._native.HostQueue",
    .tp_basicsize = sizeof(HostQueueObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A host stream's ordered work queue and its worker's loop (exchange/_core/_pure/hostqueue.py is the twin).",
    .tp_new = HostQueue_new,
    .tp_dealloc = (destructor)HostQueue_dealloc,
    .tp_traverse = (traverseproc)HostQueue_traverse,
    .tp_clear = (inquiry)HostQueue_clear,
    .tp_methods = HostQueue_methods,
    .tp_members = HostQueue_members,
    .tp_getset = HostQueue_getset,
};

int hostqueue_type_ready(PyObject *module) {
    if (PyType_Ready(&HostQueue_Type) < 0) return -1;
    Py_INCREF(&HostQueue_Type);
    if (PyModule_AddObject(module, "HostQueue", (PyObject *)&HostQueue_Type) < 0) {
        Py_DECREF(&HostQueue_Type);
        return -1;
    }
    return 0;
}
