/* The floor of an open's round trip through a FUSE daemon in compiled code (stop 38).
 *
 *   gcc -O2 -o /tmp/open_floor benchmarks/open_floor.c
 *   /tmp/open_floor MOUNTPOINT BACKING_DIR [SPIN_US [yield]]
 *
 * benchmarks/open_floor.py compiles and drives it; nothing here is kvfs. A one-thread server of
 * the kernel protocol (include/uapi/linux/fuse.h, 7.40+) for a flat read-only directory: the
 * regular files of BACKING_DIR. It answers INIT (asking for FUSE_PASSTHROUGH), LOOKUP
 * and GETATTR (fstatat of the backing file), OPEN (the backing file opened, registered with
 * FUSE_DEV_IOC_BACKING_OPEN, closed, answered FOPEN_PASSTHROUGH | FOPEN_NOFLUSH: the same
 * work as kvfs's first passthrough open of a block), RELEASE (FUSE_DEV_IOC_BACKING_CLOSE),
 * FORGET and the rest with ENOSYS. Reads go to the backing file in the kernel.
 *
 * SPIN_US 0 (default): a blocking read(2) of /dev/fuse, as libfuse does. SPIN_US > 0: the
 * device is non-blocking; after each answer the read is retried for up to SPIN_US
 * microseconds before the server sleeps in poll(2); with "yield", each retry that finds
 * nothing calls sched_yield(2) (a reader runnable on the same CPU gets it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { LOOKUP = 1, FORGET = 2, GETATTR = 3, OPEN = 14, RELEASE = 18, FLUSH = 25, INIT = 26,
       OPENDIR = 27, RELEASEDIR = 29, INTERRUPT = 36, DESTROY = 38, BATCH_FORGET = 42 };
#define FOPEN_NOFLUSH (1u << 5)
#define FOPEN_PASSTHROUGH (1u << 7)
#define INIT_EXT (1u << 30)
#define MAX_PAGES (1u << 22)
#define ASYNC_READ (1u << 0)
#define BIG_WRITES (1u << 5)
#define FLAGS2_PASSTHROUGH (1u << 5)          /* bit 37 */
#define ROOT 1
#define TTL 60
#define MAXINO 65536

struct in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid;
                   uint16_t total_extlen, padding; };
struct out_header { uint32_t len; int32_t error; uint64_t unique; };
struct init_in { uint32_t major, minor, max_readahead, flags, flags2, unused[11]; };
struct init_out { uint32_t major, minor, max_readahead, flags; uint16_t max_background,
                  congestion_threshold; uint32_t max_write, time_gran; uint16_t max_pages,
                  map_alignment; uint32_t flags2, max_stack_depth; uint16_t request_timeout,
                  unused[11]; };
struct attr { uint64_t ino, size, blocks, atime, mtime, ctime; uint32_t atimensec, mtimensec,
              ctimensec, mode, nlink, uid, gid, rdev, blksize, flags; };
struct entry_out { uint64_t nodeid, generation, entry_valid, attr_valid;
                   uint32_t entry_valid_nsec, attr_valid_nsec; struct attr attr; };
struct attr_out { uint64_t attr_valid; uint32_t attr_valid_nsec, dummy; struct attr attr; };
struct open_in { uint32_t flags, open_flags; };
struct open_out { uint64_t fh; uint32_t open_flags; int32_t backing_id; };
struct release_in { uint64_t fh; uint32_t flags, release_flags; uint64_t lock_owner; };
struct backing_map { int32_t fd; uint32_t flags; uint64_t padding; };
#define BACKING_OPEN _IOW(229, 1, struct backing_map)
#define BACKING_CLOSE _IOW(229, 2, uint32_t)

static int dev, dirfd_;
static char *names[MAXINO];
static int ninos = 2;

static void reply(uint64_t unique, int err, const void *p, size_t n) {
    struct out_header h = { (uint32_t)(sizeof h + n), -err, unique };
    struct iovec v[2] = { { &h, sizeof h }, { (void *)p, n } };
    if (writev(dev, v, n ? 2 : 1) < 0 && errno != ENOENT && errno != ENODEV)
        perror("writev");
}

static int fill_attr(uint64_t ino, struct attr *a) {
    struct stat st;
    memset(a, 0, sizeof *a);
    if (ino == ROOT) {
        if (fstat(dirfd_, &st)) return errno;
        a->mode = S_IFDIR | 0755; a->size = 4096;
    } else {
        if (ino >= (uint64_t)ninos || !names[ino]) return ENOENT;
        if (fstatat(dirfd_, names[ino], &st, 0)) return errno;
        a->mode = S_IFREG | 0444; a->size = st.st_size;
    }
    a->ino = ino; a->blocks = (a->size + 511) / 512; a->nlink = 1; a->blksize = 4096;
    a->mtime = a->ctime = a->atime = st.st_mtime;
    return 0;
}

static void handle(char *buf) {
    struct in_header *h = (struct in_header *)buf;
    char *body = buf + sizeof *h;
    switch (h->opcode) {
    case INIT: {
        struct init_in *in = (struct init_in *)body;
        struct init_out o = { 0 };
        uint32_t want = ASYNC_READ | BIG_WRITES | MAX_PAGES | INIT_EXT;
        o.major = 7; o.minor = in->minor; o.max_readahead = in->max_readahead;
        o.flags = want & in->flags; o.flags2 = FLAGS2_PASSTHROUGH & in->flags2;
        o.max_background = 16; o.congestion_threshold = 12; o.max_write = 1 << 20;
        o.time_gran = 1; o.max_pages = 256; o.max_stack_depth = 1;
        if (!(o.flags2 & FLAGS2_PASSTHROUGH)) fprintf(stderr, "open_floor: no passthrough\n");
        reply(h->unique, 0, &o, sizeof o);
        return;
    }
    case LOOKUP: {
        struct entry_out e = { 0 };
        int ino, err;
        if (h->nodeid != ROOT) { reply(h->unique, ENOENT, 0, 0); return; }
        for (ino = 2; ino < ninos; ino++)
            if (names[ino] && !strcmp(names[ino], body)) break;
        if (ino == ninos) {
            if (ninos == MAXINO) { reply(h->unique, ENOSPC, 0, 0); return; }
            names[ninos++] = strdup(body);
        }
        if ((err = fill_attr(ino, &e.attr))) { reply(h->unique, err, 0, 0); return; }
        e.nodeid = ino; e.entry_valid = e.attr_valid = TTL;
        reply(h->unique, 0, &e, sizeof e);
        return;
    }
    case GETATTR: {
        struct attr_out a = { 0 };
        int err = fill_attr(h->nodeid, &a.attr);
        a.attr_valid = TTL;
        if (err) reply(h->unique, err, 0, 0); else reply(h->unique, 0, &a, sizeof a);
        return;
    }
    case OPEN: {
        struct open_in *in = (struct open_in *)body;
        struct open_out o = { 0 };
        struct backing_map m = { 0 };
        int fd, id;
        if ((in->flags & O_ACCMODE) != O_RDONLY) { reply(h->unique, EROFS, 0, 0); return; }
        if (h->nodeid >= (uint64_t)ninos || !names[h->nodeid]) { reply(h->unique, ENOENT, 0, 0); return; }
        fd = openat(dirfd_, names[h->nodeid], O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) { reply(h->unique, errno, 0, 0); return; }
        m.fd = fd;
        id = ioctl(dev, BACKING_OPEN, &m);
        close(fd);
        if (id < 0) { reply(h->unique, errno, 0, 0); return; }
        o.fh = (uint64_t)id; o.open_flags = FOPEN_PASSTHROUGH | FOPEN_NOFLUSH; o.backing_id = id;
        reply(h->unique, 0, &o, sizeof o);
        return;
    }
    case OPENDIR: {
        struct open_out o = { 0 };
        reply(h->unique, 0, &o, sizeof o);
        return;
    }
    case RELEASE: {
        uint32_t id = (uint32_t)((struct release_in *)body)->fh;
        ioctl(dev, BACKING_CLOSE, &id);
        reply(h->unique, 0, 0, 0);
        return;
    }
    case FLUSH: case RELEASEDIR: case DESTROY:
        reply(h->unique, 0, 0, 0);
        return;
    case FORGET: case BATCH_FORGET: case INTERRUPT:
        return;
    default:
        reply(h->unique, ENOSYS, 0, 0);
    }
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

int main(int argc, char **argv) {
    static char buf[(1 << 20) + 65536];
    char data[256];
    long spin_us = argc > 3 ? atol(argv[3]) : 0;
    int yield = argc > 4 && !strcmp(argv[4], "yield");
    if (argc < 3) { fprintf(stderr, "usage: %s MOUNTPOINT BACKING_DIR [SPIN_US]\n", argv[0]); return 2; }
    dirfd_ = open(argv[2], O_RDONLY | O_DIRECTORY);
    dev = open("/dev/fuse", O_RDWR | O_CLOEXEC | (spin_us ? O_NONBLOCK : 0));
    if (dirfd_ < 0 || dev < 0) { perror("open"); return 1; }
    snprintf(data, sizeof data, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev);
    if (mount("open-floor", argv[1], "fuse.open-floor", MS_NOSUID | MS_NODEV, data)) { perror("mount"); return 1; }
    printf("READY\n");
    fflush(stdout);
    for (;;) {
        ssize_t n = read(dev, buf, sizeof buf);
        if (n < 0 && errno == EAGAIN) {              /* spinning: retry for the window, then sleep */
            uint64_t end = now_ns() + (uint64_t)spin_us * 1000;
            while ((n = read(dev, buf, sizeof buf)) < 0 && errno == EAGAIN && now_ns() < end)
                if (yield)
                    sched_yield();
            if (n < 0 && errno == EAGAIN) {
                struct pollfd p = { dev, POLLIN, 0 };
                poll(&p, 1, -1);
                continue;
            }
        }
        if (n < 0) {
            if (errno == EINTR || errno == ENOENT || errno == EAGAIN) continue;
            if (errno == ENODEV) return 0;
            perror("read");
            return 1;
        }
        handle(buf);
    }
}
