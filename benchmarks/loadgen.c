/* The native load client: agents looping claim -> event -> transition over keep-alive HTTP/1.1
 * connections, all of one process's agents on one epoll loop.
 *
 * A Python client spends more CPU per request than the server it measures (tens of
 * microseconds against a budget of about a hundred), so on a 2-core machine it takes the cores
 * the server needs. This one spends a few microseconds per request. benchmarks/load.py builds
 * it with the system's C compiler and falls back to the Python client where there is none.
 *
 *   loadgen PORT AGENTS ROLE TRIGGER START_EPOCH_S NAME_PREFIX
 *
 * Prints one JSON object: completed task ids, latencies per endpoint in microseconds, error
 * counts by endpoint and status, and the process's own CPU seconds.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { CLAIM, EVENT, TRANSITION, ENDPOINTS };
static const char *ENDPOINT_NAMES[ENDPOINTS] = {"claim", "event", "transition"};

typedef struct {
    double *v;
    size_t n, cap;
} Series;

typedef struct {
    char name[64];
    int fd;
    int phase; /* the endpoint whose answer is awaited */
    int done;
    char out[1024];
    size_t out_len, out_sent;
    char *in;
    size_t in_len, in_cap;
    char run[64], task[64], token[128];
    double t0;
} Agent;

static Series latencies[ENDPOINTS];
static char **completed;
static size_t n_completed, cap_completed;
static long errors[ENDPOINTS][600];
static const char *role, *trigger;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void push(Series *s, double x) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 1024;
        s->v = realloc(s->v, s->cap * sizeof(double));
        if (!s->v) abort();
    }
    s->v[s->n++] = x;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* Copy the JSON string value that starts right after `key` (which ends with the opening
 * quote) into dst; 0 when the key is missing. */
static int string_after(const char *hay, size_t len, const char *key, int last, char *dst,
                        size_t cap) {
    const char *found = NULL, *p = hay, *end = hay + len;
    size_t klen = strlen(key);
    while ((p = memmem(p, end - p, key, klen)) != NULL) {
        found = p;
        if (!last) break;
        p += klen;
    }
    if (!found) return 0;
    const char *s = found + klen, *q = memchr(s, '"', end - s);
    if (!q || (size_t)(q - s) >= cap) return 0;
    memcpy(dst, s, q - s);
    dst[q - s] = 0;
    return 1;
}

static void prepare(Agent *a, int phase) {
    const char *body_fmt = NULL;
    char path[160], body[256], auth[192] = "";
    switch (phase) {
    case CLAIM:
        snprintf(path, sizeof path, "/leases/claim");
        snprintf(body, sizeof body, "{\"agent_id\":\"%s\",\"agent_role\":\"%s\"}", a->name, role);
        break;
    case EVENT:
        snprintf(path, sizeof path, "/runs/%s/events", a->run);
        body_fmt = "{\"kind\":\"progress\",\"data\":{\"step\":1}}";
        snprintf(body, sizeof body, "%s", body_fmt);
        break;
    default:
        snprintf(path, sizeof path, "/runs/%s/transition", a->run);
        snprintf(body, sizeof body, "{\"trigger\":\"%s\"}", trigger);
        break;
    }
    if (phase != CLAIM) snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", a->token);
    a->out_len = (size_t)snprintf(a->out, sizeof a->out,
                                  "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                  "application/json\r\n%sContent-Length: %zu\r\n\r\n%s",
                                  path, auth, strlen(body), body);
    a->out_sent = 0;
    a->in_len = 0;
    a->phase = phase;
    a->t0 = now_s();
}

static int flush_out(Agent *a) {
    while (a->out_sent < a->out_len) {
        ssize_t n = send(a->fd, a->out + a->out_sent, a->out_len - a->out_sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN) return 0;
            die("send");
        }
        a->out_sent += (size_t)n;
    }
    return 1;
}

/* A whole response in a->in? Returns its status and sets the body and its length, or 0 if partial. */
static int response(Agent *a, const char **body, size_t *body_len) {
    const char *head_end = memmem(a->in, a->in_len, "\r\n\r\n", 4);
    if (!head_end) return 0;
    size_t head = (size_t)(head_end - a->in) + 4, length = 0;
    for (const char *p = a->in; p < head_end; p++) {
        if ((*p == 'c' || *p == 'C') && strncasecmp(p, "content-length:", 15) == 0) {
            length = strtoul(p + 15, NULL, 10);
            break;
        }
    }
    if (a->in_len < head + length) return 0;
    *body = a->in + head;
    *body_len = length;
    return atoi(a->in + 9);
}

static void finished(Agent *a, int status, const char *body, size_t len) {
    double took = now_s() - a->t0;
    push(&latencies[a->phase], took * 1e6);
    int s = status > 0 && status < 600 ? status : 0;
    switch (a->phase) {
    case CLAIM:
        if (status == 204) {
            a->done = 1;
            return;
        }
        if (status != 200 || !string_after(body, len, "{\"task\":{\"id\":\"", 0, a->task, sizeof a->task) ||
            !string_after(body, len, "\"run\":{\"id\":\"", 1, a->run, sizeof a->run) ||
            !string_after(body, len, "\"lease_token\":\"", 1, a->token, sizeof a->token)) {
            errors[CLAIM][s]++;
            usleep(10000);
            prepare(a, CLAIM);
            return;
        }
        prepare(a, EVENT);
        return;
    case EVENT:
        if (status != 201) errors[EVENT][s]++;
        prepare(a, TRANSITION);
        return;
    default:
        if (status == 200) {
            if (n_completed == cap_completed) {
                cap_completed = cap_completed ? cap_completed * 2 : 1024;
                completed = realloc(completed, cap_completed * sizeof(char *));
                if (!completed) abort();
            }
            completed[n_completed++] = strdup(a->task);
        } else {
            errors[TRANSITION][s]++;
        }
        prepare(a, CLAIM);
    }
}

static void print_series(const Series *s) {
    putchar('[');
    for (size_t i = 0; i < s->n; i++) printf(i ? ",%.1f" : "%.1f", s->v[i]);
    putchar(']');
}

static void connect_agent(Agent *a, int ep, const struct sockaddr_in *addr) {
    a->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (a->fd < 0 || connect(a->fd, (const struct sockaddr *)addr, sizeof *addr) < 0) die("connect");
    int one = 1;
    setsockopt(a->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = a};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, a->fd, &ev) < 0) die("epoll_ctl");
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: loadgen PORT AGENTS ROLE TRIGGER START_EPOCH_S NAME_PREFIX\n");
        return 2;
    }
    int port = atoi(argv[1]), n = atoi(argv[2]);
    role = argv[3];
    trigger = argv[4];
    double start = atof(argv[5]);

    Agent *agents = calloc((size_t)n, sizeof(Agent));
    int ep = epoll_create1(0);
    if (!agents || ep < 0) die("setup");
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    for (int i = 0; i < n; i++) {
        Agent *a = &agents[i];
        snprintf(a->name, sizeof a->name, "%s-%d", argv[6], i);
        a->in_cap = 65536;
        a->in = malloc(a->in_cap);
        if (!a->in) abort();
        connect_agent(a, ep, &addr);
    }

    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    double wait = start - (wall.tv_sec + wall.tv_nsec / 1e9);
    if (wait > 0) usleep((useconds_t)(wait * 1e6));

    int live = n;
    for (int i = 0; i < n; i++) {
        prepare(&agents[i], CLAIM);
        flush_out(&agents[i]);
    }
    struct epoll_event events[256];
    while (live > 0) {
        int ready = epoll_wait(ep, events, 256, 60000);
        if (ready < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        if (ready == 0) {
            fprintf(stderr, "loadgen: no answer for 60 s\n");
            return 3;
        }
        for (int k = 0; k < ready; k++) {
            Agent *a = events[k].data.ptr;
            int eof = 0;
            for (;;) {
                if (a->in_len == a->in_cap) {
                    a->in_cap *= 2;
                    a->in = realloc(a->in, a->in_cap);
                    if (!a->in) abort();
                }
                ssize_t got = recv(a->fd, a->in + a->in_len, a->in_cap - a->in_len, MSG_DONTWAIT);
                if (got < 0 && errno == EAGAIN) break;
                if (got <= 0) { /* answers with Connection: close (the 204s) end so */
                    eof = 1;
                    break;
                }
                a->in_len += (size_t)got;
            }
            const char *body;
            size_t len;
            int status = response(a, &body, &len);
            if (!status) {
                if (eof) {
                    fprintf(stderr, "loadgen: connection closed by the server mid-answer\n");
                    return 3;
                }
                continue;
            }
            finished(a, status, body, len);
            if (a->done || eof) {
                epoll_ctl(ep, EPOLL_CTL_DEL, a->fd, NULL);
                close(a->fd);
            }
            if (a->done) {
                live--;
            } else {
                if (eof) connect_agent(a, ep, &addr);
                flush_out(a);
            }
        }
    }

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
                 ru.ru_stime.tv_usec / 1e6;
    printf("{\"completed\":[");
    for (size_t i = 0; i < n_completed; i++) printf(i ? ",\"%s\"" : "\"%s\"", completed[i]);
    printf("],\"latencies_us\":{");
    for (int e = 0; e < ENDPOINTS; e++) {
        printf(e ? ",\"%s\":" : "\"%s\":", ENDPOINT_NAMES[e]);
        print_series(&latencies[e]);
    }
    printf("},\"errors\":{");
    int first = 1;
    for (int e = 0; e < ENDPOINTS; e++)
        for (int s = 0; s < 600; s++)
            if (errors[e][s]) {
                printf(first ? "\"%s %d\":%ld" : ",\"%s %d\":%ld", ENDPOINT_NAMES[e], s,
                       errors[e][s]);
                first = 0;
            }
    printf("},\"cpu_s\":%.4f}\n", cpu);
    return 0;
}
