/* Many system calls in one stop. A single injected call costs two ptrace stops (syscall entry
 * and exit) and a register round trip; the fork engine makes dozens per process. Here a blob
 * (arch/x86_64_batch.c) walks a table of calls inside the tracee and ends with int3: one
 * resume, one stop, for the whole table.
 *
 * The thread ends in the signal-delivery stop of that int3, not in a syscall-exit stop as after
 * bx_syscall_seized; both are ptrace stops every later step (another injection, cure, detach)
 * resumes from alike, with signal 0, which discards the SIGTRAP. Signals that arrive while the
 * blob runs are held back as run_to_exit holds them, and calls they interrupt are restarted by
 * the kernel inside the blob. */
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>

#include "internal.h"

#define LOG_PREFIX "batch: "

#define CTL_NR 0xffffULL
#define CTL_REFS (0x3fULL << 16)
#define CTL_ERRNO (0xfffULL << 32)

size_t bx_batch_code_size(void) { return bx_arch_batch_code_end - bx_arch_batch_code; }

/* The blob trusts its table: a reference must name an earlier entry. */
static int check_table(const struct bx_batch_entry *tab, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t ctl = tab[i].ctl;
		if (ctl & ~(CTL_NR | CTL_REFS | BX_BATCH_OK_ERR | CTL_ERRNO))
			return -EINVAL;
		for (int a = 0; a < 6; a++)
			if ((ctl & BX_BATCH_REF(a)) && tab[i].args[a] >= i)
				return -EINVAL;
	}
	return 0;
}

static int copy_in(struct bx_ctl *c, unsigned long code, unsigned long table,
		   const struct bx_batch_entry *tab, size_t n)
{
	static const uint64_t end = BX_BATCH_END;
	size_t csize = bx_batch_code_size(), tsize = n * sizeof *tab;
	struct iovec l[3] = {{(void *)bx_arch_batch_code, csize}, {(void *)tab, tsize},
			     {(void *)&end, sizeof end}};
	struct iovec r[2] = {{(void *)code, csize}, {(void *)table, tsize + sizeof end}};
	ssize_t put = process_vm_writev(c->pid, l, 3, r, 2, 0);
	if (put == (ssize_t)(csize + tsize + sizeof end))
		return 0;
	return put < 0 ? -errno : -EFAULT;
}

static int is_fault(int sig)
{
	return sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGFPE;
}

/* PTRACE_CONT until the blob's int3; c->cur gets the registers there. */
static int run_to_trap(struct bx_ctl *c, unsigned long code)
{
	pid_t tid = c->thr[0].tid;
	unsigned long end = code + bx_batch_code_size();
	int st, err;
	if (ptrace(PTRACE_CONT, tid, 0, 0))
		return -errno;
	for (;;) {
		if ((err = bx_wait(c, tid, &st)))
			return err;
		int event = st >> 16, sig = WSTOPSIG(st);
		if (event == PTRACE_EVENT_FORK || event == PTRACE_EVENT_CLONE ||
		    event == PTRACE_EVENT_VFORK) {
			unsigned long msg = 0;
			ptrace(PTRACE_GETEVENTMSG, tid, 0, &msg);
			c->last_child = (pid_t)msg;
		} else if (!event) {
			if ((err = bx_arch_get_regs(tid, &c->cur)))
				return err;
			unsigned long ip = bx_arch_ip(&c->cur);
			if (sig == SIGTRAP && ip == end)
				return 0;
			/* the blob itself faulted (its table is not mapped): resuming re-faults */
			if (is_fault(sig) && ip >= code && ip < end)
				return -EFAULT;
			if ((err = bx_hold_signal(c, tid, sig)))
				return err;
		}
		if (ptrace(PTRACE_CONT, tid, 0, 0))
			return -errno;
	}
}

static int read_rets(struct bx_ctl *c, unsigned long table, struct bx_batch_entry *tab,
		     size_t ndone)
{
	if (!ndone)
		return 0;
	struct bx_batch_entry *out = malloc(ndone * sizeof *out);
	if (!out)
		return -ENOMEM;
	int err = bx_peek(c, table, out, ndone * sizeof *out);
	for (size_t i = 0; !err && i < ndone; i++)
		tab[i].ret = out[i].ret;
	free(out);
	return err;
}

int bx_batch_seized(struct bx_ctl *c, unsigned long code_addr, unsigned long table_addr,
		    struct bx_batch_entry *tab, size_t n, size_t *ndone)
{
	int err;
	*ndone = 0;
	if (c->dead)
		return bx_fail(c, BX_STEP_BATCH, -ESRCH);
	if ((err = check_table(tab, n)))
		return bx_fail(c, BX_STEP_BATCH, err);
	if (!n)
		return 0;
	if ((err = copy_in(c, code_addr, table_addr, tab, n)))
		return bx_fail(c, BX_STEP_POKE, err);
	bx_regs_t r = c->thr[0].regs;
	bx_arch_setup_batch(&r, code_addr, table_addr);
	if ((err = bx_arch_set_regs(c->thr[0].tid, &r)))
		return bx_fail(c, BX_STEP_SETREGS, err);
	c->injected = 1;
	c->cured = 0;
	if ((err = run_to_trap(c, code_addr)))
		return bx_fail(c, BX_STEP_BATCH, err);
	unsigned long at = bx_arch_batch_cursor(&c->cur);
	if (at < table_addr || (at - table_addr) / sizeof *tab > n)
		return bx_fail(c, BX_STEP_BATCH, -EFAULT);
	size_t done = (at - table_addr) / sizeof *tab;
	if ((err = read_rets(c, table_addr, tab, done)))
		return err;
	*ndone = done;
	bx_log("%d: %zu of %zu calls ran, last = %ld", c->pid, done, n, done ? (long)tab[done - 1].ret : 0L);
	return 0;
}
