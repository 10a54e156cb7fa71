/* The floor of an open's round trip through a FUSE daemon in compiled code (stop 38).
 *
 *   gcc -O2 -o /tmp/open_floor benchmarks/open_floor.c
 *   /tmp/open_floor MOUNTPOINT BACKING_DIR [SPIN_US [yield] [uring|uringpin] [attr_ttl=S]]
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
 *
 * "uring" (FUSE over io_uring, Linux 6.14+, the fuse module's enable_uring set by root): INIT
 * (read from /dev/fuse as ever) is answered with FUSE_OVER_IO_URING; then one thread sets up an
 * io_uring with raw syscalls (128-byte SQEs: the command lives in the SQE) and registers
 * NENT entries for every CPU queue (IORING_OP_URING_CMD, FUSE_IO_URING_CMD_REGISTER; each entry
 * a header buffer, struct fuse_uring_req_header, and a payload buffer of max_write bytes). Once
 * every queue has an entry the kernel sends requests through the ring: a CQE says an entry holds
 * a request (fuse_in_header in in_out, the opcode's fixed argument in op_in, the rest, e.g.
 * LOOKUP's name, in the payload); the answer is written back into the same buffers and handed
 * in with FUSE_IO_URING_CMD_COMMIT_AND_FETCH, which also waits for the entry's next request.
 * The thread sleeps in io_uring_enter(GETEVENTS), or with SPIN_US > 0 first polls the CQ ring
 * for that long. "uringpin": one such thread per CPU queue, pinned to that CPU (the kernel puts
 * a request on the queue of the CPU its caller runs on). The main thread keeps reading
 * /dev/fuse (FORGET and INTERRUPT still come that way). Prints "READY uring" once registered,
 * "URING_FAIL <step> <errno>" and exits if a step fails.
 * attr_ttl=S: attribute timeout of LOOKUP and GETATTR replies (default 60; 0: every stat(2) of
 * a looked-up name is a GETATTR round trip).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysinfo.h>
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
#define FLAGS2_OVER_IO_URING (1u << 9)        /* bit 41 */
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

/* FUSE over io_uring (include/uapi/linux/fuse.h, 7.42+) */
struct uring_ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct uring_req_header { char in_out[128], op_in[128]; struct uring_ent_in_out ent; };
struct uring_cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };
enum { URING_CMD_REGISTER = 1, URING_CMD_COMMIT_AND_FETCH = 2 };
#define PAYLOAD (1u << 20)                    /* >= the kernel's max_payload_sz: max_write, max_pages */
#define NENT 2                                /* entries per queue */

struct ent { struct uring_req_header hdr; char *payload; struct iovec iov[2]; uint16_t qid; };

static int dev, dirfd_;
static char *names[MAXINO];
static int ninos = 2;
static uint64_t attr_ttl = TTL;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread struct ent *cur;             /* the ring entry being answered; NULL: /dev/fuse */
static unsigned long served_dev, served_ring;   /* requests per path, printed on stderr at unmount */

static void reply(uint64_t unique, int err, const void *p, size_t n) {
    struct out_header h = { (uint32_t)(sizeof h + n), -err, unique };
    if (cur) {                                /* into the entry's buffers; committed by the caller */
        memcpy(cur->hdr.in_out, &h, sizeof h);
        if (n) memcpy(cur->payload, p, n);
        cur->hdr.ent.payload_sz = (uint32_t)n;
        return;
    }
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

static int want_uring, uring_on;

/* arg: the opcode's fixed argument; name: LOOKUP's name (over /dev/fuse both follow the header) */
static void handle(struct in_header *h, char *body, char *name) {
    switch (h->opcode) {
    case INIT: {
        struct init_in *in = (struct init_in *)body;
        struct init_out o = { 0 };
        uint32_t want = ASYNC_READ | BIG_WRITES | MAX_PAGES | INIT_EXT;
        o.major = 7; o.minor = in->minor; o.max_readahead = in->max_readahead;
        o.flags = want & in->flags; o.flags2 = FLAGS2_PASSTHROUGH & in->flags2;
        if (want_uring) o.flags2 |= FLAGS2_OVER_IO_URING & in->flags2;
        uring_on = !!(o.flags2 & FLAGS2_OVER_IO_URING);
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
            if (names[ino] && !strcmp(names[ino], name)) break;
        if (ino == ninos) {
            if (ninos == MAXINO) { reply(h->unique, ENOSPC, 0, 0); return; }
            names[ninos++] = strdup(name);
        }
        if ((err = fill_attr(ino, &e.attr))) { reply(h->unique, err, 0, 0); return; }
        e.nodeid = ino; e.entry_valid = TTL; e.attr_valid = attr_ttl;
        reply(h->unique, 0, &e, sizeof e);
        return;
    }
    case GETATTR: {
        struct attr_out a = { 0 };
        int err = fill_attr(h->nodeid, &a.attr);
        a.attr_valid = attr_ttl;
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

static long spin_us;

/* ---- io_uring, raw: the SQ and CQ rings mapped from the ring's fd ---- */
struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, sq_entries, pending;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    char *sqes;                                /* 128 bytes each (IORING_SETUP_SQE128) */
};

static int ring_init(struct ring *r, unsigned entries) {
    struct io_uring_params p;
    size_t sqsz, cqsz;
    char *sq, *cq;
    memset(&p, 0, sizeof p);
    memset(r, 0, sizeof *r);
    p.flags = IORING_SETUP_SQE128;
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) return -errno;
    sqsz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cqsz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) sqsz = cqsz = sqsz > cqsz ? sqsz : cqsz;
    sq = mmap(0, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) return -errno;
    cq = (p.features & IORING_FEAT_SINGLE_MMAP) ? sq :
         mmap(0, cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    if (cq == MAP_FAILED) return -errno;
    r->sqes = mmap(0, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) return -errno;
    r->sq_head = (unsigned *)(sq + p.sq_off.head); r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask); r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->sq_entries = p.sq_entries;
    r->cq_head = (unsigned *)(cq + p.cq_off.head); r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* queue one URING_CMD on /dev/fuse for entry e (published to the kernel at the next enter) */
static int ring_cmd(struct ring *r, struct ent *e, uint32_t op, uint64_t commit_id) {
    unsigned tail = *r->sq_tail, idx;
    struct io_uring_sqe *q;
    struct uring_cmd_req *c;
    if (tail - __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE) >= r->sq_entries) return -EBUSY;
    idx = tail & *r->sq_mask;
    q = (struct io_uring_sqe *)(r->sqes + (size_t)idx * 128);
    memset(q, 0, 128);
    q->opcode = IORING_OP_URING_CMD;
    q->fd = dev;
    q->cmd_op = op;
    q->user_data = (uint64_t)(uintptr_t)e;
    if (op == URING_CMD_REGISTER) { q->addr = (uint64_t)(uintptr_t)e->iov; q->len = 2; }
    c = (struct uring_cmd_req *)q->cmd;
    c->commit_id = commit_id;
    c->qid = e->qid;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->pending++;
    return 0;
}

static int ring_enter(struct ring *r, unsigned min_complete) {
    int n = (int)syscall(__NR_io_uring_enter, r->fd, r->pending, min_complete,
                         min_complete ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
    if (n < 0) return -errno;
    r->pending -= (unsigned)n;
    return n;
}

static int cq_ready(struct ring *r) {
    return *r->cq_head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
}

struct qthread { int q0, nq, cpu; pthread_t t; };
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reg_cond = PTHREAD_COND_INITIALIZER;
static int reg_done, reg_err;
static const char *reg_step = "";

static void reg_report(int err, const char *step) {
    pthread_mutex_lock(&reg_lock);
    reg_done++;
    if (err && !reg_err) { reg_err = err; reg_step = step; }
    pthread_cond_broadcast(&reg_cond);
    pthread_mutex_unlock(&reg_lock);
}

/* One ring serving queues q0 .. q0+nq-1: register their entries, then answer CQE after CQE. */
static void *ring_main(void *arg) {
    struct qthread *t = arg;
    struct ring r;
    int err, q, k, n = 0;
    if (t->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set); CPU_SET(t->cpu, &set);
        sched_setaffinity(0, sizeof set, &set);
    }
    if ((err = ring_init(&r, 64))) { reg_report(-err, "io_uring_setup"); return 0; }
    for (q = t->q0; q < t->q0 + t->nq; q++)
        for (k = 0; k < NENT; k++) {
            struct ent *e = aligned_alloc(4096, sizeof *e);
            memset(e, 0, sizeof *e);
            e->payload = aligned_alloc(4096, PAYLOAD);
            e->iov[0] = (struct iovec){ &e->hdr, sizeof e->hdr };
            e->iov[1] = (struct iovec){ e->payload, PAYLOAD };
            e->qid = (uint16_t)q;
            ring_cmd(&r, e, URING_CMD_REGISTER, 0);
            n++;
        }
    if ((err = ring_enter(&r, 0)) < 0) { reg_report(-err, "io_uring_enter(REGISTER)"); return 0; }
    /* a refused REGISTER completes at once with a negative result; an accepted one only when a
       request comes */
    for (unsigned h = *r.cq_head; h != __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE); h++)
        if (r.cqes[h & *r.cq_mask].res < 0) { reg_report(-r.cqes[h & *r.cq_mask].res, "REGISTER"); return 0; }
    reg_report(0, "");
    for (;;) {
        unsigned head, tail;
        if (spin_us && !cq_ready(&r)) {       /* hand in the answers, then poll the CQ a while */
            uint64_t end;
            if (r.pending && (err = ring_enter(&r, 0)) < 0 && err != -EINTR) break;
            end = now_ns() + (uint64_t)spin_us * 1000;
            while (!cq_ready(&r) && now_ns() < end)
                ;
        }
        if (!cq_ready(&r) && (err = ring_enter(&r, 1)) < 0 && err != -EINTR) {
            fprintf(stderr, "open_floor: io_uring_enter: %s\n", strerror(-err));
            break;
        }
        head = *r.cq_head;
        tail = __atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *c = &r.cqes[head & *r.cq_mask];
            struct ent *e = (struct ent *)(uintptr_t)c->user_data;
            struct in_header h;
            if (c->res < 0) {                  /* -ENOTCONN: unmounted; anything else: report */
                if (c->res != -ENOTCONN && c->res != -ECANCELED)
                    fprintf(stderr, "open_floor: ring entry q%u: %s\n", e->qid, strerror(-c->res));
                __atomic_store_n(r.cq_head, head + 1, __ATOMIC_RELEASE);
                goto out;
            }
            memcpy(&h, e->hdr.in_out, sizeof h);   /* in_out is overwritten by the answer */
            e->payload[e->hdr.ent.payload_sz < PAYLOAD ? e->hdr.ent.payload_sz : PAYLOAD - 1] = 0;
            cur = e;
            pthread_mutex_lock(&lock);
            handle(&h, e->hdr.op_in, e->payload);   /* FORGET and INTERRUPT come over /dev/fuse */
            served_ring++;
            pthread_mutex_unlock(&lock);
            cur = 0;
            if (ring_cmd(&r, e, URING_CMD_COMMIT_AND_FETCH, e->hdr.ent.commit_id) == -EBUSY) {
                ring_enter(&r, 0);
                ring_cmd(&r, e, URING_CMD_COMMIT_AND_FETCH, e->hdr.ent.commit_id);
            }
        }
        __atomic_store_n(r.cq_head, head, __ATOMIC_RELEASE);   /* answers go in with the next enter */
    }
out:
    return 0;
}

/* the kernel has one queue per possible CPU (num_possible_cpus()) and routes nothing over the
   ring until every queue has an entry */
static int possible_cpus(void) {
    char s[64] = "";
    int lo = 0, hi = 0;
    FILE *f = fopen("/sys/devices/system/cpu/possible", "r");
    if (f) { if (!fgets(s, sizeof s, f)) s[0] = 0; fclose(f); }
    if (sscanf(s, "%d-%d", &lo, &hi) == 2) return hi + 1;
    return get_nprocs_conf();
}

static int start_uring(int pin) {
    static struct qthread th[1024];
    int nq = possible_cpus(), nt = pin ? nq : 1, i;
    if (nq > 1024) return -1;
    for (i = 0; i < nt; i++) {
        th[i].q0 = pin ? i : 0; th[i].nq = pin ? 1 : nq; th[i].cpu = pin ? i : -1;
        pthread_create(&th[i].t, 0, ring_main, &th[i]);
    }
    pthread_mutex_lock(&reg_lock);
    while (reg_done < nt) pthread_cond_wait(&reg_cond, &reg_lock);
    pthread_mutex_unlock(&reg_lock);
    if (reg_err) { printf("URING_FAIL %s %d %s\n", reg_step, reg_err, strerror(reg_err)); fflush(stdout); return -1; }
    printf("READY uring queues=%d threads=%d entries=%d\n", nq, nt, nq * NENT);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    static char buf[(1 << 20) + 65536];
    char data[256];
    int yield = 0, uring = 0, pin = 0, i;
    if (argc < 3) { fprintf(stderr, "usage: %s MOUNTPOINT BACKING_DIR [SPIN_US [yield] [uring|uringpin] [attr_ttl=S]]\n", argv[0]); return 2; }
    spin_us = argc > 3 ? atol(argv[3]) : 0;
    for (i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "yield")) yield = 1;
        else if (!strcmp(argv[i], "uring")) uring = 1;
        else if (!strcmp(argv[i], "uringpin")) uring = pin = 1;
        else if (!strncmp(argv[i], "attr_ttl=", 9)) attr_ttl = (uint64_t)atol(argv[i] + 9);
        else { fprintf(stderr, "open_floor: unknown argument %s\n", argv[i]); return 2; }
    }
    want_uring = uring;
    dirfd_ = open(argv[2], O_RDONLY | O_DIRECTORY);
    /* over io_uring the spin is the ring's; /dev/fuse (INIT, FORGET) is read blocking */
    dev = open("/dev/fuse", O_RDWR | O_CLOEXEC | (spin_us && !uring ? O_NONBLOCK : 0));
    if (dirfd_ < 0 || dev < 0) { perror("open"); return 1; }
    snprintf(data, sizeof data, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev);
    if (mount("open-floor", argv[1], "fuse.open-floor", MS_NOSUID | MS_NODEV, data)) { perror("mount"); return 1; }
    if (!uring) {
        printf("READY\n");
        fflush(stdout);
    }
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
            if (errno == ENODEV) {
                pthread_mutex_lock(&lock);
                fprintf(stderr, "served: dev %lu ring %lu\n", served_dev, served_ring);
                return 0;
            }
            perror("read");
            return 1;
        }
        pthread_mutex_lock(&lock);
        handle((struct in_header *)buf, buf + sizeof(struct in_header), buf + sizeof(struct in_header));
        served_dev++;
        pthread_mutex_unlock(&lock);
        if (uring && ((struct in_header *)buf)->opcode == INIT) {
            if (!uring_on) { printf("URING_FAIL INIT not_offered 0 (enable_uring off?)\n"); fflush(stdout); return 1; }
            if (start_uring(pin)) return 1;
        }
    }
}
