/* The control protocol between a trainer and a workspace's init (bunshin-init).
 *
 * One SOCK_SEQPACKET connection per workspace: every message is one datagram made of a
 * struct bx_msg header and `len` payload bytes. File descriptors travel as SCM_RIGHTS on
 * the same datagram. Payloads larger than BX_MAX_INLINE travel in a memfd passed as the
 * last descriptor (flag BX_F_PAYLOAD_FD), because a datagram must fit the socket buffer.
 *
 * The Python side reads these numbers from the compiled core (bunshin._core._syscalls),
 * so this header is the only place they are written down.
 */
#ifndef BUNSHIN_PROTO_H
#define BUNSHIN_PROTO_H

#include <stdint.h>

#define BX_PROTO_VERSION 1
#define BX_MAX_INLINE    (48 * 1024)
#define BX_MAX_FDS       8
#define BX_CTL_FD        3 /* init finds its control socket here */

enum bx_type {
	/* trainer -> init */
	BX_REQ_SPAWN = 1,  /* payload: struct bx_spawn + strings; fds: stdin, stdout, stderr */
	BX_REQ_KILL = 2,   /* payload: struct bx_kill */
	BX_REQ_PING = 3,
	BX_REQ_SHUTDOWN = 4,
	BX_REQ_REROOT = 5, /* to a just-forked init: fds [root mount, new control socket] or those +
			      [net, ipc, uts] namespaces to join; payload: hostname */
	/* init -> trainer */
	BX_REP_READY = 64,   /* payload: struct bx_ready; sent once after setup */
	BX_REP_SPAWNED = 65, /* payload: struct bx_spawned; answers BX_REQ_SPAWN */
	BX_REP_EXITED = 66,  /* payload: struct bx_exited; a spawned process was reaped */
	BX_REP_ACK = 67,     /* payload: int32 errno (0 = done); answers KILL and PING */
	BX_REP_FATAL = 68,   /* payload: message text; setup failed, init exits */
};

struct bx_msg {
	uint32_t type;
	uint32_t flags;
	uint64_t id;  /* chosen by the requester, echoed in the answer */
	uint32_t len; /* payload bytes that follow (or in the payload memfd) */
	uint32_t nfds;
};

/* BX_REQ_SPAWN flags */
#define BX_F_PAYLOAD_FD 0x1  /* the payload is in the last fd (memfd), not inline */
#define BX_SPAWN_SETSID 0x10 /* new session: the call's process group is its own */
#define BX_SPAWN_CTTY   0x20 /* make stdin (a pty slave) the controlling terminal */
#define BX_SPAWN_TRACK  0x40 /* report BX_REP_EXITED when this process is reaped */
#define BX_SPAWN_USER   0x80 /* a struct bx_user and its groups precede the strings */
#define BX_MAX_GROUPS   64   /* supplementary groups a struct bx_user may carry */

/* followed by: cwd\0 argv[0]\0 ... argv[argc-1]\0 env[0]\0 ... env[envc-1]\0 */
struct bx_spawn {
	uint32_t argc;
	uint32_t envc;
	uint32_t umask;
	uint32_t reserved;
};

/* BX_SPAWN_USER: the process runs with these ids (an image's User), followed by
 * uint32_t groups[ngroups], its supplementary groups */
struct bx_user {
	uint32_t uid;
	uint32_t gid;
	uint32_t ngroups;
	uint32_t reserved;
};

struct bx_spawned {
	int32_t pid; /* in the workspace's pid namespace; 0 on failure */
	int32_t err; /* errno of the failed step (exec, chdir, fork), 0 on success */
	int32_t step; /* enum bx_step */
	int32_t reserved;
};

enum bx_step { BX_STEP_NONE = 0, BX_STEP_FORK = 1, BX_STEP_CHDIR = 2, BX_STEP_EXEC = 3, BX_STEP_FDS = 4, BX_STEP_CTTY = 5,
	       BX_STEP_USER = 6 };

/* BX_REQ_KILL */
#define BX_KILL_PID  0 /* kill(pid, sig) */
#define BX_KILL_PGRP 1 /* kill(-pid, sig) */
#define BX_KILL_ALL  2 /* kill(-1, sig): every process in the workspace but init */

struct bx_kill {
	int32_t pid;
	int32_t sig;
	int32_t scope;
	int32_t reserved;
};

struct bx_exited {
	int32_t pid;
	int32_t status; /* raw wait status */
};

struct bx_ready {
	uint32_t version; /* BX_PROTO_VERSION */
	int32_t pid;      /* init's pid in its own namespace (1) */
};

#endif
