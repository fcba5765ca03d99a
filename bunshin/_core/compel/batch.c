/* Many system calls in one stop. A single injected call costs a ptrace stop (the single step
 * over its instruction) and a register round trip; the fork engine makes dozens per process.
 * Here a blob (arch/x86_64_batch.c) walks a table of calls inside the tracee and ends with
 * int3: one resume, one stop, for the whole table.
 *
 * The thread ends in the signal-delivery stop of that int3's SIGTRAP, as after
 * bx_syscall_seized's step; every later step (another injection, cure, detach) resumes from
 * it with signal 0, which discards the SIGTRAP. Signals that arrive while the
 * blob runs are held back as run_to_exit holds them, and calls they interrupt are restarted by
 * the kernel inside the blob. */
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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
		if ((err = bx_wait(c, tid, &st)) == -ETIMEDOUT) { /* a call that blocks: stopped */
			if (!bx_stop_overdue(c, tid, PTRACE_CONT))
				bx_arch_get_regs(tid, &c->cur);
			c->overdue = tid;
			return -ETIMEDOUT;
		}
		if (err)
			return err;
		int event = st >> 16, sig = WSTOPSIG(st);
		if (bx_fork_event(c, tid, st)) {
			/* noted in c->last_child */
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

/* --- the control block's own page ----------------------------------------------------------
 * Mapped by one injected mmap when first needed; its first batch begins with
 * madvise(MADV_DONTFORK), so the clones bx_clone3_seized makes never inherit it (but a CLONE_VM
 * clone, sharing the memory, borrows it). Reused while seized: the engine clones each template
 * process several times per seize, and a mapping per clone would cost more than it saves. */

int bx_batch_page_seized(struct bx_ctl *c, unsigned long *addr)
{
	if (!c->page) {
		if (c->page_refused)
			return -EPERM;
		if (bx_batch_code_size() > BX_PAGE_TABLE)
			return bx_fail(c, BX_STEP_BATCH, -E2BIG);
		unsigned long a;
		int err = bx_remote_mmap_seized(c, 0, BX_PAGE_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
						MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, &a);
		if (err == -EPERM || err == -EACCES) { /* SELinux execmem, MDWE: not an error */
			c->page_refused = 1;
			c->step = BX_STEP_NONE;
			return -EPERM;
		}
		if (err)
			return err;
		c->page = a;
		c->page_owned = 1;
		c->page_fresh = 1;
		bx_log("%d: batch page at %#lx", c->pid, a);
	}
	*addr = c->page;
	return 0;
}

/* Cure's part: unmap the page if it is ours, forget it either way. */
int bx_page_release(struct bx_ctl *c)
{
	int ret = 0;
	if (c->page && c->page_owned && !c->dead)
		ret = bx_remote_munmap_seized(c, c->page, BX_PAGE_SIZE);
	c->page = 0;
	c->page_owned = c->page_fresh = 0;
	return ret;
}

static int allowed(uint64_t ctl, int64_t rv)
{
	if (rv >= 0 || rv < -4095 || (ctl & BX_BATCH_OK_ERR))
		return 1;
	uint64_t e = (ctl & CTL_ERRNO) >> 32;
	return e && (int64_t)-e == rv;
}

/* What the blob does, with one injection per call. */
static int one_by_one(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone)
{
	for (size_t i = 0; i < n; i++) {
		unsigned long a[6];
		for (int j = 0; j < 6; j++)
			a[j] = tab[i].ctl & BX_BATCH_REF(j) ? (unsigned long)tab[tab[i].args[j]].ret
							    : tab[i].args[j];
		long rv;
		int err = bx_syscall_seized(c, (long)(tab[i].ctl & CTL_NR), a, &rv);
		if (err)
			return err;
		tab[i].ret = rv;
		*ndone = i + 1;
		if (!allowed(tab[i].ctl, rv))
			break;
	}
	return 0;
}

static int in_page(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone)
{
	struct bx_batch_entry all[BX_PAGE_MAX_CALLS + 1];
	size_t k = 0, done = 0;
	if (c->page_fresh) { /* first: keep the page out of the tracee's forks */
		memset(all, 0, sizeof all[0]);
		all[0].ctl = SYS_madvise;
		all[0].args[0] = c->page;
		all[0].args[1] = BX_PAGE_SIZE;
		all[0].args[2] = MADV_DONTFORK;
		k = 1;
	}
	memcpy(all + k, tab, n * sizeof *tab);
	for (size_t i = k; i < n + k; i++) /* references count from the table's start */
		for (int j = 0; j < 6; j++)
			if (all[i].ctl & BX_BATCH_REF(j))
				all[i].args[j] += k;
	int err = bx_batch_seized(c, c->page, c->page + BX_PAGE_TABLE, all, n + k, &done);
	if (err)
		return err;
	if (k && (!done || all[0].ret))
		return bx_fail(c, BX_STEP_BATCH, done ? (int)all[0].ret : -EIO);
	c->page_fresh = 0;
	for (size_t i = k; i < done; i++)
		tab[i - k].ret = all[i].ret;
	*ndone = done - k;
	return 0;
}

/* may_map 0: only in a page already there (a clone's first calls must not map one). */
int bx_calls_run(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone,
		 int may_map)
{
	unsigned long page;
	int err;
	*ndone = 0;
	if (c->dead)
		return bx_fail(c, BX_STEP_BATCH, -ESRCH);
	if (n > BX_PAGE_MAX_CALLS || (err = check_table(tab, n)))
		return bx_fail(c, BX_STEP_BATCH, n > BX_PAGE_MAX_CALLS ? -E2BIG : err);
	if (!n)
		return 0;
	if (!c->page && !may_map)
		return one_by_one(c, tab, n, ndone);
	err = bx_batch_page_seized(c, &page);
	if (err == -EPERM && c->page_refused)
		return one_by_one(c, tab, n, ndone);
	return err ? err : in_page(c, tab, n, ndone);
}

int bx_calls_seized(struct bx_ctl *c, struct bx_batch_entry *tab, size_t n, size_t *ndone)
{
	return bx_calls_run(c, tab, n, ndone, 1);
}
