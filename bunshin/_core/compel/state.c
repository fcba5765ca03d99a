/* Per-thread state the fork engine needs to recreate a thread elsewhere. */
#include <elf.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/uio.h>

#include "internal.h"

#define LOG_PREFIX "state: "

#ifndef NT_X86_XSTATE
#define NT_X86_XSTATE 0x202
#endif

/* glibc's struct pthread: ... list_t list; pid_t tid; pid_t pid_unused; void *robust_prev;
 * struct robust_list_head robust_head; -- and glibc registers &robust_head with the kernel.
 * So the kernel tells us where the cached tid is; we check it holds the tid before trusting. */
#define GLIBC_TID_BEFORE_ROBUST_HEAD 16
#define TCB_SCAN_BYTES 4096

int bx_get_robust(pid_t tid, uint64_t *head, uint64_t *len)
{
	void *h = NULL;
	size_t l = 0;
	if (syscall(SYS_get_robust_list, tid, &h, &l))
		return -errno;
	*head = (uint64_t)(unsigned long)h;
	*len = l;
	return 0;
}

static struct bx_thread *find_thread(struct bx_ctl *c, pid_t tid)
{
	for (int i = 0; i < c->nthr; i++)
		if (c->thr[i].tid == tid)
			return &c->thr[i];
	return NULL;
}

unsigned long bx_find_tid_addr(struct bx_ctl *c, const struct bx_thread *t)
{
	uint64_t head = 0, len = 0;
	int32_t v;
	if (!bx_get_robust(t->tid, &head, &len) && head > GLIBC_TID_BEFORE_ROBUST_HEAD) {
		unsigned long at = head - GLIBC_TID_BEFORE_ROBUST_HEAD;
		if (!bx_peek(c, at, &v, sizeof v) && v == t->vtid) {
			if (bx_arch_tls(&t->regs))
				c->tid_off = at - bx_arch_tls(&t->regs);
			return at;
		}
	}
	/* A thread caught at birth has not registered its robust list yet: same libc, same
	 * layout, so the offset learned from its siblings holds. */
	unsigned long tcb = bx_arch_tls(&t->regs), found = 0;
	if (c->tid_off && tcb && !bx_peek(c, tcb + c->tid_off, &v, sizeof v) && v == t->vtid)
		return tcb + c->tid_off;
	/* Other libcs: the tid somewhere in the TCB after its self pointers; accepted only if it
	 * occurs once (a small tid such as 1 inside a namespace could match anything). */
	static int32_t buf[TCB_SCAN_BYTES / 4];
	if (!tcb || bx_peek(c, tcb, buf, sizeof buf)) {
		c->step = BX_STEP_NONE;
		return 0;
	}
	for (int i = 4; i < TCB_SCAN_BYTES / 4; i++) {
		if (buf[i] != t->vtid)
			continue;
		if (found)
			return 0;
		found = tcb + 4UL * i;
	}
	return found;
}

static uint64_t status_mask(pid_t tid, const char *key)
{
	char buf[64];
	return bx_status_field(tid, key, buf, sizeof buf) ? 0 : strtoull(buf, NULL, 16);
}

int bx_thread_state_seized(struct bx_ctl *c, pid_t tid, struct bx_thread_state *st)
{
	struct bx_thread *t = find_thread(c, tid);
	if (!t || !t->stopped)
		return bx_fail(c, BX_STEP_STATE, -ESRCH);
	memset(st, 0, sizeof *st);
	st->tid = t->tid;
	st->vtid = t->vtid;
	st->regs = t->regs;
	st->resume = t->regs;
	st->in_syscall = bx_arch_apply_restart(&st->resume);
	if (ptrace(PTRACE_GETSIGMASK, tid, sizeof st->sigmask, &st->sigmask))
		return bx_fail(c, BX_STEP_STATE, -errno);
	st->sigpending = status_mask(tid, "SigPnd");
	st->shdpending = status_mask(tid, "ShdPnd");
	struct {
		uint64_t addr;
		uint32_t len, sig, flags, pad;
	} rs = {0};
	if (ptrace(PTRACE_GET_RSEQ_CONFIGURATION, tid, sizeof rs, &rs) > 0) {
		st->rseq.addr = rs.addr;
		st->rseq.len = rs.len;
		st->rseq.sig = rs.sig;
		st->rseq.flags = rs.flags;
	}
	int ret = bx_get_robust(tid, &st->robust_list, &st->robust_len);
	if (ret)
		return bx_fail(c, BX_STEP_STATE, ret);
	st->tid_addr = bx_find_tid_addr(c, t);
	return 0;
}

long bx_xstate_seized(struct bx_ctl *c, pid_t tid, void *buf, size_t len)
{
	struct iovec io = {buf, len};
	if (ptrace(PTRACE_GETREGSET, tid, NT_X86_XSTATE, &io))
		return bx_fail(c, BX_STEP_STATE, -errno);
	return (long)io.iov_len;
}
