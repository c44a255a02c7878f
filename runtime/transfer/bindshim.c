/* Loaded with LD_PRELOAD into a worker rank (runtime/transfer/bindshim.py). Two wrappers around
 * Mooncake's transfer engine, which offers no setting for either:
 *
 * bind(): Mooncake binds its handshake and TCP data ports to every interface. A wildcard address
 * (0.0.0.0 or ::) bound by code inside the Mooncake package becomes PDSIM_BIND_HOST (an IPv4
 * address; on an IPv6 socket its v4-mapped form). Every other bind -- Python's, ZMQ's, any
 * address that is not a wildcard -- is passed through unchanged.
 *
 * The handshake guard (accept(), shutdown(), close()): Mooncake's handshake listener serves one
 * connection at a time, waiting up to 5 s for a request and then up to 5 s for the peer to
 * close, so each idle connection holds up every peer's handshake by 5 s. For a listening port
 * named with pdsim_guard_port(), accept() instead takes in every new connection at once and
 * returns only one whose whole request (an 8-byte length, then that many bytes) is already
 * buffered; a connection that has sent none within GUARD_IDLE_MS is closed, and at most
 * GUARD_MAX_PENDING wait at once (the oldest goes first). After the reply, Mooncake's
 * shutdown(SHUT_WR) on such a connection also shuts its read side, so Mooncake's wait for the
 * peer to close ends at once. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*shutdown_fn)(int, int);
typedef int (*close_fn)(int);

static int from_mooncake(const void *caller) {
    Dl_info info;
    return dladdr(caller, &info) && info.dli_fname && strstr(info.dli_fname, "/mooncake");
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    const char *host = getenv("PDSIM_BIND_HOST");
    struct in_addr v4;
    if (!host || !addr || inet_pton(AF_INET, host, &v4) != 1 ||
        !from_mooncake(__builtin_return_address(0)))
        return real_bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr = v4;
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
            memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
            a.sin6_addr.s6_addr[10] = 0xff;
            a.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&a.sin6_addr.s6_addr[12], &v4, sizeof v4);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}

/* ---- the handshake guard ------------------------------------------------------------------ */

#define GUARD_MAX_PORTS 16
#define GUARD_MAX_PENDING 128   /* connections waiting for their request, per listener */
#define GUARD_IDLE_MS 5000      /* Mooncake's own wait for a request, now per connection */
#define GUARD_SLICE_MS 1000     /* one accept() returns within this, as Mooncake's does */
#define GUARD_READY_BYTES 65536 /* a peer that sent this much is no idle peer: hand it over */
#define GUARD_LENGTH_BYTES 8    /* Mooncake's request header: a host-order uint64 length */
#define GUARD_MAX_FD 65536

struct pending {
    int fd;
    int64_t deadline_ms;
    struct sockaddr_storage addr;
    socklen_t addr_len;
};

struct listener {
    int fd; /* -1: free */
    int count;
    struct pending wait[GUARD_MAX_PENDING]; /* oldest first */
};

static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static int guarded_ports[GUARD_MAX_PORTS];      /* 0: free */
static struct listener *listeners[GUARD_MAX_PORTS];
static unsigned char handed_out[GUARD_MAX_FD / 8]; /* connections accept() returned */

static close_fn real_close_fn(void) {
    static close_fn real_close;
    if (!real_close) real_close = (close_fn)dlsym(RTLD_NEXT, "close");
    return real_close;
}

static void mark(int fd, int on) {
    if (fd < 0 || fd >= GUARD_MAX_FD) return;
    unsigned char bit = (unsigned char)(1u << (fd % 8));
    if (on)
        __atomic_fetch_or(&handed_out[fd / 8], bit, __ATOMIC_SEQ_CST);
    else
        __atomic_fetch_and(&handed_out[fd / 8], (unsigned char)~bit, __ATOMIC_SEQ_CST);
}

static int marked(int fd) {
    if (fd < 0 || fd >= GUARD_MAX_FD) return 0;
    return (__atomic_load_n(&handed_out[fd / 8], __ATOMIC_SEQ_CST) >> (fd % 8)) & 1;
}

/* Guard the listener on `port` from now on (its next accept()); 0 on success, -1 when
 * GUARD_MAX_PORTS are guarded already. Called from Python after Mooncake reports its port. */
int pdsim_guard_port(int port) {
    int rc = -1;
    pthread_mutex_lock(&guard_lock);
    for (int i = 0; i < GUARD_MAX_PORTS && rc != 0; i++)
        if (guarded_ports[i] == port) rc = 0;
    for (int i = 0; i < GUARD_MAX_PORTS && rc != 0; i++)
        if (guarded_ports[i] == 0) {
            guarded_ports[i] = port;
            rc = 0;
        }
    pthread_mutex_unlock(&guard_lock);
    return rc;
}

/* Whether Mooncake's listener on `port` has entered a guarded accept(): until then a connection
 * may still reach its own (a call already waiting when the port was named returns within 1 s). */
int pdsim_guard_active(int port) {
    int active = 0;
    pthread_mutex_lock(&guard_lock);
    for (int i = 0; i < GUARD_MAX_PORTS; i++)
        if (guarded_ports[i] == port && listeners[i] && listeners[i]->fd >= 0) active = 1;
    pthread_mutex_unlock(&guard_lock);
    return active;
}

static int local_port(int fd) {
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (getsockname(fd, (struct sockaddr *)&a, &len)) return -1;
    if (a.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&a)->sin_port);
    if (a.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&a)->sin6_port);
    return -1;
}

/* The guard state for listening socket `fd`, or NULL if `fd` is not a guarded blocking
 * listener (or no state could be had). */
static struct listener *listener_for(int fd) {
    int flags = fcntl(fd, F_GETFL);
    int listening = 0;
    socklen_t len = sizeof listening;
    if (flags < 0 || (flags & O_NONBLOCK) ||
        getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) || !listening)
        return NULL;
    int port = local_port(fd);
    struct listener *found = NULL;
    pthread_mutex_lock(&guard_lock);
    for (int i = 0; i < GUARD_MAX_PORTS && port > 0; i++) {
        if (guarded_ports[i] != port) continue;
        if (!listeners[i]) {
            struct listener *fresh = calloc(1, sizeof(struct listener));
            if (fresh) fresh->fd = -1;
            __atomic_store_n(&listeners[i], fresh, __ATOMIC_RELEASE);
        }
        if (listeners[i] && (listeners[i]->fd == fd || listeners[i]->fd == -1)) {
            listeners[i]->fd = fd;
            found = listeners[i];
        }
        break;
    }
    pthread_mutex_unlock(&guard_lock);
    return found;
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void drop(struct listener *l, int i) {
    real_close_fn()(l->wait[i].fd);
    memmove(&l->wait[i], &l->wait[i + 1], (size_t)(l->count - i - 1) * sizeof l->wait[0]);
    l->count--;
}

enum { WAITING, READY };

/* Whether connection `fd` has its whole request buffered; otherwise its low-water mark is set to
 * what it still needs, so poll() wakes for it only then. */
static int readiness(int fd) {
    int avail = 0;
    if (ioctl(fd, FIONREAD, &avail)) return READY; /* let Mooncake meet the error */
    int need = GUARD_LENGTH_BYTES;
    if (avail >= GUARD_LENGTH_BYTES) {
        uint64_t length;
        if (recv(fd, &length, sizeof length, MSG_PEEK | MSG_DONTWAIT) != (ssize_t)sizeof length)
            return READY;
        if (length == 0 || length > GUARD_READY_BYTES - GUARD_LENGTH_BYTES) return READY;
        need = GUARD_LENGTH_BYTES + (int)length;
    }
    if (avail >= need) return READY;
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &need, sizeof need);
    return WAITING;
}

/* Hand pending connection `i` to the caller of accept(). */
static int hand_over(struct listener *l, int i, struct sockaddr *addr, socklen_t *addr_len) {
    struct pending p = l->wait[i];
    memmove(&l->wait[i], &l->wait[i + 1], (size_t)(l->count - i - 1) * sizeof l->wait[0]);
    l->count--;
    int one = 1;
    setsockopt(p.fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    if (addr && addr_len) {
        memcpy(addr, &p.addr, p.addr_len < *addr_len ? p.addr_len : *addr_len);
        *addr_len = p.addr_len;
    }
    mark(p.fd, 1);
    return p.fd;
}

/* Take in one new connection (close-on-exec: a child started meanwhile must not keep it open);
 * its index in the waiting list, or -1. */
static int take_in(struct listener *l, int64_t now) {
    struct pending p;
    p.addr_len = sizeof p.addr;
    p.fd = accept4(l->fd, (struct sockaddr *)&p.addr, &p.addr_len, SOCK_CLOEXEC);
    if (p.fd < 0) {
        if ((errno == EMFILE || errno == ENFILE) && l->count) drop(l, 0);
        return -1;
    }
    if (l->count == GUARD_MAX_PENDING) drop(l, 0);
    p.deadline_ms = now + GUARD_IDLE_MS;
    l->wait[l->count] = p;
    return l->count++;
}

static int guarded_accept(struct listener *l, struct sockaddr *addr, socklen_t *addr_len) {
    int64_t until = now_ms() + GUARD_SLICE_MS;
    struct pollfd fds[GUARD_MAX_PENDING + 1];
    for (;;) {
        int64_t now = now_ms();
        for (int i = 0; i < l->count;) {
            if (l->wait[i].deadline_ms <= now)
                drop(l, i);
            else
                i++;
        }
        if (now >= until) {
            errno = EAGAIN;
            return -1;
        }
        int64_t wake = until;
        fds[0] = (struct pollfd){.fd = l->fd, .events = POLLIN};
        for (int i = 0; i < l->count; i++) {
            fds[i + 1] = (struct pollfd){.fd = l->wait[i].fd, .events = POLLIN | POLLRDHUP};
            if (l->wait[i].deadline_ms < wake) wake = l->wait[i].deadline_ms;
        }
        int n = l->count;
        int rc = poll(fds, (nfds_t)n + 1, (int)(wake - now));
        if (rc < 0 && errno != EINTR) return -1;
        if (rc <= 0) continue;
        /* fds[i + 1] is l->wait[i] until something is removed: walk back to front */
        for (int i = n - 1; i >= 0; i--) {
            short ev = fds[i + 1].revents;
            if (!ev) continue;
            if (readiness(l->wait[i].fd) == READY) return hand_over(l, i, addr, addr_len);
            if (ev & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) drop(l, i);
        }
        if (fds[0].revents & POLLIN) {
            int i = take_in(l, now);
            if (i >= 0 && readiness(l->wait[i].fd) == READY) return hand_over(l, i, addr, addr_len);
        }
    }
}

int accept(int fd, struct sockaddr *addr, socklen_t *addr_len) {
    static accept_fn real_accept;
    if (!real_accept) real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    struct listener *l = NULL;
    if (from_mooncake(__builtin_return_address(0))) l = listener_for(fd);
    if (!l) return real_accept(fd, addr, addr_len);
    return guarded_accept(l, addr, addr_len);
}

int shutdown(int fd, int how) {
    static shutdown_fn real_shutdown;
    if (!real_shutdown) real_shutdown = (shutdown_fn)dlsym(RTLD_NEXT, "shutdown");
    if (how == SHUT_WR && marked(fd)) how = SHUT_RDWR; /* the reply is out: read nothing more */
    return real_shutdown(fd, how);
}

/* No lock here: a child process closes its inherited descriptors between fork() and exec(). A
 * listener is closed by Mooncake only after its accepting thread has stopped. */
int close(int fd) {
    if (marked(fd)) mark(fd, 0);
    for (int i = 0; i < GUARD_MAX_PORTS; i++) {
        struct listener *l = __atomic_load_n(&listeners[i], __ATOMIC_ACQUIRE);
        if (l && __atomic_load_n(&l->fd, __ATOMIC_ACQUIRE) == fd) {
            while (l->count) drop(l, l->count - 1);
            __atomic_store_n(&l->fd, -1, __ATOMIC_RELEASE);
            __atomic_store_n(&guarded_ports[i], 0, __ATOMIC_RELEASE); /* the engine is gone */
        }
    }
    return real_close_fn()(fd);
}
