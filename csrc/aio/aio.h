/* Asynchronous file I/O for NVMe offload: a pool of threads doing pread/pwrite on whole requests
 * split into blocks, O_DIRECT where the request allows it and buffered I/O where it does not.
 *
 * A request reads or writes `nbytes` at `offset` of one file, into or from one host buffer. It is
 * cut into blocks of `block_size` bytes, queued (the queue starts with room for `queue_depth`
 * blocks and grows, so a submit never waits for the drive) and carried out by `threads` workers in
 * parallel: each has one transfer in flight, so `threads` is the queue depth the drive sees. Each
 * block goes through the file's O_DIRECT descriptor when its buffer address, offset and length
 * are multiples of `alignment` and the file has one, else through its buffered descriptor (a
 * tmpfs file, an unaligned tail); a direct transfer the filesystem refuses (EINVAL) is redone
 * buffered. Short transfers continue where they stopped; EINTR is retried. The first error of a
 * request (an errno, or ZERO_AIO_EOF for a read past the end of the file) and the file offset it
 * happened at are kept; `zero_aio_wait` returns them once every block of the request is over, so
 * the caller's buffer is never written to after the wait returns. */
#ifndef ZERO_AIO_AIO_H
#define ZERO_AIO_AIO_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ZERO_AIO_EOF (-1) /* a read met the end of the file before its last byte */

typedef struct zero_aio zero_aio;
typedef struct zero_aio_request zero_aio_request;

/* A pool of `threads` workers with a queue of `queue_depth` blocks; NULL if threads could not start. */
zero_aio *zero_aio_create(int threads, int queue_depth);

/* Wait for every queued block, stop the workers and free the pool. */
void zero_aio_destroy(zero_aio *aio);

/* Start reading (write = 0) or writing (write = 1) `nbytes` at `offset` of the file open as
 * `fd_direct` (O_DIRECT, or -1) and `fd_buffered`, into or from `buf`. NULL on bad arguments or
 * when memory for the request runs out (nothing was queued then). */
zero_aio_request *zero_aio_submit(zero_aio *aio, int fd_direct, int fd_buffered, int write, void *buf,
                                  int64_t nbytes, int64_t offset, int64_t block_size, int64_t alignment);

/* Is every block of `req` over? (never blocks) */
int zero_aio_done(zero_aio *aio, zero_aio_request *req);

/* Block until every block of `req` is over, free it, and return 0, the first errno, or
 * ZERO_AIO_EOF; `*error_offset` gets the file offset of that error (untouched on success). */
int zero_aio_wait(zero_aio *aio, zero_aio_request *req, int64_t *error_offset);

/* Bytes moved so far by direct and by buffered transfers, and how many transfers were short or
 * interrupted and continued: out[0..2]. */
void zero_aio_stats(zero_aio *aio, int64_t *out);

#ifdef __cplusplus
}
#endif

#endif
