/* nulltickets._cext.walsync: the WAL sync threads of durability `full`, in C.

   The threads sync the writer's WAL through SQLite's own file handle (the `xSync` method and
   `sqlite3_file` that storage/sqlite/walsync.py finds through SQLITE_FCNTL_JOURNAL_POINTER)
   whenever the writer has committed something no sync covers yet, and say so by writing a byte
   to a pipe that the event loop watches. They never take the GIL: a Python thread doing the
   same takes it twice per sync (to start the call and to return from it), and each time the
   loop's thread has to give it up and wait to get it back, for every commit under load.

   A sync covers every commit made before it began. With more than one thread, a commit made
   while a sync runs starts its own sync on an idle thread at once; since each sync makes
   durable everything written before it began, `synced` is the highest target of any sync that
   has completed, whichever order they complete in.

   A VFS written in Python (the tests' power-cut VFS) still works: apsw takes the GIL itself
   inside its VFS methods, whatever thread SQLite (or this one) calls them from.

   POSIX threads only; storage/sqlite/walsync.py falls back to a Python thread elsewhere (and
   when this module is not built). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

typedef int (*xsync_fn)(void *file, int flags);

#define MAX_THREADS 4
#define MAX_BOUNDS 32

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;     /* the threads wait here for a commit to sync */
    pthread_cond_t progress; /* sync_through waits here for the threads' syncs */
    long long committed;     /* the last commit said to be in the WAL */
    long long started;       /* the last commit a sync in progress (or done) covers */
    long long synced;        /* the last commit known to be on disk */
    long long syncs;         /* syncs completed */
    int failed;              /* SQLite's error code of the sync that failed, else 0 */
    int stopping;
    int ended;               /* threads that have returned (stopped, or after a failed sync) */
    int nthreads;
    int running;             /* the threads were started and not yet joined */
    int notify_fd;           /* the pipe's write end: a byte after every sync */
    xsync_fn xsync;
    void *file;
    int flags;
    pthread_t threads[MAX_THREADS];
    /* How long each sync took, for GET /metrics: counts per bucket (the last: above every
       bound) and their sum, under `mu`. */
    int nbounds;
    long long bounds_ns[MAX_BOUNDS];
    long long counts[MAX_BOUNDS + 1];
    long long sum_ns;
} SyncThread;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Under `mu`: one sync of `ns` nanoseconds. */
static void observe(SyncThread *self, long long ns) {
    int slot = 0;
    while (slot < self->nbounds && ns > self->bounds_ns[slot])
        slot++;
    self->counts[slot]++;
    self->sum_ns += ns;
}

static void notify(int fd) {
    char byte = 1;
    ssize_t n;
    do {
        n = write(fd, &byte, 1);
    } while (n < 0 && errno == EINTR);
    /* EAGAIN: the pipe is full, so the loop has a wake-up coming already. */
}

static void *run(void *arg) {
    SyncThread *self = (SyncThread *)arg;
    pthread_mutex_lock(&self->mu);
    for (;;) {
        while (self->committed <= self->started && !self->stopping && !self->failed)
            pthread_cond_wait(&self->work, &self->mu);
        if (self->committed <= self->started || self->failed)
            break; /* stopping, and nothing left to sync */
        /* Every commit up to here returned before this sync begins, so the sync covers it. */
        long long target = self->committed;
        self->started = target;
        pthread_mutex_unlock(&self->mu);
        long long began = now_ns();
        int rc = self->xsync(self->file, self->flags);
        long long took = now_ns() - began;
        pthread_mutex_lock(&self->mu);
        if (rc == 0) {
            if (target > self->synced)
                self->synced = target;
            self->syncs++;
            observe(self, took);
        } else {
            /* Which frames reached the disk is unknown now: no later sync could be trusted
               either, so the thread ends and the writer refuses writes (walsync.py). */
            self->failed = rc;
        }
        pthread_cond_broadcast(&self->progress);
        pthread_mutex_unlock(&self->mu);
        notify(self->notify_fd);
        pthread_mutex_lock(&self->mu);
        if (rc != 0)
            break;
    }
    self->ended++;
    pthread_cond_broadcast(&self->progress);
    pthread_cond_broadcast(&self->work); /* after a failure, the other threads end too */
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

static void join(SyncThread *self) {
    if (!self->running)
        return;
    pthread_mutex_lock(&self->mu);
    self->stopping = 1;
    pthread_cond_broadcast(&self->work);
    pthread_mutex_unlock(&self->mu);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < self->nthreads; i++)
        pthread_join(self->threads[i], NULL);
    Py_END_ALLOW_THREADS
    self->running = 0;
}

static int SyncThread_init(SyncThread *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"xsync", "file", "flags", "notify_fd", "threads", "bounds", NULL};
    unsigned long long xsync, file;
    int flags, fd, nthreads = 1;
    PyObject *bounds = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKii|iO", names, &xsync, &file, &flags, &fd,
                                     &nthreads, &bounds))
        return -1;
    if (self->running) {
        PyErr_SetString(PyExc_RuntimeError, "the sync thread is running already");
        return -1;
    }
    if (bounds != NULL) {
        PyObject *seq = PySequence_Fast(bounds, "bounds must be a sequence of seconds");
        if (seq == NULL)
            return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > MAX_BOUNDS) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "at most 32 bounds");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            double seconds = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
            if (seconds == -1.0 && PyErr_Occurred()) {
                Py_DECREF(seq);
                return -1;
            }
            self->bounds_ns[i] = (long long)(seconds * 1e9);
        }
        self->nbounds = (int)n;
        Py_DECREF(seq);
    }
    if (nthreads < 1 || nthreads > MAX_THREADS) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1 to 4");
        return -1;
    }
    if (!xsync || !file || fd < 0) {
        PyErr_SetString(PyExc_ValueError, "a WAL file's xSync, the file and a pipe are needed");
        return -1;
    }
    self->xsync = (xsync_fn)(uintptr_t)xsync;
    self->file = (void *)(uintptr_t)file;
    self->flags = flags;
    self->notify_fd = fd;
    self->nthreads = 0;
    for (int i = 0; i < nthreads; i++) {
        int rc = pthread_create(&self->threads[i], NULL, run, self);
        if (rc != 0) {
            join(self);
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->nthreads++;
        self->running = 1;
    }
    return 0;
}

static PyObject *SyncThread_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    SyncThread *self = (SyncThread *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->progress, NULL);
    self->notify_fd = -1;
    return (PyObject *)self;
}


static void SyncThread_dealloc(SyncThread *self) {
    join(self);
    pthread_cond_destroy(&self->progress);
    pthread_cond_destroy(&self->work);
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(committed_doc, "committed(seq): commits up to seq are in the WAL; sync them.");

static PyObject *SyncThread_committed(SyncThread *self, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    /* Held only for a few stores by either side: not worth releasing the GIL for. */
    pthread_mutex_lock(&self->mu);
    if (seq > self->committed) {
        self->committed = seq;
        pthread_cond_signal(&self->work);
    }
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sync_through_doc,
             "sync_through(seq) -> int: block, without the GIL, until commits up to seq are on\n"
             "disk or a sync failed; returns 0 or the failed sync's SQLite error code.");

static PyObject *SyncThread_sync_through(SyncThread *self, PyObject *arg) {
    long long seq = PyLong_AsLongLong(arg);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    if (!self->running)
        return PyLong_FromLong(-1);
    int failed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    if (seq > self->committed) {
        self->committed = seq;
        pthread_cond_signal(&self->work);
    }
    while (self->synced < seq && !self->failed && self->ended < self->nthreads)
        pthread_cond_wait(&self->progress, &self->mu);
    failed = self->failed;
    if (!failed && self->synced < seq)
        failed = -1; /* the thread ended before syncing it */
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(failed);
}

PyDoc_STRVAR(state_doc, "state() -> (synced, failed, syncs): the thread's progress so far.");

static PyObject *SyncThread_state(SyncThread *self, PyObject *Py_UNUSED(ignored)) {
    pthread_mutex_lock(&self->mu);
    long long synced = self->synced, syncs = self->syncs;
    int failed = self->failed;
    pthread_mutex_unlock(&self->mu);
    return Py_BuildValue("(LiL)", synced, failed, syncs);
}

PyDoc_STRVAR(durations_doc,
             "durations() -> (counts, sum): how many syncs took at most each bound given at\n"
             "start (the last count: more than every bound), and their total in seconds.");

static PyObject *SyncThread_durations(SyncThread *self, PyObject *Py_UNUSED(ignored)) {
    long long counts[MAX_BOUNDS + 1];
    pthread_mutex_lock(&self->mu);
    int n = self->nbounds + 1;
    for (int i = 0; i < n; i++)
        counts[i] = self->counts[i];
    long long sum_ns = self->sum_ns;
    pthread_mutex_unlock(&self->mu);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *count = PyLong_FromLongLong(counts[i]);
        if (count == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, count);
    }
    return Py_BuildValue("(Nd)", list, (double)sum_ns / 1e9);
}

PyDoc_STRVAR(idents_doc, "idents() -> tuple: the threads' identifiers, as threading.get_ident()\n"
                         "gives them on those threads (empty once they have ended).");

static PyObject *SyncThread_idents(SyncThread *self, PyObject *Py_UNUSED(ignored)) {
    int n = self->running ? self->nthreads : 0;
    PyObject *idents = PyTuple_New(n);
    if (idents == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *ident = PyLong_FromUnsignedLong((unsigned long)self->threads[i]);
        if (ident == NULL) {
            Py_DECREF(idents);
            return NULL;
        }
        PyTuple_SET_ITEM(idents, i, ident);
    }
    return idents;
}

PyDoc_STRVAR(stop_doc, "stop(): finish the sync in progress (and one for commits not yet\n"
                       "synced), then end the thread.");

static PyObject *SyncThread_stop(SyncThread *self, PyObject *Py_UNUSED(ignored)) {
    join(self);
    Py_RETURN_NONE;
}

static PyMethodDef SyncThread_methods[] = {
    {"committed", (PyCFunction)SyncThread_committed, METH_O, committed_doc},
    {"sync_through", (PyCFunction)SyncThread_sync_through, METH_O, sync_through_doc},
    {"state", (PyCFunction)SyncThread_state, METH_NOARGS, state_doc},
    {"durations", (PyCFunction)SyncThread_durations, METH_NOARGS, durations_doc},
    {"idents", (PyCFunction)SyncThread_idents, METH_NOARGS, idents_doc},
    {"stop", (PyCFunction)SyncThread_stop, METH_NOARGS, stop_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SyncThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nulltickets._cext.walsync.SyncThread",
    .tp_doc = PyDoc_STR("SyncThread(xsync, file, flags, notify_fd, threads=1, bounds=()): syncs\n"
                        "a WAL file on POSIX threads that never take the GIL, counting how\n"
                        "long each sync took against `bounds` (seconds)."),
    .tp_basicsize = sizeof(SyncThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = SyncThread_new,
    .tp_init = (initproc)SyncThread_init,
    .tp_dealloc = (destructor)SyncThread_dealloc,
    .tp_methods = SyncThread_methods,
};

static struct PyModuleDef walsync_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nulltickets._cext.walsync",
    .m_doc = PyDoc_STR("The WAL sync thread of durability `full`, without the GIL."),
    .m_size = -1,
};

PyMODINIT_FUNC PyInit_walsync(void) {
    if (PyType_Ready(&SyncThreadType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&walsync_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SyncThreadType);
    if (PyModule_AddObject(m, "SyncThread", (PyObject *)&SyncThreadType) < 0) {
        Py_DECREF(&SyncThreadType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
