/* A frame-stack chunk cache for CPython 3.11 and 3.12 (tests/chunkcache.py says why).
 *
 * CPython takes each 16 KiB chunk of a thread's frame stack from its arena allocator (mmap)
 * and gives it back (munmap) as soon as the frame that opened it returns. This allocator
 * passes every request through to the one it replaces, except that it keeps up to KEEP freed
 * chunks and hands them out again. Every block it holds or returns came from that allocator,
 * so installing it in a running process is safe. The GIL serialises every call. */
#include <Python.h>

#define CHUNK (16 * 1024)
#define KEEP 4

static PyObjectArenaAllocator base;
static void *kept[KEEP];
static int nkept = 0;

static void *chunk_alloc(void *ctx, size_t size)
{
    if (size == CHUNK && nkept > 0)
        return kept[--nkept];
    return base.alloc(base.ctx, size);
}

static void chunk_free(void *ctx, void *ptr, size_t size)
{
    if (size == CHUNK && nkept < KEEP) {
        kept[nkept++] = ptr;
        return;
    }
    base.free(base.ctx, ptr, size);
}

/* 1 if this process's arena allocator is this one. */
int installed(void)
{
    PyObjectArenaAllocator now;
    PyObject_GetArenaAllocator(&now);
    return now.alloc == chunk_alloc;
}

/* 1 if installed now, 0 if it already was. */
int install(void)
{
    PyObjectArenaAllocator mine = {NULL, chunk_alloc, chunk_free};
    if (installed())
        return 0;
    PyObject_GetArenaAllocator(&base);
    PyObject_SetArenaAllocator(&mine);
    return 1;
}
