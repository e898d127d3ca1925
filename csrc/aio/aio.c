/* The thread pool behind aio.h. One mutex guards the queue and every request's counters; workers
 * hold it only to take a block and to report one finished, never during a transfer. */
#define _GNU_SOURCE
#include "aio/aio.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

struct zero_aio_request {
    int64_t pending;      /* blocks queued or running */
    int error;            /* first error: 0, an errno, or ZERO_AIO_EOF */
    int64_t error_offset; /* where it happened */
};

typedef struct {
    int fd_direct, fd_buffered, write;
    char *buf;
    int64_t len, offset, alignment;
    zero_aio_request *req;
} block;

struct zero_aio {
    pthread_t *threads;
    int nthreads;
    block *queue; /* a ring of `capacity` blocks */
    int capacity, head, count;
    int stop;
    pthread_mutex_t mu;
    pthread_cond_t work, room, finished;
    int64_t direct_bytes, buffered_bytes, continued;
};

/* Move one block through `fd`: 0, an errno, or ZERO_AIO_EOF; `*at` gets the offset reached. */
static int transfer(int fd, const block *b, int64_t *at, int64_t *continued) {
    int64_t done = 0;
    while (done < b->len) {
        ssize_t n = b->write ? pwrite(fd, b->buf + done, (size_t)(b->len - done), (off_t)(b->offset + done))
                             : pread(fd, b->buf + done, (size_t)(b->len - done), (off_t)(b->offset + done));
        if (n < 0 && errno == EINTR) {
            ++*continued;
            continue;
        }
        if (n < 0) {
            *at = b->offset + done;
            return errno;
        }
        if (n == 0) { /* a read at the end of the file (a write of 0 bytes cannot happen for len > 0) */
            *at = b->offset + done;
            return b->write ? EIO : ZERO_AIO_EOF;
        }
        done += n;
        if (done < b->len) ++*continued;
    }
    return 0;
}

static void run(zero_aio *aio, const block *b) {
    int64_t at = 0, continued = 0;
    int direct = b->fd_direct >= 0 && ((uintptr_t)b->buf % (uintptr_t)b->alignment) == 0 &&
                 b->offset % b->alignment == 0 && b->len % b->alignment == 0;
    int err = direct ? transfer(b->fd_direct, b, &at, &continued) : -2;
    if (err == EINVAL && direct) { /* the filesystem does not take this direct transfer: buffered */
        direct = 0;
        err = -2;
    }
    if (err == -2) err = transfer(b->fd_buffered, b, &at, &continued);
    pthread_mutex_lock(&aio->mu);
    if (err == 0) {
        if (direct) aio->direct_bytes += b->len;
        else aio->buffered_bytes += b->len;
    } else if (b->req->error == 0) {
        b->req->error = err;
        b->req->error_offset = at;
    }
    aio->continued += continued;
    if (--b->req->pending == 0) pthread_cond_broadcast(&aio->finished);
    pthread_mutex_unlock(&aio->mu);
}

static void *worker(void *arg) {
    zero_aio *aio = arg;
    pthread_mutex_lock(&aio->mu);
    for (;;) {
        while (aio->count == 0 && !aio->stop) pthread_cond_wait(&aio->work, &aio->mu);
        if (aio->count == 0) break; /* stopping, and the queue is drained */
        block b = aio->queue[aio->head];
        aio->head = (aio->head + 1) % aio->capacity;
        aio->count--;
        pthread_cond_signal(&aio->room);
        pthread_mutex_unlock(&aio->mu);
        run(aio, &b);
        pthread_mutex_lock(&aio->mu);
    }
    pthread_mutex_unlock(&aio->mu);
    return NULL;
}

/* Double the queue, keeping its order (called with the mutex held): 0, or -1 without memory. */
static int grow(zero_aio *aio) {
    block *queue = malloc(2 * (size_t)aio->capacity * sizeof *queue);
    if (queue == NULL) return -1;
    for (int i = 0; i < aio->count; i++) queue[i] = aio->queue[(aio->head + i) % aio->capacity];
    free(aio->queue);
    aio->queue = queue;
    aio->head = 0;
    aio->capacity *= 2;
    return 0;
}

zero_aio *zero_aio_create(int threads, int queue_depth) {
    if (threads < 1 || queue_depth < 1) return NULL;
    zero_aio *aio = calloc(1, sizeof *aio);
    if (aio == NULL) return NULL;
    aio->threads = calloc((size_t)threads, sizeof *aio->threads);
    aio->queue = calloc((size_t)queue_depth, sizeof *aio->queue);
    aio->capacity = queue_depth;
    pthread_mutex_init(&aio->mu, NULL);
    pthread_cond_init(&aio->work, NULL);
    pthread_cond_init(&aio->room, NULL);
    pthread_cond_init(&aio->finished, NULL);
    if (aio->threads == NULL || aio->queue == NULL) {
        zero_aio_destroy(aio);
        return NULL;
    }
    for (; aio->nthreads < threads; aio->nthreads++) {
        if (pthread_create(&aio->threads[aio->nthreads], NULL, worker, aio) != 0) {
            zero_aio_destroy(aio);
            return NULL;
        }
    }
    return aio;
}

void zero_aio_destroy(zero_aio *aio) {
    if (aio == NULL) return;
    pthread_mutex_lock(&aio->mu);
    aio->stop = 1;
    pthread_cond_broadcast(&aio->work);
    pthread_mutex_unlock(&aio->mu);
    for (int i = 0; i < aio->nthreads; i++) pthread_join(aio->threads[i], NULL);
    pthread_mutex_destroy(&aio->mu);
    pthread_cond_destroy(&aio->work);
    pthread_cond_destroy(&aio->room);
    pthread_cond_destroy(&aio->finished);
    free(aio->threads);
    free(aio->queue);
    free(aio);
}

zero_aio_request *zero_aio_submit(zero_aio *aio, int fd_direct, int fd_buffered, int write, void *buf,
                                  int64_t nbytes, int64_t offset, int64_t block_size, int64_t alignment) {
    if (aio == NULL || fd_buffered < 0 || (buf == NULL && nbytes > 0) || nbytes < 0 || offset < 0 ||
        block_size < 1 || alignment < 1)
        return NULL;
    zero_aio_request *req = calloc(1, sizeof *req);
    if (req == NULL) return NULL;
    int64_t blocks = (nbytes + block_size - 1) / block_size;
    pthread_mutex_lock(&aio->mu);
    req->pending = blocks; /* counted whole first: a fast worker cannot see the request finished early */
    for (int64_t i = 0; i < blocks; i++) {
        if (aio->count == aio->capacity && grow(aio) != 0) { /* no memory for a longer queue: wait for room */
            while (aio->count == aio->capacity) pthread_cond_wait(&aio->room, &aio->mu);
        }
        int64_t lo = i * block_size;
        block b = {fd_direct, fd_buffered, write != 0, (char *)buf + lo,
                   nbytes - lo < block_size ? nbytes - lo : block_size, offset + lo, alignment, req};
        aio->queue[(aio->head + aio->count) % aio->capacity] = b;
        aio->count++;
        pthread_cond_signal(&aio->work);
    }
    pthread_mutex_unlock(&aio->mu);
    return req;
}

int zero_aio_done(zero_aio *aio, zero_aio_request *req) {
    pthread_mutex_lock(&aio->mu);
    int done = req->pending == 0;
    pthread_mutex_unlock(&aio->mu);
    return done;
}

int zero_aio_wait(zero_aio *aio, zero_aio_request *req, int64_t *error_offset) {
    pthread_mutex_lock(&aio->mu);
    while (req->pending > 0) pthread_cond_wait(&aio->finished, &aio->mu);
    pthread_mutex_unlock(&aio->mu);
    int err = req->error;
    if (err != 0 && error_offset != NULL) *error_offset = req->error_offset;
    free(req);
    return err;
}

void zero_aio_stats(zero_aio *aio, int64_t *out) {
    pthread_mutex_lock(&aio->mu);
    out[0] = aio->direct_bytes;
    out[1] = aio->buffered_bytes;
    out[2] = aio->continued;
    pthread_mutex_unlock(&aio->mu);
}
